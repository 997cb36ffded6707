"""The soak's invariants, checked as events arrive: a ledger of every request and hold, with no
I/O (the orchestrator feeds it; tests feed it by hand).

A request is one hold on a prefill and one read of it by a decode. The ledger knows when each
step happened (times in seconds, the orchestrator's monotonic clock), which processes died or
stalled when, and says what went wrong:
- every read ends (received, failed, cancelled) within its deadline: request timeout, plus the
  engine's 5 s backstop, plus the time its decode was stopped, plus slack;
- every hold ends within its abort timeout (or, when its reader died, within the lease after the
  death), plus the time its prefill did not poll, plus slack;
- every byte a decode reports received is what the prefill held (the worker checks each byte
  against the hold's seed and reports `verified`);
- no read is reported received unless its prefill reported the hold sent (confirmed): a hold
  that failed or expired while its read was reported received is a violation, unless the
  prefill died after the read was received.
"""

import statistics
from dataclasses import dataclass, field

# A read is reported at most this long after its deadline (the engine's backstop).
BACKSTOP = 5.0

# The failures a decode's own clock decides: its wait for the confirmation, its request deadline.
DEADLINE_FAILURES = ("failed:unconfirmed", "failed:expired")


@dataclass
class Request:
    """One hold and its read."""

    id: str
    prefill: str
    decode: str
    expected: int
    issued: float
    abort: float
    held: float | None = None
    read_at: float | None = None
    read_end: float | None = None
    read_outcome: str | None = None  # received, failed:<cause>, corrupt, void (decode died)
    hold_end: float | None = None
    hold_outcome: str | None = None  # sent, failed:<cause>, void (prefill died)
    cancelled: bool = False


@dataclass
class Life:
    """When a worker process was stopped or dead, for deadline allowances."""

    stops: list = field(default_factory=list)  # (from, to) SIGSTOP or a poll stall
    deaths: list = field(default_factory=list)  # time of each SIGKILL

    def stopped_between(self, a, b):
        """Seconds this worker was stopped within [a, b] (an open stop counts up to b)."""
        total = 0.0
        for s, e in self.stops:
            e = b if e is None else e
            total += max(0.0, min(e, b) - max(s, a))
        return total

    def died_between(self, a, b):
        """The first death in (a, b], or None."""
        return next((d for d in self.deaths if a < d <= b), None)


