#!/usr/bin/env python3
"""Reads a kvlink-bench workload with another transfer engine, in two processes.

    peer_read.py target    --engine nixl|mooncake --workload FILE --port P
    peer_read.py initiator --engine nixl|mooncake --workload FILE --port P

The workload file is what `kvlink-bench dump` writes: the sizes of both caches and, per
request, its pieces `(remote_offset, local_offset, len)`, exactly the ranges kvlink reads for
the same options. The target fills its cache with a pattern (every 8-byte word unique),
registers it and sends what a reader needs over a plain TCP control socket. The initiator
registers its cache and issues each request as ONE transfer of all its pieces, with
`concurrency` requests in flight, like kvlink-bench. It checks every byte of the warm-up
requests and of the last requests (those no later request overwrote), and prints one JSON line:
bytes, seconds, GB/s, CPU seconds of both processes during the measured requests, and p50/p99
request latency. Every wait has a deadline; the process exits through `os._exit`, as NIXL 1.5.1
crashes in a library destructor at interpreter exit.
"""

import argparse
import faulthandler
import json
import os
import socket
import struct
import sys
import time

import numpy as np
from engines import make_engine

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def load_workload(path):
    """The header and, per request, an (n, 3) uint64 array of its pieces."""
    with open(path, "rb") as f:
        head = json.loads(f.readline())
        body = np.frombuffer(f.read(), dtype="<u8")
    reqs, at = [], 0
    for n in head["pieces"]:
        reqs.append(body[at : at + 3 * n].reshape(n, 3))
        at += 3 * n
    if at != body.size:
        raise ValueError(f"{path}: {body.size - at} words past the last request")
    return head, reqs


def fill(buf, seed):
    """Word k of the cache is k * GOLDEN + seed: a misplaced piece cannot match."""
    words = buf.view(np.uint64)
    step = 1 << 24
    for at in range(0, words.size, step):
        n = min(step, words.size - at)
        words[at : at + n] = np.arange(at, at + n, dtype=np.uint64) * GOLDEN + np.uint64(seed)


def check(local, pieces, seed):
    """Bytes checked; raises on the first piece that does not hold the target's bytes."""
    for ro, lo, n in pieces.tolist():
        want = np.arange(ro // 8, (ro + n) // 8, dtype=np.uint64) * GOLDEN + np.uint64(seed)
        if not np.array_equal(local[lo : lo + n].view(np.uint64), want):
            raise RuntimeError(f"piece remote {ro} -> local {lo} ({n} B) holds wrong bytes")
    return int(pieces[:, 2].sum())


def send(s, obj):
    data = json.dumps(obj).encode()
    s.sendall(struct.pack("!I", len(data)) + data)


def recv(s):
    def exact(n):
        buf = bytearray()
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("control socket closed")
            buf += chunk
        return bytes(buf)

    return json.loads(exact(struct.unpack("!I", exact(4))[0]))


def target(a, head):
    cache = np.zeros(head["remote_bytes"], dtype=np.uint8)
    fill(cache, a.seed)
    eng = make_engine(a.engine, "target", a)
    info = eng.serve(cache)
    with socket.create_server((a.host, a.port)) as srv:
        srv.settimeout(a.deadline)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(a.deadline)
            send(conn, {"seed": a.seed, **info})
            while True:  # "cpu" until "done"
                msg = recv(conn)
                if msg["op"] == "done":
                    break
                send(conn, {"cpu": time.process_time()})
    return 0


def connect(a):
    end = time.monotonic() + a.deadline
    while True:
        try:
            s = socket.create_connection((a.host, a.port), timeout=2)
            s.settimeout(a.deadline)
            return s
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def run_requests(eng, local_addr, reqs, concurrency, remote_addr):
    """Runs `reqs` with `concurrency` in flight; returns each one's seconds."""
    lat: list[float] = []
    pending: list = []
    nxt = 0
    while nxt < len(reqs) or pending:
        while nxt < len(reqs) and len(pending) < concurrency:
            p = reqs[nxt]
            t0 = time.perf_counter()
            pending.append((t0, eng.start(local_addr + p[:, 1], remote_addr + p[:, 0], p[:, 2])))
            nxt += 1
        t0, h = pending.pop(0)
        eng.wait(h)
        lat.append(time.perf_counter() - t0)
    return lat


def initiator(a, head, reqs):
    ctl = connect(a)
    info = recv(ctl)
    local = np.zeros(head["local_bytes"], dtype=np.uint8)
    local.view(np.uint64)[::512] = 0  # fault the pages in before timing
    eng = make_engine(a.engine, "initiator", a)
    laddr = np.uint64(eng.connect(local, info))
    raddr = np.uint64(info["addr"])
    c, w = head["concurrency"], head["warmup"]
    checked = 0
    for i in range(0, w, c):  # warm-up, each checked on a zeroed cache
        run_requests(eng, laddr, reqs[i : min(i + c, w)], c, raddr)
        for p in reqs[i : min(i + c, w)]:
            checked += check(local, p, info["seed"])
        local[:] = 0
    send(ctl, {"op": "cpu"})
    cpu_t0, cpu0 = recv(ctl)["cpu"], time.process_time()
    t0 = time.perf_counter()
    lat = run_requests(eng, laddr, reqs[w:], c, raddr)
    secs = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    send(ctl, {"op": "cpu"})
    cpu += recv(ctl)["cpu"] - cpu_t0
    for p in reqs[-c:]:
        checked += check(local, p, info["seed"])
    send(ctl, {"op": "done"})
    nbytes = sum(head["bytes"][w:])
    ms = np.array(lat) * 1e3
    print(
        json.dumps(
            {
                "engine": a.engine,
                "bytes": nbytes,
                "seconds": round(secs, 6),
                "gb_per_s": round(nbytes / secs / 1e9, 4),
                "cpu_seconds": round(cpu, 3),
                "latency_ms": {
                    "p50": round(float(np.percentile(ms, 50)), 4),
                    "p99": round(float(np.percentile(ms, 99)), 4),
                },
                "requests": len(lat),
                "verified_bytes": checked,
            }
        ),
        flush=True,
    )
    eng.close()
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("role", choices=["target", "initiator"])
    p.add_argument("--engine", choices=["nixl", "mooncake"], required=True)
    p.add_argument("--workload", required=True, help="a `kvlink-bench dump` file")
    p.add_argument("--host", default="127.0.0.1", help="the target's address")
    p.add_argument("--port", type=int, default=5555, help="control socket port")
    p.add_argument("--protocol", default="tcp", help="mooncake: tcp or rdma")
    p.add_argument("--device", default="", help="mooncake rdma: the RDMA device")
    p.add_argument("--local-host", default="127.0.0.1", help="mooncake: this engine's address")
    p.add_argument(
        "--nixl-initiator-thread", type=int, default=0, help="nixl: run the initiator's progress thread too (0 or 1)"
    )
    p.add_argument("--seed", type=int, default=7, help="fill pattern of the target")
    p.add_argument("--deadline", type=float, default=120, help="seconds for any one wait")
    a = p.parse_args()
    faulthandler.dump_traceback_later(3 * a.deadline, exit=True)  # a hang in C code ends too
    head, reqs = load_workload(a.workload)
    try:
        rc = target(a, head) if a.role == "target" else initiator(a, head, reqs)
    except Exception as e:  # noqa: BLE001 - one line naming the engine, then the exit status says it failed
        print(f"peer_read {a.engine} {a.role}: {type(e).__name__}: {e}", file=sys.stderr)
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    main()
