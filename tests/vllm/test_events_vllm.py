"""kvlink.events against vLLM's own KV-event code (vllm.distributed.kv_events, run unmodified):
a kvlink publisher in another process read by vLLM's msgspec decoder, vLLM's ZmqEventPublisher
read by kvlink's subscriber (live and replay), and vLLM's event objects published as they are."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import zmq

from kvlink.events import Publisher, Subscriber

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ports import free_port  # noqa: E402

N = 20


PUBLISHER = textwrap.dedent(
    """
    import sys, time
    from kvlink.events import Publisher

    port, replay_port, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    pub = Publisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}")
    print("READY", flush=True)
    sys.stdin.readline()  # the reader has subscribed
    for i in range(n):
        pub.publish([
            {"type": "BlockStored", "block_hashes": [2**64 - 1 - i, i], "parent_block_hash": i or None,
             "token_ids": list(range(i, i + 32)), "block_size": 16, "lora_id": None,
             "medium": "GPU", "lora_name": None, "group_idx": 0},
            {"type": "BlockRemoved", "block_hashes": [i], "medium": "CPU"},
        ] + ([{"type": "AllBlocksCleared"}] if i == n - 1 else []), ts=1000.0 + i, dp_rank=1)
    sys.stdin.readline()  # the reader has replayed
    print("STATS", pub.close(), flush=True)
    """
)


def test_kvlink_publisher_process_read_by_vllms_decoder():
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    port, replay_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, str(port), str(replay_port), str(N)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    try:
        assert proc.stdout.readline().strip() == "READY"
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(1.0)  # the subscription reaches kvlink's PUB
        proc.stdin.write("go\n")
        proc.stdin.flush()
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        got = []
        while len(got) < N:
            assert sub.poll(10_000), f"only {len(got)} batches arrived"
            topic, seq, payload = sub.recv_multipart()
            got.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
        for i, (seq, batch) in enumerate(got):
            assert seq == i and batch.ts == 1000.0 + i and batch.data_parallel_rank == 1
            stored, removed = batch.events[:2]
            assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
            assert stored.block_hashes == [2**64 - 1 - i, i] and stored.parent_block_hash == (i or None)
            assert stored.token_ids == list(range(i, i + 32)) and stored.block_size == 16
            assert stored.medium == "GPU" and stored.group_idx == 0
            assert removed.block_hashes == [i] and removed.medium == "CPU"
        assert isinstance(got[-1][1].events[-1], AllBlocksCleared)
        # vLLM's replay protocol against kvlink's replay socket.
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (N - 3).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5_000), "no replay answer"
            frames = dealer.recv_multipart()
            if frames[-2] == b"\xff" * 8:
                break
            replayed.append((int.from_bytes(frames[-2], "big"), decoder.decode(frames[-1]).ts))
        dealer.close()
        assert replayed == [(s, 1000.0 + s) for s in range(N - 3, N)]
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert proc.stdout.readline().startswith("STATS")
    finally:
        proc.kill()
        proc.wait()
        ctx.destroy(linger=0)  # closes the sockets an assertion may have left open


def test_vllms_publisher_read_by_kvlink_subscriber():
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

    port, replay_port = free_port(), free_port()
    pub = ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}", topic="kv"
    )
    try:
        sub = Subscriber(f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv")
        time.sleep(0.5)
        for i in range(N):
            pub.publish(
                KVEventBatch(
                    ts=2000.0 + i,
                    events=[
                        BlockStored(
                            block_hashes=[i, 2**63 + i], parent_block_hash=None, token_ids=list(range(16)),
                            block_size=16, lora_id=None, medium="GPU", lora_name=None,
                        ),
                        BlockRemoved(block_hashes=[i], medium="GPU"),
                    ],
                )
            )
        got = []
        end = time.monotonic() + 15
        while len(got) < N and time.monotonic() < end:
            item = sub.next(0.5)
            if item is not None and item["kind"] != "gap_filled":
                got.append(item)
        assert [g["seq"] for g in got] == list(range(N)), got[:3]
        for i, g in enumerate(got):
            assert g["kind"] == "batch" and g["ts"] == 2000.0 + i and g["dp_rank"] == 0 and g["skipped"] == []
            stored, removed = g["events"]
            assert stored["block_hashes"] == [i, 2**63 + i] and stored["token_ids"] == list(range(16))
            assert removed == {"type": "BlockRemoved", "block_hashes": [i], "medium": "GPU", "group_idx": None,
                               "locality": None, "ownership": None}
        # A late subscriber starting from 0 gets vLLM's whole history by replay.
        late = Subscriber(f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv", start_from=0)
        first = late.next(5.0)
        assert first is not None and first["kind"] == "batch" and first["seq"] == 0, first
    finally:
        pub.shutdown()


def test_vllm_event_objects_published_as_they_are():
    from vllm.distributed.kv_events import BlockStored

    port = free_port()
    with Publisher(f"tcp://*:{port}") as pub:
        sub = Subscriber(f"tcp://127.0.0.1:{port}")
        time.sleep(1.0)
        ev = BlockStored(
            block_hashes=[5], parent_block_hash=4, token_ids=[1, 2, 3], block_size=16, lora_id=7,
            medium="GPU", lora_name="adapter", group_idx=2, kv_cache_spec_kind="full_attention",
        )
        pub.publish([ev], ts=3.25)
        item = sub.next(10.0)
        assert item is not None
        (got,) = item["events"]
        assert {k: got[k] for k in ("block_hashes", "parent_block_hash", "token_ids", "lora_id", "lora_name",
                                    "group_idx", "kv_cache_spec_kind")} == {
            "block_hashes": [5], "parent_block_hash": 4, "token_ids": [1, 2, 3], "lora_id": 7,
            "lora_name": "adapter", "group_idx": 2, "kv_cache_spec_kind": "full_attention"}