class Ledger:
    """Every request of a soak, and the violations seen so far."""

    def __init__(self, request_timeout, lease, keepalive, slack=2.0):
        self.request_timeout = request_timeout
        self.lease = lease
        self.keepalive = keepalive
        self.slack = slack
        self.requests = {}  # the open ones: a request leaves once both its sides ended
        self.finished = set()
        self.lives = {}
        self.violations = []
        self.failures = {}  # "side:cause" -> count
        self.bytes_verified = 0
        self.received = 0

    # -- what the orchestrator tells it ------------------------------------------------------

    def life(self, name):
        return self.lives.setdefault(name, Life())

    def issue(self, rid, prefill, decode, expected, t, abort):
        self.requests[rid] = Request(rid, prefill, decode, expected, t, abort)

    def held(self, rid, t):
        if rid in self.requests:
            self.requests[rid].held = t

    def read_sent(self, rid, t):
        if rid in self.requests:
            self.requests[rid].read_at = t

    def cancelled(self, rid):
        if rid in self.requests:
            self.requests[rid].cancelled = True

    def stop(self, name, t):
        self.life(name).stops.append((t, None))

    def resume(self, name, t):
        stops = self.life(name).stops
        if stops and stops[-1][1] is None:
            stops[-1] = (stops[-1][0], t)

    def void(self, rid, t):
        """A request that never started (its hold or read refused at once)."""
        r = self.requests[rid]
        if r.read_end is None:
            r.read_end, r.read_outcome = t, "void"
        if r.hold_end is None:
            r.hold_end, r.hold_outcome = t, "void"
        self._settle(r)

    def died(self, name, t):
        """A worker was killed: its side of every open request is void."""
        self.life(name).deaths.append(t)
        for r in list(self.requests.values()):
            if r.decode == name and r.read_end is None:
                r.read_end, r.read_outcome = t, "void"
            if r.prefill == name and r.hold_end is None:
                r.hold_end, r.hold_outcome = t, "void"
                if r.read_at is None and r.read_end is None:
                    r.read_end, r.read_outcome = t, "void"  # no read will be sent
            self._settle(r)

    # -- what the workers report ---------------------------------------------------------------

    def on_received(self, rid, t, nbytes, verified):
        r = self._open_read(rid, t, "received")
        if r is None:
            return
        self.received += 1
        self.bytes_verified += verified
        if not (verified == nbytes == r.expected):
            self.violate(t, "bytes", f"{rid}: {verified} verified of {nbytes} reported, {r.expected} held")
        if r.hold_outcome is not None and r.hold_outcome not in ("sent", "void"):
            self.violate(t, "unconfirmed", f"{rid} received, but its hold ended {r.hold_outcome}")
        self._settle(r)

    def on_corrupt(self, rid, t, error):
        r = self._open_read(rid, t, "corrupt")
        self.violate(t, "bytes", f"{rid}: bytes differ from the hold's: {error}")
        self._settle(r)

    def on_read_failed(self, rid, t, cause):
        r = self._open_read(rid, t, f"failed:{cause}")
        if r is not None:
            self._count("read", cause)
            self._check_confirmed_failed(r, t)
        self._settle(r)

    def on_sent(self, rid, t):
        r = self._close_hold(rid, t, "sent")
        if r is not None:
            self._check_confirmed_failed(r, t)
        self._settle(r)

    def _check_confirmed_failed(self, r, t):
        """A hold the prefill counted sent whose read failed: a violation, unless the soak
        cancelled the read and it failed as cancelled. A read of one data request is confirmed
        by the prefill with its data; a cancel that reaches the reader before the confirmation
        does ends the read cancelled while the prefill, which held the blocks for the whole
        read, has counted it sent. A decode stopped during its read may wake past its own
        deadline for the confirmation or the request and fail the read by its clock although
        the confirmation was on its way (it recomputes; nothing wrong is received). No other
        failure may follow a confirmation."""
        if r.hold_outcome != "sent" or r.read_outcome is None:
            return
        if not r.read_outcome.startswith("failed"):
            return
        if r.cancelled and r.read_outcome == "failed:cancelled":
            return
        if r.read_outcome in DEADLINE_FAILURES and self._decode_stopped_during_read(r, t):
            return
        self.violate(t, "confirmed-failed", f"{r.id}: hold sent, but its read {r.read_outcome}")

    def _decode_stopped_during_read(self, r, t):
        """Whether the decode of `r` was stopped between its read's start and the later of its
        two outcomes."""
        start = r.read_at if r.read_at is not None else r.issued
        end = max(x for x in (r.read_end, r.hold_end, t) if x is not None)
        return self.life(r.decode).stopped_between(start, end) > 0.0

    def on_hold_end(self, rid, t, cause):
        r = self._close_hold(rid, t, f"failed:{cause}")
        if r is None:
            return
        self._count("hold", cause)
        if r.read_outcome == "received":
            self.violate(t, "unconfirmed", f"{rid} received, but its hold ended failed:{cause}")
        self._settle(r)

    # -- deadlines -----------------------------------------------------------------------------

    def read_deadline(self, r, now):
        """When the read of `r` must have ended, given what is known at `now`."""
        d = self.life(r.decode)
        start = r.read_at
        return start + self.request_timeout + BACKSTOP + self.slack + d.stopped_between(start, now)

    def hold_deadline(self, r, now):
        """When the hold of `r` must have ended: its abort timeout, or the lease after its
        reader died, plus the time its prefill was stopped."""
        p = self.life(r.prefill)
        end = r.held + r.abort
        death = self.life(r.decode).died_between(r.held, now)
        if death is not None:
            end = min(end, death + self.lease + 3 * self.keepalive)
        return end + self.slack + p.stopped_between(r.held, now)

    def held_by(self, r, now):
        """When the prefill must have said its hold began: a moment, plus its stopped time."""
        return r.issued + 3.0 + self.slack + self.life(r.prefill).stopped_between(r.issued, now)

    def check_deadlines(self, now):
        """Records every read or hold past its deadline (once each)."""
        for r in list(self.requests.values()):
            if r.held is None and r.hold_end is None and now > self.held_by(r, now):
                r.hold_end, r.hold_outcome = now, "overdue"
                if r.read_end is None:
                    r.read_end, r.read_outcome = now, "overdue"
                self.violate(now, "hold-deadline", f"{r.id}: hold asked at {r.issued:.1f} s never began")
            if r.read_at is not None and r.read_end is None and now > self.read_deadline(r, now):
                r.read_end, r.read_outcome = now, "overdue"
                self.violate(now, "read-deadline", f"{r.id}: read from {r.read_at:.1f} s still open")
            if r.held is not None and r.hold_end is None and now > self.hold_deadline(r, now):
                r.hold_end, r.hold_outcome = now, "overdue"
                self.violate(now, "hold-deadline", f"{r.id}: hold from {r.held:.1f} s still open")
            self._settle(r)

    def open_requests(self):
        return list(self.requests.values())

    # -- helpers -------------------------------------------------------------------------------

    def _settle(self, r):
        """A request whose both sides ended leaves the open ones."""
        if r is not None and r.read_end is not None and r.hold_end is not None:
            self.requests.pop(r.id, None)
            self.finished.add(r.id)

    def _missing(self, rid, t, what):
        if rid in self.finished:
            self.violate(t, "twice", f"{rid}: {what} after the request ended")
        else:
            self.violate(t, "unknown", f"{what} for a request never issued: {rid}")

    def _open_read(self, rid, t, outcome):
        r = self.requests.get(rid)
        if r is None:
            self._missing(rid, t, outcome)
            return None
        if r.read_end is not None:
            if r.read_outcome != "void":
                self.violate(t, "twice", f"{rid}: read ended {r.read_outcome}, then {outcome}")
            return None
        r.read_end, r.read_outcome = t, outcome
        return r

    def _close_hold(self, rid, t, outcome):
        r = self.requests.get(rid)
        if r is None:
            self._missing(rid, t, f"hold {outcome}")
            return None
        if r.hold_end is not None:
            if r.hold_outcome != "void":
                self.violate(t, "twice", f"{rid}: hold ended {r.hold_outcome}, then {outcome}")
            return None
        if r.held is not None and t > self.hold_deadline(r, t):
            self.violate(t, "hold-deadline", f"{rid}: hold from {r.held:.1f} s ended {outcome} at {t:.1f} s")
        r.hold_end, r.hold_outcome = t, outcome
        return r

    def _count(self, side, cause):
        key = f"{side}:{cause}"
        self.failures[key] = self.failures.get(key, 0) + 1

    def violate(self, t, kind, what):
        """Records a broken invariant (the traffic and the faults report theirs here too)."""
        self.violations.append((t, kind, what))


