"""Reference KV-cache event publisher in Python, built the way vLLM builds its stream (msgspec
structs, msgspec msgpack encoder, pyzmq PUB), for the end-to-end events benchmark against
kvlink's Rust publisher.

Workload (the Rust side does the same): a pool of POOL_BATCHES batches' worth of events is made
before timing; each event has --hashes-per-event random u64 block hashes (about half >= 2**63),
a random u64 parent hash and hashes*block-size token ids below 150000. Batch b uses pool batch
b % POOL_BATCHES. The timed loop builds the BlockStored structs and the batch from those lists,
encodes the batch and sends [topic, seq (8 bytes big-endian), payload] on the PUB.

    .venv/bin/python tools/events-reference-publisher.py --endpoint tcp://127.0.0.1:5557 --batches 20000
    .venv/bin/python tools/events-reference-publisher.py --check
"""

import argparse
import json
import random
import resource
import sys
import time

import msgpack
import msgspec
import zmq

POOL_BATCHES = 8
TOKEN_ID_LIMIT = 150_000
TOPIC = b""


class BlockStored(msgspec.Struct, tag=True, tag_field="type", omit_defaults=True, gc=False):
    """Encoded as a map whose first key is "type" (vLLM >= 0.24); defaulted fields omitted."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type", omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """Encoded as the array [ts, events, dp_rank]."""

    ts: float
    events: list[BlockStored | BlockRemoved]
    data_parallel_rank: int | None


def make_pool(events_per_batch, hashes_per_event, block_size, seed=0):
    """(hashes, parent, token_ids) per event, POOL_BATCHES * events_per_batch of them."""
    rng = random.Random(seed)
    return [
        (
            [rng.getrandbits(64) for _ in range(hashes_per_event)],
            rng.getrandbits(64),
            [rng.randrange(TOKEN_ID_LIMIT) for _ in range(hashes_per_event * block_size)],
        )
        for _ in range(POOL_BATCHES * events_per_batch)
    ]


def cpu_seconds():
    """CPU time of the whole process (every thread, libzmq's I/O thread included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def publish(sock, pool, batches, events_per_batch, block_size):
    """The timed loop: builds, encodes and sends ``batches`` batches; returns seconds taken."""
    encoder = msgspec.msgpack.Encoder()
    start = time.perf_counter()
    for seq in range(batches):
        base = (seq % POOL_BATCHES) * events_per_batch
        events: list[BlockStored | BlockRemoved] = [
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=block_size,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
            for hashes, parent, tokens in pool[base : base + events_per_batch]
        ]
        payload = encoder.encode(EventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        sock.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload], copy=False)
    return time.perf_counter() - start


def pub_socket(ctx, endpoint):
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's default
    sock.setsockopt(zmq.LINGER, 5000)  # deliver what is queued at close, but never hang
    sock.bind(endpoint)
    return sock


def require(ok, what):
    if not ok:
        sys.exit(f"check failed: {what}")


def check(args, pool):
    """Publishes 3 batches to an in-process SUB and checks the wire form of each."""
    batches = 3
    ctx = zmq.Context()
    pub = pub_socket(ctx, args.endpoint)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(args.endpoint)
    time.sleep(args.start_delay)
    publish(pub, pool, batches, args.events_per_batch, args.block_size)
    stored_keys = [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    for seq in range(batches):
        require(sub.poll(5000, zmq.POLLIN), f"batch {seq} not received")
        frames = sub.recv_multipart()
        require(len(frames) == 3 and frames[0] == TOPIC, f"frames {frames[:2]!r}")
        require(frames[1] == seq.to_bytes(8, "big"), f"seq frame {frames[1]!r}")
        batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
        require(isinstance(batch, list) and len(batch) == 3, "batch is not [ts, events, rank]")
        ts, events, rank = batch
        require(isinstance(ts, float) and rank == 0, f"ts {ts!r}, dp_rank {rank!r}")
        require(len(events) == args.events_per_batch, f"{len(events)} events")
        base = seq * args.events_per_batch
        for event, (hashes, parent, tokens) in zip(events, pool[base:]):
            require(
                isinstance(event, dict) and list(event) == stored_keys,
                f"event keys {list(event) if isinstance(event, dict) else event!r}",
            )
            require(
                event["type"] == "BlockStored"
                and event["block_hashes"] == hashes
                and event["parent_block_hash"] == parent
                and event["token_ids"] == tokens
                and event["block_size"] == args.block_size
                and event["medium"] == "GPU",
                "event values differ from the pool",
            )
    sub.close()
    pub.close()
    ctx.term()
    print(json.dumps({"check": "ok", "batches": batches}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", help="PUB endpoint to bind (default for --check: inproc)")
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--events-per-batch", type=int, default=32)
    parser.add_argument("--hashes-per-event", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--start-delay",
        type=float,
        default=0.5,
        help="seconds between bind and the first batch (PUB drops until a subscriber is connected)",
    )
    parser.add_argument(
        "--check", action="store_true", help="publish 3 batches to an in-process subscriber and check them"
    )
    args = parser.parse_args()
    pool = make_pool(args.events_per_batch, args.hashes_per_event, args.block_size)
    if args.check:
        args.endpoint = args.endpoint or "inproc://bench-events-check"
        check(args, pool)
        return
    if not args.endpoint:
        parser.error("--endpoint is required")
    ctx = zmq.Context()
    sock = pub_socket(ctx, args.endpoint)
    time.sleep(args.start_delay)
    cpu = cpu_seconds()
    seconds = publish(sock, pool, args.batches, args.events_per_batch, args.block_size)
    entries = args.batches * args.events_per_batch * args.hashes_per_event
    sock.close()
    ctx.term()  # waits until libzmq's I/O thread has sent what was queued (linger)
    cpu = cpu_seconds() - cpu
    print(
        json.dumps(
            {
                "publisher": "python-msgspec",
                "batches": args.batches,
                "entries": entries,
                "seconds": seconds,
                "entries_per_s": entries / seconds,
                "cpu_s": cpu,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
