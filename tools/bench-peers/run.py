#!/usr/bin/env python3
"""Runs kvlink, NIXL and Mooncake on the same workload, round by round, and prints the medians.

Started by tools/bench-peers.sh (which builds kvlink-bench and installs the peers); run it
directly with the peers' venv Python to skip that. Each round runs every engine once per path,
in an order that rotates from round to round, so that noise from other tenants of the machine
falls on all of them. Bandwidth: kvlink-bench's default workload (Llama-3-8B layout, 4,096-token
requests of random blocks, 2 in flight, 2 warm-up + 16 measured), whose pieces `kvlink-bench
dump` writes for the peers. Latency: one read of one piece (4 KiB, 64 KiB, 1 MiB), one in flight.
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "peer_read.py")

# Each path's settings per engine: environment, peer_read options. None: no such path.
UCX_QUIET = {"UCX_MODULES": "^ib"}  # no IB module where none is used (its libnl crashes at exit)
MOONCAKE_TCP = {
    "MC_FORCE_TCP": "1",  # TCP even where an RDMA device exists: this path measures TCP
    # Mooncake refuses batches of more than ~2k pieces with its default lane limits
    # ("TCP lane queue-full"); 65535 is the largest value it accepts.
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
}
PATHS: dict[str, dict[str, Any]] = {
    "tcp": {
        "kvlink": ["--transport", "tcp"],
        # UCX otherwise picks shared memory between processes of one host.
        "nixl": ({"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", **UCX_QUIET}, []),
        "mooncake": (MOONCAKE_TCP, ["--protocol", "tcp"]),
    },
    "local": {
        "kvlink": ["--transport", "local"],
        "nixl": (UCX_QUIET, []),  # UCX's defaults: cma/shared memory within one host
        "mooncake": None,  # this wheel has no host-memory same-host transport
    },
    "rdma": {
        "kvlink": ["--transport", "rdma"],
        # RC over the device only: left to choose, UCX takes shared memory between two
        # processes of one (virtual) machine, which measured 7x the RC figure in the VM.
        "nixl": ({"UCX_TLS": "rc", "UCX_NET_DEVICES": os.environ.get("KVLINK_RDMA_DEVICE", "rxe0") + ":1"}, []),
        "mooncake": ({}, ["--protocol", "rdma", "--device", os.environ.get("KVLINK_RDMA_DEVICE", "rxe0")]),
    },
}


def run_kvlink(a, path, work):
    cmd = [a.bench, "loopback", "--json", *PATHS[path]["kvlink"], *work]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"kvlink-bench failed: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout)


def run_peer(a, engine, path, dump, port):
    env, opts = PATHS[path][engine]
    env = {**os.environ, **env}
    base = [
        sys.executable,
        PEER,
        "--engine",
        engine,
        "--workload",
        dump,
        "--port",
        str(port),
        "--host",
        a.host,
        "--local-host",
        a.host,
        "--deadline",
        str(a.timeout / 3),
        *opts,
    ]
    with tempfile.TemporaryFile("w+") as tlog:
        tgt = subprocess.Popen([base[0], base[1], "target", *base[2:]], env=env, stdout=tlog, stderr=subprocess.STDOUT)
        try:
            out = subprocess.run(
                [base[0], base[1], "initiator", *base[2:]], env=env, capture_output=True, text=True, timeout=a.timeout
            )
            tgt.wait(timeout=30)
        finally:
            if tgt.poll() is None:
                tgt.kill()
                tgt.wait()
        if out.returncode != 0 or tgt.returncode != 0:
            tlog.seek(0)
            raise RuntimeError(
                f"{engine} failed (initiator {out.returncode}, target "
                f"{tgt.returncode}): {out.stderr.strip()[-600:]}\n"
                f"target: {tlog.read().strip()[-600:]}"
            )
    return json.loads(out.stdout.strip().splitlines()[-1])


def dump(a, work, name):
    f = os.path.join(a.tmp, name)
    subprocess.run([a.bench, "dump", "--out", f, *work], check=True, capture_output=True, timeout=a.timeout)
    return f


def one(a, engine, path, work, dumpf, port):
    """One run: GB/s, CPU seconds per GB, p50 and p99 in ms (and kvlink's copy reference)."""
    if engine == "kvlink":
        r = run_kvlink(a, path, work)
    else:
        r = run_peer(a, engine, path, dumpf, port)
    gb = r["bytes"] / 1e9
    # What the caller saw: kvlink's from the read call to wait_finished returning it (its
    # report's own latency leaves out the caller's wake-up); the peers' drivers time their
    # polling loops the same way.
    lat = r.get("observed_ms") or r["latency_ms"]
    return {
        "engine": engine,
        "path": path,
        "gb_per_s": r["gb_per_s"],
        "cpu_s_per_gb": r["cpu_seconds"] / gb,
        "p50_ms": lat["p50"],
        "p99_ms": lat["p99"],
        "copy_gb_per_s": r.get("reference_gb_per_s"),
    }


def engines_of(path, only):
    return [
        e
        for e in ("kvlink", "nixl", "mooncake")
        if (e == "kvlink" or PATHS[path][e] is not None) and (not only or e in only)
    ]


def rounds(a, kind, work, dumpf, log):
    """All rounds of one workload; returns {(path, engine): [result, ...]}."""
    got: dict = {}
    port = itertools.count(a.port)
    for r in range(a.rounds):
        for path in a.paths:
            es = engines_of(path, a.engines)
            es = es[r % len(es) :] + es[: r % len(es)]  # rotate the order every round
            line = []
            for e in es:
                res = one(a, e, path, work, dumpf, next(port))
                res.update(round=r + 1, workload=kind)
                log.write(json.dumps(res) + "\n")
                log.flush()
                got.setdefault((path, e), []).append(res)
                line.append(
                    f"{e} {res['gb_per_s']:.3f} GB/s {res['cpu_s_per_gb']:.2f} CPU s/GB p50 {res['p50_ms']:.3f} ms"
                )
            print(f"[{kind}] round {r + 1} {path}: " + " | ".join(line), flush=True)
    return got


def med(rs, key):
    vals = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def table_bandwidth(got, paths):
    print("\nbandwidth (medians): path | engine | GB/s | CPU s per GB | p50 ms | p99 ms | kvlink / engine")
    for path in paths:
        k = med(got.get((path, "kvlink"), []), "gb_per_s")
        for (p, e), rs in got.items():
            if p != path:
                continue
            g = med(rs, "gb_per_s")
            ratio = f"{k / g:.2f}x" if e != "kvlink" else "-"
            print(
                f"{path} | {e} | {g:.3f} | {med(rs, 'cpu_s_per_gb'):.2f} | "
                f"{med(rs, 'p50_ms'):.1f} | {med(rs, 'p99_ms'):.1f} | {ratio}"
            )
        c = med(got.get((path, "kvlink"), []), "copy_gb_per_s")
        if path == "local" and c:
            print(f"local | plain copy (one thread) | {c:.3f} | | | | {k / c:.2f}x")


def table_latency(lat, paths, sizes):
    print(
        "\none-read latency (medians of the runs' p50 / p99, microseconds): "
        "size | path | engine | p50 | p99 | engine p50 / kvlink p50"
    )
    for size in sizes:
        for path in paths:
            rs = lat.get(size, {})
            k = med(rs.get((path, "kvlink"), []), "p50_ms")
            for (p, e), runs in rs.items():
                if p != path:
                    continue
                p50, p99 = med(runs, "p50_ms"), med(runs, "p99_ms")
                ratio = f"{p50 / k:.2f}x" if e != "kvlink" and k else "-"
                print(f"{size} | {path} | {e} | {1e3 * p50:.1f} | {1e3 * p99:.1f} | {ratio}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bench", required=True, help="the kvlink-bench binary")
    p.add_argument("--paths", default="tcp,local", help="tcp, local, rdma (comma-separated)")
    p.add_argument("--engines", default="", help="only these (comma-separated); all by default")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--latency-sizes", default="4K,64K,1M", help="empty: no latency runs")
    p.add_argument("--latency-requests", type=int, default=500)
    p.add_argument("--no-bandwidth", action="store_true")
    p.add_argument("--workload", default="", help="kvlink-bench options of the bandwidth workload (its defaults: none)")
    p.add_argument("--host", default="127.0.0.1", help="address the peers' targets listen on")
    p.add_argument("--port", type=int, default=5600, help="first control port")
    p.add_argument("--timeout", type=float, default=300, help="seconds for one run")
    p.add_argument("--out", default="bench-peers.jsonl", help="every run, one JSON line each")
    a = p.parse_args()
    a.paths = [x for x in a.paths.split(",") if x]
    a.engines = [x for x in a.engines.split(",") if x]
    sizes = [x for x in a.latency_sizes.split(",") if x]
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp, open(a.out, "w") as log:
        a.tmp = tmp
        if not a.no_bandwidth:
            work = a.workload.split()
            got = rounds(a, "bandwidth", work, dump(a, work, "bandwidth.bin"), log)
        lat = {}
        for size in sizes:
            work = [
                "--block-bytes",
                size,
                "--tokens",
                "1",
                "--concurrency",
                "1",
                "--warmup",
                "20",
                "--requests",
                str(a.latency_requests),
            ]
            lat[size] = rounds(a, f"latency {size}", work, dump(a, work, f"lat{size}.bin"), log)
    if not a.no_bandwidth:
        table_bandwidth(got, a.paths)
    if sizes:
        table_latency(lat, a.paths, sizes)
    print(f"\n{time.time() - started:.0f} s; every run in {a.out}")


if __name__ == "__main__":
    main()