def slope(points):
    """Least-squares slope of (x, y) points (0 for fewer than 2 distinct x)."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def recovery(rates, fault_end, baseline, fraction=0.9):
    """Seconds from `fault_end` until the rate (a list of (t, bytes per second)) is back to
    `fraction` of `baseline`; None when it never is."""
    for t, r in rates:
        if t >= fault_end and r >= fraction * baseline:
            return t - fault_end
    return None


def stretch_median(per_second, start, end, busy):
    """The median of the per-second rates (a list of (t, bytes verified in the second from t))
    of the whole seconds within [start, end) that do not overlap `busy` ((from, to) spans), and
    how many seconds it is over: (median or 0.0, count)."""
    quiet = [r for t, r in per_second if start <= t and t + 1 <= end and not any(t + 1 > a and t < b for a, b in busy)]
    return (statistics.median(quiet) if quiet else 0.0), len(quiet)


def pace(control, before, after, busy, least):
    """How fast the machine ran after a fault against before it, as a pair of workers no fault
    touches shows it (`control`, per-second rates): the median over the span `after` divided
    by the median over the span `before`, both away from `busy`, at most 1.0. 1.0 when either
    span has fewer than `least` seconds, or the pair moved nothing before: a machine that went
    no slower, or a run too short to tell, leaves the bar where it was. Only a slowdown the
    untouched pair shows too lowers the bar, so a fault that left its own workers slower
    still fails."""
    was, n_before = stretch_median(control, before[0], before[1], busy)
    now, n_after = stretch_median(control, after[0], after[1], busy)
    if n_before < least or n_after < least or was <= 0:
        return 1.0
    return min(1.0, now / was)


def spread_floor(windows, start, end, busy, least, width=3, share=0.25):
    """The low end of what the run itself shows as normal: the `share` quantile of the windowed
    rates (a list of (t, rate over the `width` whole seconds ending with the second from t))
    whose window lies within [start, end) and away from `busy`, or None for fewer than `least`
    of them. On a loaded machine (the
    SoftRoCE VM under emulation) a 3-second window moves by 20% and more around its median
    with no fault at all: a fault is back once its traffic is within that range again."""
    quiet = sorted(
        r
        for t, r in windows
        if start <= t - width + 1 and t + 1 <= end and not any(t + 1 > a and t - width + 1 < b for a, b in busy)
    )
    if len(quiet) < least:
        return None
    return quiet[int(share * (len(quiet) - 1))]


def resumed(pair_seconds, start, end, window):
    """Seconds from `end` until every pair of workers (prefill, decode) that carried traffic in
    the `window` seconds before `start` carried some again (a whole second with bytes
    verified from `end` on), and the pairs that did not within `window` after `end`:
    (seconds or None, [pairs not back]). `pair_seconds`: pair -> {whole second: bytes}."""
    late = 0.0
    missing = []
    for pair, seconds in sorted(pair_seconds.items()):
        if not any(start - window <= s < start and b > 0 for s, b in seconds.items()):
            continue
        back = [s for s, b in seconds.items() if end <= s + 1 and s < end + window and b > 0]
        if not back:
            missing.append(pair)
        else:
            late = max(late, max(0.0, min(back) + 1 - end))
    return (None if missing else late), missing


def baseline(per_second, start, busy, lookback):
    """The rate before a fault that starts at `start`: the median of the per-second rates (a
    list of (t, bytes verified in the second from t)) over the `lookback` seconds before it,
    leaving out the seconds that overlap `busy` (earlier faults and their quiet windows, as
    (from, to)). A median over many seconds, so that a peak just before the fault does not
    raise the bar: on 2 cores the rate moves by 15% from one second to the next. 0.0 when no
    second qualifies."""
    return stretch_median(per_second, start - lookback, start, busy)[0]
