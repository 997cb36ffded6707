#!/usr/bin/env python3
"""kvlink's fault soak: prefill and decode engines (tools/kvlink-soak) in processes of their
own, a steady stream of requests of mixed sizes over both block groups, faults at random times
from a seed, and the invariants (checks.py) checked all the time. Run by tools/soak.sh.

  soak.py --binary target/debug/kvlink-soak --minutes 1 [--seed S] [--out DIR]

Every request holds blocks on a prefill (filled with a seed of its own) and reads them into a
decode, which checks every byte. Faults: a prefill or a decode killed with SIGKILL and
restarted on the same port, a decode stopped (SIGSTOP) and resumed, a prefill that stops
polling, a hold that expires while its reader is stopped (its blocks overwritten), cancels,
a peer with the wrong key; inside the SoftRoCE VM (--vm) also the rxe devices' links taken down
and up. The last line says `soak: PASS` or `soak: FAIL`, with the seed to replay.
"""

import argparse
import json
import os
import queue
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Ledger  # noqa: E402
from faults import Faults  # noqa: E402
from report import report  # noqa: E402
from traffic import Traffic  # noqa: E402
from workers import Worker, free_port, rdma_resources  # noqa: E402

KEY = "soak-deployment-key-0123456789"
# The model every worker holds: 4 layers of K and V, 512 bytes per token and tensor, 16 tokens
# per block, odd layers in block group 1; a block of one group is 4 tensors of 8 KiB.
LAYERS = 4
TOKEN_BYTES = 512
GROUP_BLOCK_BYTES = (LAYERS // 2) * 2 * 16 * TOKEN_BYTES


def options(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--binary", required=True, help="the kvlink-soak worker")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=None, help="replays a run's schedule")
    p.add_argument("--out", default="target/soak", help="logs and report.json")
    p.add_argument("--prefills", type=int, default=2)
    p.add_argument("--decodes", default="tcp,auto", help="one transport per decode (tcp, auto, local, network, rdma)")
    p.add_argument("--concurrency", type=int, default=3, help="reads in flight per decode")
    p.add_argument("--blocks", type=int, default=96, help="blocks per engine")
    p.add_argument(
        "--quiet",
        type=float,
        default=5.0,
        help="seconds without faults after each: the cool-down recovery is judged by",
    )
    p.add_argument("--warmup", type=float, default=8.0, help="seconds before the first fault")
    p.add_argument("--vm", action="store_true", help="inside the SoftRoCE VM: RDMA, link faults")
    p.add_argument("--rdma-devices", default=os.environ.get("KVLINK_RDMA_DEVICES", "rxe0"))
    return p.parse_args(argv)


class Soak:
    """The run: its workers, traffic, faults and ledger."""

    def __init__(self, o):
        self.o = o
        self.rng = random.Random(o.seed)
        self.events: queue.Queue = queue.Queue()
        self.ledger = Ledger(request_timeout=10.0, lease=3.0, keepalive=0.5)
        os.makedirs(o.out, exist_ok=True)
        self.prefills = [self._worker(f"P{i}", self._prefill_args(i)) for i in range(o.prefills)]
        self.decodes = [self._worker(f"D{i}", self._decode_args(i, t)) for i, t in enumerate(o.decodes.split(","))]
        self.by_name = {w.name: w for w in self.prefills + self.decodes}
        self.block_bytes = GROUP_BLOCK_BYTES
        self.traffic = Traffic(self)
        self.faults = Faults(self)
        self.samples = {}  # (name, life) -> [(t, sample)]
        self.start = time.monotonic()  # again when the workers are up
        # Every event, as it came: the evidence behind a violation.
        self.event_log = open(os.path.join(o.out, "events.jsonl"), "w")

    def _worker(self, name, args):
        return Worker(name, self.o.binary, args, self._sink, self.o.out)

    def _sink(self, t, name, life, ev):
        self.events.put((t, name, life, ev))

    def _common(self, _name):
        args = [
            "--key",
            KEY,
            "--blocks",
            str(self.o.blocks),
            "--layers",
            str(LAYERS),
            "--token-bytes",
            str(TOKEN_BYTES),
            "--groups",
            "2",
        ]
        if self.o.vm:
            args += ["--rdma-device", self.o.rdma_devices]
        return args

    def _prefill_args(self, i):
        # A fixed port: a restarted prefill comes back where its readers look for it.
        return self._common(f"P{i}") + ["--listen", f"127.0.0.1:{free_port()}"]

    def _decode_args(self, i, transport):
        if self.o.vm and transport in ("tcp", "auto"):
            transport = "network"
        return self._common(f"D{i}") + ["--transport", transport]

    def all_workers(self):
        return self.prefills + self.decodes

    def now(self):
        return time.monotonic() - self.start

    def run(self):
        self.start = time.monotonic()
        for w in self.all_workers():
            w.start()
        end = self.o.minutes * 60
        next_sample = 0.0
        while self.now() < end:
            self._pump(0.02)
            self.traffic.issue()
            self.faults.tick()
            self._watch()
            if self.now() >= next_sample:
                next_sample = self.now() + 1.0
                self._sample()
            self.ledger.check_deadlines(self.now())
        self.faults.finish()
        self._drain()
        for w in self.all_workers():
            w.close()

    def _watch(self):
        """A worker that died when no fault killed it crashed: a violation, and it restarts."""
        for w in self.all_workers():
            if w.proc is not None and not w.alive() and not w.killed:
                code = w.proc.returncode
                self.ledger.violate(
                    self.now(), "crash", f"{w.name}.{w.life} exited {code} (log: {self.o.out}/{w.name}.{w.life}.log)"
                )
                self.traffic.worker_died(w)
                w.start()

    def _drain(self):
        """Stops issuing and waits for every request to end (or be overdue)."""
        limit = self.now() + self.ledger.request_timeout + 10.0
        while self.ledger.open_requests() and self.now() < limit:
            self._pump(0.05)
            self.ledger.check_deadlines(self.now())
        self.ledger.check_deadlines(self.now() + 3600)

    def _pump(self, wait):
        """Hands every waiting event to the traffic and the ledger."""
        try:
            item = self.events.get(timeout=wait)
        except queue.Empty:
            return
        while True:
            t, name, life, ev = item
            t -= self.start
            if ev.get("ev") != "stats":
                self.event_log.write(json.dumps({"t": round(t, 4), "w": f"{name}.{life}", **ev}) + "\n")
            self.traffic.event(t, name, life, ev)
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                return

    def _sample(self):
        t = self.now()
        rdma = rdma_resources() if self.o.vm else {}
        if self.o.vm:
            # The whole VM too: a queue pair whose creating thread is gone is counted here.
            total = {k: sum(r[k] for r in rdma.values()) for k in ("qps", "mr_bytes")}
            self.samples.setdefault(("VM", 0), []).append((t, total))
        for w in self.all_workers():
            s = w.sample()
            if s is not None:
                if self.o.vm:
                    mine = [rdma[task] for task in w.tasks() if task in rdma]
                    s.update({k: sum(r[k] for r in mine) for k in ("qps", "mr_bytes")})
                self.samples.setdefault((w.name, w.life), []).append((t, s))


def main(argv):
    o = options(argv)
    if o.seed is None:
        o.seed = random.SystemRandom().randrange(1, 2**31)
    print(
        f"soak: seed {o.seed} (replay with --seed {o.seed}), {o.minutes} min, "
        f"{o.prefills} prefills, decodes {o.decodes}{', in the VM' if o.vm else ''}",
        flush=True,
    )
    soak = Soak(o)
    try:
        soak.run()
    finally:
        for w in soak.all_workers():
            w.kill()
    text, summary, ok = report(soak)
    print(text)
    with open(os.path.join(o.out, "report.json"), "w") as f:
        json.dump(summary, f, indent=1)
    verdict = "PASS" if ok else "FAIL"
    print(
        f"soak: {verdict} seed={o.seed} minutes={o.minutes} requests={summary['requests']} "
        f"received={summary['received']} violations={len(soak.ledger.violations)}",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
