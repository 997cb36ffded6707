"""The soak's requests: blocks taken from each engine's free lists, a hold on a prefill, then
the read into a decode once the hold's token is known; blocks given back when each side ends.
Events from the workers go to the ledger (checks.py)."""

from dataclasses import dataclass

GROUPS = 2


@dataclass
class Flight:
    """One request in flight, as the orchestrator tracks its blocks."""

    id: str
    prefill: object
    decode: object
    p_life: int
    d_life: int
    pblocks: list
    dblocks: list
    seed: int
    abort_ms: int
    read_sent: bool = False
    read_done: bool = False
    hold_done: bool = False
    on_read: object = None  # called once its read is sent (a fault's hook)


class Pool:
    """The free blocks of one engine life, per group."""

    def __init__(self, blocks):
        self.free = [list(range(blocks)) for _ in range(GROUPS)]

    def take(self, rng, counts):
        if any(len(f) < n for f, n in zip(self.free, counts)):
            return None
        out = []
        for f, n in zip(self.free, counts):
            rng.shuffle(f)
            out.append(sorted(f[len(f) - n :]))
            del f[len(f) - n :]
        return out

    def give(self, groups):
        for f, g in zip(self.free, groups):
            f.extend(g)


class Traffic:
    """Issues requests up to a concurrency per decode and follows them to their end."""

    def __init__(self, soak):
        self.soak = soak
        self.rng = soak.rng
        self.ledger = soak.ledger
        self.flights = {}
        self.pools = {}  # (name, life) -> Pool
        self.count = 0
        self.bytes_per_second = {}  # whole second -> bytes verified
        self.pair_seconds = {}  # (prefill, decode) names -> {whole second -> bytes verified}
        self.issued = 0

    def pool(self, w):
        return self.pools.setdefault((w.name, w.life), Pool(self.soak.o.blocks))

    def in_flight(self, d):
        return sum(1 for f in self.flights.values() if f.decode is d and not f.read_done)

    def issue(self):
        """Starts requests while a decode has room."""
        for d in self.soak.decodes:
            if not d.alive() or d.stopped:
                continue
            while self.in_flight(d) < self.soak.o.concurrency:
                if self._start(d, None) is None:
                    break

    def issue_one(self, decode, abort_ms):
        """One more request into `decode`, beyond its concurrency (a fault's); None when no
        blocks or no prefill are free."""
        if not decode.alive() or decode.stopped:
            return None
        return self._start(decode, abort_ms)

    def _start(self, d, abort_ms):
        ups = [p for p in self.soak.prefills if p.alive() and p.addr]
        if not ups:
            return None
        p = self.rng.choice(ups)
        counts = self._sizes()
        pblocks = self.pool(p).take(self.rng, counts)
        if pblocks is None:
            return None
        dblocks = self.pool(d).take(self.rng, counts)
        if dblocks is None:
            self.pool(p).give(pblocks)
            return None
        self.count += 1
        f = Flight(
            f"r{self.count}", p, d, p.life, d.life, pblocks, dblocks, self.rng.randrange(1, 2**62), abort_ms or 20_000
        )
        self.flights[f.id] = f
        expected = self.soak.block_bytes * sum(counts)
        self.ledger.issue(f.id, p.name, d.name, expected, self.soak.now(), f.abort_ms / 1e3)
        self.issued += 1
        p.send(op="hold", id=f.id, blocks=pblocks, seed=f.seed, abort_ms=f.abort_ms, reader=d.engine)
        return f

    def _sizes(self):
        """Blocks per group: 1 to 16 in group 0 (log-uniform), up to as many in group 1."""
        n0 = min(16, int(2 ** self.rng.uniform(0, 4.09)))
        return [n0, self.rng.randint(0, n0)]

    def event(self, t, name, life, ev):
        """One worker event: the flight moves on, the ledger checks it."""
        w = self.soak.by_name.get(name)
        if w is None or life != w.life or w.killed:
            return  # the last words of a killed life, read after its kill
        kind = ev.get("ev")
        if kind in ("ready", "cancelled"):
            return
        if kind in ("stats", "connected"):
            getattr(self.soak.faults, kind)(name, ev)
            return
        f = self.flights.get(ev.get("id"))
        if f is None:
            self.ledger.violate(t, "unknown", f"{name}: {ev}")
            return
        handler = getattr(self, f"_on_{kind}", None)
        if handler is None:
            self.ledger.violate(t, "unexpected", f"{name}: {ev}")
            return
        handler(t, f, name, life, ev)

    def _on_held(self, t, f, name, life, ev):
        if life != f.p_life:
            return
        self.ledger.held(f.id, t)
        if f.decode.life != f.d_life:
            return  # its decode died meanwhile: the hold runs to its deadline or lease
        if f.decode.send(
            op="read", id=f.id, peer=f.prefill.addr, local=f.dblocks, remote=f.pblocks, seed=f.seed, hold=ev["token"]
        ):
            f.read_sent = True
            self.ledger.read_sent(f.id, t)
            if f.on_read:
                f.on_read()

    def _on_sent(self, t, f, name, life, ev):
        if life == f.p_life:
            self.ledger.on_sent(f.id, t)
            self._prefill_done(f)

    def _on_hold_end(self, t, f, name, life, ev):
        if life == f.p_life:
            self.ledger.on_hold_end(f.id, t, ev["cause"])
            self._prefill_done(f)

    def _on_received(self, t, f, name, life, ev):
        if life == f.d_life:
            self.ledger.on_received(f.id, t, ev["bytes"], ev["verified"])
            second = int(t)
            self.bytes_per_second[second] = self.bytes_per_second.get(second, 0) + ev["verified"]
            pair = self.pair_seconds.setdefault((f.prefill.name, f.decode.name), {})
            pair[second] = pair.get(second, 0) + ev["verified"]
            self._decode_done(f)

    def _on_corrupt(self, t, f, name, life, ev):
        if life == f.d_life:
            self.ledger.on_corrupt(f.id, t, ev["error"])
            self._decode_done(f)

    def _on_read_failed(self, t, f, name, life, ev):
        if life == f.d_life:
            self.ledger.on_read_failed(f.id, t, ev["cause"])
            self._decode_done(f)

    def _on_refused(self, t, f, name, life, ev):
        """A hold or read the engine refused at once: the request ends there."""
        self.ledger.violate(t, "refused", f"{name} refused {ev.get('op')} {f.id}: {ev.get('error')}")
        self.ledger.void(f.id, t)
        self._prefill_done(f)
        self._decode_done(f)

    def _prefill_done(self, f):
        if not f.hold_done:
            f.hold_done = True
            if f.prefill.life == f.p_life:
                self.pool(f.prefill).give(f.pblocks)
            self._forget(f)

    def _decode_done(self, f):
        if not f.read_done:
            f.read_done = True
            if f.decode.life == f.d_life:
                self.pool(f.decode).give(f.dblocks)
            self._forget(f)

    def _forget(self, f):
        if f.hold_done and f.read_done:
            self.flights.pop(f.id, None)

    def worker_died(self, w):
        """Every flight's side on `w` ends with its process (its blocks went with it)."""
        for f in list(self.flights.values()):
            if f.prefill is w and f.p_life == w.life:
                f.hold_done = True
                if not f.read_sent:
                    # Its hold never began: no read will be sent, its decode blocks are free.
                    self._decode_done(f)
                self._forget(f)
            if f.decode is w and f.d_life == w.life:
                f.read_done = True
                self._forget(f)
        self.ledger.died(w.name, self.soak.now())

    def rates(self, window=2, pair=None):
        """(t, bytes per second over the `window` seconds ending at t) for each second, of all
        the traffic or of one (prefill, decode) pair's (up to the last second of all)."""
        if not self.bytes_per_second:
            return []
        last = max(self.bytes_per_second)
        seconds = self.bytes_per_second if pair is None else self.pair_seconds.get(pair, {})
        out = []
        for s in range(window, last + 1):
            total = sum(seconds.get(s - k, 0) for k in range(window))
            out.append((float(s), total / window))
        return out
