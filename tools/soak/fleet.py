#!/usr/bin/env python3
"""kvlink's fleet run: P prefill and D decode engines (tools/kvlink-soak) in processes of their
own, every decode reading from every prefill, and what each session costs. Run by
tools/soak.sh --fleet P,D.

  fleet.py --binary target/debug/kvlink-soak --fleet 32,32 [--vm] [--session-idle S]

Phases, each measured from /proc (fds, threads, anonymous resident memory) and the engines'
gauges (sessions, control and data connections, RDMA queue pairs):
  start    every engine up, no session: the baseline of each process;
  connect  every decode connects to every prefill (its P connects one after another, all
           decodes at once): the handshake times, p50 and p99;
  read     every decode reads a request of two blocks from every prefill, checked byte for
           byte;
  up       P x D sessions open: each process's cost per session, against its baseline;
  idle     no traffic: every session closes in order after --session-idle seconds, and each
           process comes back to its baseline;
  rotate   each decode reads from one prefill at a time and moves to the next every --step
           seconds: the most sessions a decode holds stays within what the idle limit allows,
           however many prefills there are, and no process grows past what it held in `up`.
With --session-idle 0 (sessions never closed idle) the idle phase is left out and rotating
shows what a decode holds without the limit.
The last line says `fleet: PASS` or `fleet: FAIL`; report.json in --out has every figure.
"""

import argparse
import json
import os
import queue
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fleet_math import leftover, median, per_session, percentile, rotation_bound, timer_lag  # noqa: E402
from workers import Worker, rdma_resources  # noqa: E402

# How often a worker sends its stats (STATS_EVERY in tools/kvlink-soak/src/worker.rs).
STATS_EVERY_S = 1.0

