"""The soak's faults, one at a time at random times from the seed, each followed by a quiet
window: the kind, its target and its durations come from a generator of their own, so a seed
replays the same schedule whatever the traffic did. P0 and D0 are never faulted: their
resources give clean slopes."""

import heapq
import random
import subprocess

from workers import Worker

HOST_KINDS = [
    "kill_prefill",
    "kill_decode",
    "stall_decode",
    "stall_poll",
    "expire_mid_read",
    "cancel_burst",
    "wrong_key",
]
VM_KINDS = ["link_flap"]
WRONG_KEY = "not-the-deployment-key-0123456789"


class Faults:
    def __init__(self, soak):
        self.soak = soak
        self.rng = random.Random(soak.o.seed * 7919 + 17)
        # Every kind once, in an order of the seed's, then again: a short run still sees many.
        self.kinds = HOST_KINDS + (VM_KINDS if soak.o.vm else [])
        self.rng.shuffle(self.kinds)
        self.turn = 0
        self.next_at = soak.o.warmup
        # No fault starts so late that its recovery cannot be judged before the end.
        self.last_start = soak.o.minutes * 60 - 2 * soak.o.quiet - 5.0
        self.pending = []  # (t, seq, action)
        self.seq = 0
        self.log = []  # one dict per fault
        self.active = None
        self.stats_seen = {}
        self.intruder = None

    # -- the schedule --------------------------------------------------------------------------

    def tick(self):
        now = self.soak.now()
        while self.pending and self.pending[0][0] <= now:
            _, _, action = heapq.heappop(self.pending)
            action()
        if self.active is None and self.next_at <= now <= self.last_start:
            kind = self.kinds[self.turn % len(self.kinds)]
            self.turn += 1
            self._begin(kind, now)

    def finish(self):
        """Runs what is still scheduled (resumes, restarts, links up) at once."""
        while self.pending:
            _, _, action = heapq.heappop(self.pending)
            action()

    def _later(self, delay, action):
        self.seq += 1
        heapq.heappush(self.pending, (self.soak.now() + delay, self.seq, action))

    def _begin(self, kind, now):
        fault = {"kind": kind, "start": now, "end": None, "target": None, "detail": ""}
        self.log.append(fault)
        self.active = fault
        getattr(self, f"_{kind}")(fault)
        print(f"soak: {now:7.1f} s  {kind} {fault['target'] or ''} {fault['detail']}".rstrip(), flush=True)

    def _end(self, fault):
        """The fault is over: the quiet window (the cool-down) starts now."""
        fault["end"] = self.soak.now()
        self.active = None
        # Recovery is judged over twice the quiet window: no fault comes within it.
        quiet = self.soak.o.quiet
        self.next_at = fault["end"] + 2 * quiet + self.rng.expovariate(2 / quiet)

    def _pick(self, workers):
        """A worker other than the sentinel (the first)."""
        return self.rng.choice(workers[1:]) if len(workers) > 1 else None

    # -- the kinds -----------------------------------------------------------------------------

    def _kill_prefill(self, fault):
        self._kill(fault, self._pick(self.soak.prefills))

    def _kill_decode(self, fault):
        self._kill(fault, self._pick(self.soak.decodes))

    def _kill(self, fault, w):
        if w is None:
            return self._end(fault)
        fault["target"] = w.name
        w.kill()
        self.soak.traffic.worker_died(w)
        down = self.rng.uniform(0.5, 2.0)
        fault["detail"] = f"restarted after {down:.1f} s"

        def restart():
            w.start()
            self._end(fault)

        self._later(down, restart)

    def _stall_decode(self, fault):
        w = self._pick(self.soak.decodes)
        if w is None:
            return self._end(fault)
        self._stop(fault, w, self.rng.uniform(0.5, 4.0))

    def _stop(self, fault, w, secs):
        """SIGSTOP `w` for `secs`, then SIGCONT."""
        fault["target"], fault["detail"] = w.name, f"stopped {secs:.1f} s"
        w.stop()
        self.soak.ledger.stop(w.name, self.soak.now())

        def resume():
            w.resume()
            self.soak.ledger.resume(w.name, self.soak.now())
            self._end(fault)

        self._later(secs, resume)

    def _stall_poll(self, fault):
        w = self._pick(self.soak.prefills)
        if w is None:
            return self._end(fault)
        secs = self.rng.uniform(1.0, 3.0)
        fault["target"], fault["detail"] = w.name, f"not polling for {secs:.1f} s"
        w.send(op="stall", ms=int(secs * 1000))
        self.soak.ledger.stop(w.name, self.soak.now())

        def over():
            self.soak.ledger.resume(w.name, self.soak.now())
            self._end(fault)

        self._later(secs, over)

    def _expire_mid_read(self, fault):
        """A hold of 300 ms whose reader is stopped for 1 to 2 s just after its read starts:
        the hold expires (its blocks overwritten) while the read is stopped or in flight."""
        d = self._pick(self.soak.decodes)
        f = d and self.soak.traffic.issue_one(d, abort_ms=300)
        if not f:
            return self._end(fault)
        secs = self.rng.uniform(1.0, 2.0)
        fault["detail"] = f"{f.id}, reader stopped {secs:.1f} s"

        def stop():
            fault["stopping"] = True
            self._stop(fault, d, secs)
            fault["detail"] = f"{f.id}, reader stopped {secs:.1f} s"

        def never_read():
            if not fault.get("stopping") and fault["end"] is None:
                fault["detail"] = f"{f.id}: its read was never sent"
                self._end(fault)

        f.on_read = stop
        self._later(3.0, never_read)

    def _cancel_burst(self, fault):
        flights = [f for f in self.soak.traffic.flights.values() if f.read_sent and not f.read_done]
        chosen = sorted(flights, key=lambda f: f.id)[:3]
        for f in chosen:
            f.decode.send(op="cancel", id=f.id)
            self.soak.ledger.cancelled(f.id)
        fault["detail"] = ", ".join(f.id for f in chosen) or "nothing in flight"
        self._end(fault)

    def _wrong_key(self, fault):
        """A peer with another key handshakes with P0: it must be refused."""
        soak = self.soak
        args = ["--key", WRONG_KEY, "--transport", "tcp", "--blocks", "4"]
        self.intruder = Worker("X", soak.o.binary, args, soak._sink, soak.o.out)
        soak.by_name["X"] = self.intruder
        target = soak.prefills[0]
        fault["target"] = target.name
        self.intruder.start()
        self.intruder.send(op="connect", peer=target.addr, timeout_ms=2000)
        fault["refused"] = None

        intruder = self.intruder

        def done():
            intruder.close()
            soak.by_name.pop("X", None)
            if fault["refused"] is None:
                soak.ledger.violate(soak.now(), "wrong-key", "the intruder's connect never ended")
            self._end(fault)

        self._later(3.0, done)

    def _link_flap(self, fault):
        dev = self.rng.choice(["dummy0", "dummy1"])
        secs = self.rng.uniform(1.0, 5.0)
        fault["target"], fault["detail"] = dev, f"down {secs:.1f} s"
        subprocess.run(["ip", "link", "set", dev, "down"], check=False)

        def up():
            subprocess.run(["ip", "link", "set", dev, "up"], check=False)
            self._end(fault)

        self._later(secs, up)

    # -- what the workers say about them -------------------------------------------------------

    def stats(self, name, ev):
        self.stats_seen[name] = ev

    def connected(self, name, ev):
        fault = self.active
        if name != "X" or fault is None or fault["kind"] != "wrong_key":
            return
        fault["refused"] = ev.get("error")
        if ev.get("error") is None:
            self.soak.ledger.violate(self.soak.now(), "wrong-key", "a peer with the wrong key was accepted")
        else:
            fault["detail"] = f"refused: {ev['error'][:90]}"
