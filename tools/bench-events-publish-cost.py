#!/usr/bin/env python3
"""The cost of publishing KV events from Python: kvlink.events.Publisher against a
msgspec + pyzmq publisher built like vLLM's ZmqEventPublisher (event structs encoded by msgspec
on a publisher thread fed by a queue, [topic, seq, payload] on a PUB socket), in the same run.

For each publisher, in this process: N batches of E BlockStored events (one page of 16 tokens
each) are published as an engine would each scheduler step, then the publisher is drained and
closed. A subscriber process (pyzmq SUB) counts what arrives, so every batch is really sent.
Reported per event: CPU time of the publishing process (all its threads: the caller's
conversion and the publisher thread's encoding and sending) and wall time.

    .venv/bin/python tools/bench-events-publish-cost.py [--batches 4000] [--events 32] [--runs 5]
"""

import argparse
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

SUBSCRIBER = r"""
import sys, zmq
port, want = int(sys.argv[1]), int(sys.argv[2])
ctx = zmq.Context()
s = ctx.socket(zmq.SUB)
s.setsockopt(zmq.SUBSCRIBE, b"")
s.setsockopt(zmq.RCVHWM, 0)
s.connect(f"tcp://127.0.0.1:{port}")
print("READY", flush=True)
n = 0
while n < want:
    if not s.poll(20000):
        break
    s.recv_multipart()
    n += 1
print(n, flush=True)
"""


# The reference's event types, declared as vLLM declares them (tagged structs, omit_defaults;
# the batch an array).
class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored]
    data_parallel_rank: int | None = None


class ReferencePublisher:
    """The shape of vLLM's ZmqEventPublisher: a queue and a thread that encodes and sends."""

    def __init__(self, port: int):
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=100_000)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            batch = self.queue.get()
            if batch is None:
                return
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), enc.encode(batch)], copy=False)
            seq += 1

    def publish(self, events: list, ts: float) -> None:
        self.queue.put(EventBatch(ts=ts, events=events, data_parallel_rank=0))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        self.pub.close(linger=5000)
        self.ctx.term()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(kind: str, batches: int, per: int) -> dict:
    port = free_port()
    sub = subprocess.Popen(
        [sys.executable, "-c", SUBSCRIBER, str(port), str(batches)], stdout=subprocess.PIPE, text=True
    )
    assert sub.stdout is not None
    assert sub.stdout.readline().strip() == "READY"
    make: Callable[[int, int], Any]
    pub: Any  # kvlink's Publisher or the reference one: the same calls
    if kind == "kvlink":
        from kvlink.events import Publisher

        pub = Publisher(f"tcp://*:{port}", max_queue=batches + 1)
        make = lambda b, i: {  # noqa: E731
            "type": "BlockStored",
            "block_hashes": [b * per + i],
            "parent_block_hash": None,
            "token_ids": list(range(16)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
    else:
        pub = ReferencePublisher(port)
        make = lambda b, i: BlockStored([b * per + i], None, list(range(16)), 16, None, "GPU", None)  # noqa: E731
    time.sleep(0.5)  # the subscription reaches the PUB
    # The events exist before the clock starts: an engine has them from its scheduler.
    steps = [[make(b, i) for i in range(per)] for b in range(batches)]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for b, events in enumerate(steps):
        if kind == "kvlink":
            pub.publish(events, ts=float(b))
        else:
            pub.publish(events, float(b))
    pub.close()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    got = int(sub.stdout.readline() or 0)
    sub.wait(30)
    n = batches * per
    # A PUB socket drops what a slow subscriber cannot take: reported, never hidden.
    return {"cpu_us_per_event": cpu / n * 1e6, "wall_us_per_event": wall / n * 1e6, "delivered": got / batches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=4000)
    ap.add_argument("--events", type=int, default=32, help="events per batch")
    ap.add_argument("--runs", type=int, default=5, help="runs of each, alternating; medians reported")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    results: dict[str, list[dict]] = {"kvlink": [], "msgspec+pyzmq": []}
    for _ in range(a.runs):
        results["kvlink"].append(run("kvlink", a.batches, a.events))
        results["msgspec+pyzmq"].append(run("reference", a.batches, a.events))
    med = {
        k: {m: statistics.median(r[m] for r in v) for m in ("cpu_us_per_event", "wall_us_per_event", "delivered")}
        for k, v in results.items()
    }
    ratio_cpu = med["kvlink"]["cpu_us_per_event"] / med["msgspec+pyzmq"]["cpu_us_per_event"]
    ratio_wall = med["kvlink"]["wall_us_per_event"] / med["msgspec+pyzmq"]["wall_us_per_event"]
    if a.json:
        print(json.dumps({"medians": med, "runs": results, "cpu_ratio": ratio_cpu, "wall_ratio": ratio_wall}))
        return
    print(f"{a.batches} batches x {a.events} BlockStored events, {a.runs} runs each (median), {os.cpu_count()} CPUs")
    for k, v in med.items():
        print(
            f"  {k:14s} CPU {v['cpu_us_per_event']:6.2f} us/event   wall {v['wall_us_per_event']:6.2f} us/event"
            f"   delivered {100 * v['delivered']:.1f}%"
        )
    print(f"  kvlink / msgspec+pyzmq: CPU {ratio_cpu:.2f}x, wall {ratio_wall:.2f}x (lower is cheaper)")


if __name__ == "__main__":
    main()