KEY = "fleet-deployment-key-0123456789"
LAYERS, TOKEN_BYTES = 4, 512
# One block of each group per request: 2 layers of K and V, 16 tokens of 512 bytes, twice.
REQUEST_BYTES = 2 * (LAYERS // 2) * 2 * 16 * TOKEN_BYTES
# What may stay above the baseline once every session closed (a worker's own noise).
SLACK = {"fds": 2, "threads": 2, "qps": 0}
# What may grow while rotating beyond what a process held with every session up (allocator
# noise; in `up` a decode already held a session to every prefill).
ROTATE_SLACK = {"fds": 2, "threads": 2, "qps": 0, "rss_anon_kib": 1024}


def options(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--binary", required=True, help="the kvlink-soak worker")
    p.add_argument("--fleet", default="8,8", help="prefills,decodes")
    p.add_argument("--vm", action="store_true", help="inside the SoftRoCE VM: RDMA sessions")
    p.add_argument("--rdma-devices", default=os.environ.get("KVLINK_RDMA_DEVICES", "rxe0"))
    p.add_argument(
        "--session-idle",
        type=float,
        default=None,
        help="seconds; 0: never closed idle (default: 2, or P x D / 256 when longer, "
        "so that the connects and reads of a large fleet on a small machine "
        "end before the first session goes idle; in the VM 5, or P x D / 16)",
    )
    p.add_argument(
        "--step", type=float, default=None, help="rotate: seconds per prefill (default a quarter of --session-idle)"
    )
    p.add_argument("--steps", type=int, default=20, help="rotate: how many prefills in turn")
    p.add_argument("--out", default="target/fleet")
    o = p.parse_args(argv)
    o.prefills, o.decodes = (int(x) for x in o.fleet.split(","))
    if o.session_idle is None:
        # The VM's handshakes make queue pairs on emulated CPUs: about 200 ms each.
        o.session_idle = max(5.0, o.prefills * o.decodes / 16) if o.vm else max(2.0, o.prefills * o.decodes / 256)
    if o.step is None:
        o.step = (o.session_idle or 2.0) / 4
    return o


class Fleet:
    """The run: its workers, their events, and what each phase found."""

    def __init__(self, o):
        self.o = o
        os.makedirs(o.out, exist_ok=True)
        self.events: queue.Queue = queue.Queue()
        blocks = max(o.prefills, o.decodes) + 4
        common = [
            "--key",
            KEY,
            "--blocks",
            str(blocks),
            "--layers",
            str(LAYERS),
            "--token-bytes",
            str(TOKEN_BYTES),
            "--groups",
            "2",
            "--session-idle-ms",
            str(int(o.session_idle * 1000)),
            # Data streams outlive the session's idle limit: only that limit ends them.
            "--idle-ms",
            str(int(max(o.session_idle, 5.0) * 4000)),
            "--handshake-ms",
            "10000",
            "--connect-ms",
            "10000",
            "--request-ms",
            "30000",
            # The engine's default keep-alive (the soak's is short, to find faults fast).
            "--keepalive-ms",
            "5000",
        ]
        if o.vm:
            common += ["--rdma-device", o.rdma_devices]
        transport = "network" if o.vm else "tcp"
        # Ports picked by the kernel: nothing restarts here, so none has to be known ahead.
        self.prefills = [self._worker(f"P{i}", common) for i in range(o.prefills)]
        self.decodes = [self._worker(f"D{i}", common + ["--transport", transport]) for i in range(o.decodes)]
        self.stats = {}  # name -> the worker's latest stats event
        self.stats_at = {}  # name -> when each of its stats events came (the timer's firings)
        self.failures = []
        self.report = {"fleet": [o.prefills, o.decodes], "vm": o.vm, "session_idle_s": o.session_idle}
        self.seed = 1

    def _worker(self, name, args):
        return Worker(name, self.o.binary, args, self._sink, self.o.out)

    def _sink(self, t, name, life, ev):
        self.events.put((t, name, ev))

    def workers(self):
        return self.prefills + self.decodes

    def fail(self, why):
        print(f"fleet: failed: {why}", flush=True)
        self.failures.append(why)

    # Events

    def pump(self, until, want):
        """Takes events until `want(name, ev)` has returned True for as many as it should
        (it returns the count still missing) or `until` passes; stats events are kept."""
        while True:
            missing = want(None, None)
            if missing == 0 or time.monotonic() > until:
                return missing
            try:
                t, name, ev = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if ev.get("ev") == "stats":
                self.stats[name] = ev
                self.stats_at.setdefault(name, []).append(t)
            elif ev.get("ev") in ("refused", "corrupt", "read_failed", "hold_end", "garbage"):
                self.fail(f"{name}: {json.dumps(ev)}")
            else:
                want(name, ev)

    def settle(self, seconds=1.5):
        """Lets every worker send fresh stats."""
        self.pump(time.monotonic() + seconds, lambda n, e: 1)

    # Measurement

    def sample(self, phase):
        """Every process's /proc figures and its engine's gauges, and their medians by role."""
        self.settle()
        rdma = rdma_resources() if self.o.vm else {}
        rows = {}
        for w in self.workers():
            s = w.sample() or {}
            st = self.stats.get(w.name, {})
            for k in ("sessions", "control_connections", "data_connections", "queue_pairs"):
                s[k] = st.get(k, 0)
            s["qps"] = s["queue_pairs"]
            if self.o.vm:
                s["kernel_qps"] = sum(rdma[t]["qps"] for t in w.tasks() if t in rdma)
            rows[w.name] = s
        self.report.setdefault("samples", {})[phase] = rows
        return rows

    def by_role(self, rows, role, key):
        names = [w.name for w in (self.prefills if role == "P" else self.decodes)]
        return [rows[n][key] for n in names if key in rows[n]]

    # Phases

    def start(self):
        for w in self.workers():
            w.start(timeout=60)
        return self.sample("start")

    def connect(self):
        times, done = [], set()
        for d in self.decodes:
            for p in self.prefills:
                d.send(op="connect", peer=p.addr, timeout_ms=20000)
        total = len(self.decodes) * len(self.prefills)

        def want(name, ev):
            if ev and ev.get("ev") == "connected":
                if ev.get("error"):
                    self.fail(f"{name} could not connect to {ev['peer']}: {ev['error']}")
                times.append(ev["ms"])
                done.add((name, ev["peer"]))
            return total - len(done)

        missing = self.pump(time.monotonic() + 60 + total * 0.05, want)
        if missing:
            self.fail(f"{missing} connects never answered")
        self.report["handshake_ms"] = {
            "count": len(times),
            "p50": percentile(times, 50),
            "p99": percentile(times, 99),
            "max": max(times, default=None),
        }

    def read_all(self):
        """Every decode reads one request from every prefill."""
        pairs = [(d, p) for d in self.decodes for p in self.prefills]
        self.run_requests(pairs, "read")

    def run_requests(self, pairs, tag):
        """Holds then reads one request per (decode, prefill) pair, all at once; checks each."""
        flights = {}
        for d, p in pairs:
            di, pi = self.decodes.index(d), self.prefills.index(p)
            rid = f"{tag}-{d.name}-{p.name}-{self.seed}"
            self.seed += 1
            flights[rid] = (d, p, [[di], [di]], [[pi], [pi]], self.seed)
            p.send(op="hold", id=rid, blocks=[[di], [di]], seed=self.seed, abort_ms=60000, reader=d.engine)
        received: set = set()
        transports: dict = {}

        def want(name, ev):
            if ev and ev.get("ev") == "held" and ev["id"] in flights:
                d, p, remote, local, seed = flights[ev["id"]]
                d.send(op="read", id=ev["id"], peer=p.addr, local=local, remote=remote, seed=seed, hold=ev["token"])
            elif ev and ev.get("ev") == "received" and ev["id"] in flights:
                if ev["verified"] != REQUEST_BYTES:
                    self.fail(f"{ev['id']}: {ev['verified']} bytes verified of {REQUEST_BYTES}")
                received.add(ev["id"])
                transports[ev["transport"]] = transports.get(ev["transport"], 0) + 1
            return len(flights) - len(received)

        missing = self.pump(time.monotonic() + 60 + len(flights) * 0.05, want)
        if missing:
            self.fail(f"{tag}: {missing} of {len(flights)} reads never received")
        want_transport = "rdma" if self.o.vm else "tcp"
        if set(transports) - {want_transport}:
            self.fail(f"{tag}: reads went over {transports}, not {want_transport} alone")
        return transports

    def check_up(self, rows):
        P, D = len(self.prefills), len(self.decodes)
        for d in self.decodes:
            if rows[d.name]["sessions"] != P:
                self.fail(f"up: {d.name} holds {rows[d.name]['sessions']} sessions, not {P}")
        for p in self.prefills:
            if rows[p.name]["control_connections"] != D:
                self.fail(f"up: {p.name} serves {rows[p.name]['control_connections']} readers, not {D}")
        if self.o.vm:
            # The whole VM's count: the kernel ties a queue pair to the thread that made it,
            # which may have ended since (a tokio worker), so per process it can fall short.
            total = sum(r["qps"] for r in rows.values())
            kernel = sum(r["qps"] for r in rdma_resources().values())
            self.report["qps_engines_vs_kernel"] = [total, kernel]
            if total != kernel:
                self.fail(f"up: the engines count {total} queue pairs, the kernel {kernel}")

    def costs(self, base, up):
        """Median cost per session, on each side."""
        P, D = len(self.prefills), len(self.decodes)
        out = {}
        for role, group, n in (("decode", self.decodes, P), ("prefill", self.prefills, D)):
            per = [per_session(base[w.name], up[w.name], n) for w in group]
            keys = ("fds", "threads", "rss_anon_kib", "qps")
            out[role] = {k: median([c[k] for c in per if k in c]) for k in keys}
        self.report["per_session"] = out
        return out

    def idle(self, base):
        """Waits for every session to close, then checks what is left against the baseline."""
        start = time.monotonic()
        limit = start + self.o.session_idle * 3 + 10

        def open_sessions():
            return sum(self.stats.get(w.name, {}).get("sessions", 1) for w in self.decodes) + sum(
                self.stats.get(w.name, {}).get("control_connections", 1) for w in self.prefills
            )

        self.pump(limit, lambda n, e: open_sessions())
        self.report["all_closed_after_s"] = round(time.monotonic() - start, 2)
        if open_sessions():
            self.fail(f"idle: {open_sessions()} sessions and connections still open")
        # Data streams close once their session is gone; give the servers a moment.
        time.sleep(1.0)
        after = self.sample("idle")
        for w in self.workers():
            left = leftover(base[w.name], after[w.name], SLACK)
            if left:
                self.fail(f"idle: {w.name} holds more than before any session: {left}")
        closed = sum(self.stats.get(w.name, {}).get("sessions_closed_idle", 0) for w in self.decodes)
        self.report["sessions_closed_idle"] = closed
        return after

    def rotate(self, up):
        """Each decode reads from prefill (its index + k) at step k; the most sessions seen,
        and what each process holds after, against `up` (all P x D sessions open)."""
        P = len(self.prefills)
        idle = self.o.session_idle
        most = {"decode_sessions": 0, "prefill_readers": 0}
        held = {w.name: 0 for w in self.decodes}
        start = time.monotonic()
        for k in range(self.o.steps):
            pairs = [(d, self.prefills[(i + k) % P]) for i, d in enumerate(self.decodes)]
            self.run_requests(pairs, f"rot{k}")
            # The next reads start a whole step after these ended, however long they took.
            self.pump(time.monotonic() + self.o.step, lambda n, e: 1)
            for w in self.decodes:
                held[w.name] = max(held[w.name], self.stats.get(w.name, {}).get("sessions", 0))
            for w in self.prefills:
                most["prefill_readers"] = max(
                    most["prefill_readers"], self.stats.get(w.name, {}).get("control_connections", 0)
                )
        most["decode_sessions"] = max(held.values(), default=0)
        # Each decode against its own bound: the idle limit's, plus how late that process's
        # timers ran meanwhile (its stats come every STATS_EVERY_S when on time).
        lags = {n: timer_lag(self.stats_at.get(n, []), STATS_EVERY_S, start, time.monotonic()) for n in held}
        bounds = {n: rotation_bound(idle, self.o.step, lag) for n, lag in lags.items()} if idle else {}
        k = self.o.steps
        self.report["rotate"] = {
            "steps": k,
            "step_s": self.o.step,
            "bound": rotation_bound(idle, self.o.step) if idle else None,
            "timer_lag_s": round(max(lags.values(), default=0.0), 2),
            **most,
            "without_idle_close": min(P, k),
        }
        for n, bound in bounds.items():
            if held[n] > bound:
                self.fail(
                    f"rotate: {n} held {held[n]} sessions, over the bound {bound} "
                    f"(its timers up to {lags[n]:.2f} s late)"
                )
        after = self.sample("rotated")
        for w in self.workers():
            grew = leftover(up[w.name], after[w.name], ROTATE_SLACK)
            if grew:
                self.fail(f"rotate: {w.name} grew past what it held with every session up: {grew}")


def summary(f):
    """The report's lines for people."""
    r = f.report
    hs, ps = r.get("handshake_ms", {}), r.get("per_session", {})
    lines = [
        f"fleet: {r['fleet'][0]} prefills x {r['fleet'][1]} decodes"
        f"{' (RDMA, SoftRoCE VM)' if r['vm'] else ' (TCP, loopback)'}, session_idle {r['session_idle_s']} s",
        f"fleet: handshakes {hs.get('count')}: p50 {fmt(hs.get('p50'))} ms, "
        f"p99 {fmt(hs.get('p99'))} ms, max {fmt(hs.get('max'))} ms",
    ]
    for role in ("decode", "prefill"):
        c = ps.get(role, {})
        lines.append(
            f"fleet: per session, {role} side: {fmt(c.get('fds'))} fds, "
            f"{fmt(c.get('threads'))} threads, {fmt(c.get('rss_anon_kib'))} KiB anonymous, "
            f"{fmt(c.get('qps'))} queue pairs"
        )
    for phase in ("start", "up", "idle", "rotated"):
        rows = r.get("samples", {}).get(phase, {})
        if not rows:
            continue
        for role, names in (("decode", "D"), ("prefill", "P")):
            vals = {
                k: median([v[k] for n, v in rows.items() if n.startswith(names)])
                for k in ("fds", "threads", "rss_anon_kib", "qps")
            }
            lines.append(
                f"fleet: {phase:7} {role:7} median fds {vals['fds']}, threads "
                f"{vals['threads']}, anon {vals['rss_anon_kib']} KiB, qps {vals['qps']}"
            )
    lines.append(
        f"fleet: all sessions closed {r.get('all_closed_after_s')} s after the last read "
        f"({r.get('sessions_closed_idle')} closed idle)"
    )
    rot = r.get("rotate")
    if rot:
        lag = f", timers up to {rot['timer_lag_s']} s late" if rot.get("timer_lag_s") else ""
        bound = f"bound {rot['bound']}{lag}; " if rot["bound"] is not None else "no idle close; "
        lines.append(
            f"fleet: rotating, {rot['steps']} steps: at most {rot['decode_sessions']} "
            f"sessions per decode ({bound}{rot['without_idle_close']} prefills visited), "
            f"{rot['prefill_readers']} readers per prefill"
        )
    return "\n".join(lines)


def fmt(x):
    return "?" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))


def main(argv):
    o = options(argv)
    print(
        f"fleet: {o.prefills} prefills, {o.decodes} decodes{', in the VM' if o.vm else ''}, "
        f"session_idle {o.session_idle} s",
        flush=True,
    )
    f = Fleet(o)
    t0 = time.monotonic()
    try:
        base = f.start()
        f.connect()
        f.read_all()
        up = f.sample("up")
        f.check_up(up)
        f.costs(base, up)
        if o.session_idle:
            f.idle(base)
        f.rotate(up)
    except RuntimeError as e:
        f.fail(str(e))
    finally:
        for w in f.workers():
            w.close()
    f.report["seconds"] = round(time.monotonic() - t0, 1)
    f.report["failures"] = f.failures
    with open(os.path.join(o.out, "report.json"), "w") as out:
        json.dump(f.report, out, indent=1)
    print(summary(f), flush=True)
    verdict = "FAIL" if f.failures else "PASS"
    print(
        f"fleet: {verdict} {o.prefills}x{o.decodes} sessions={o.prefills * o.decodes} "
        f"failures={len(f.failures)} seconds={f.report['seconds']}",
        flush=True,
    )
    return 1 if f.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
