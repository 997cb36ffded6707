"""The fleet run's arithmetic, apart from its processes so that it is tested on its own
(test_fleet.py): percentiles, what one session costs, and how many sessions a decode can hold
when it moves from prefill to prefill under an idle limit."""

import math


def percentile(values, q):
    """The q-th percentile (0 to 100) of `values`, nearest rank; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def median(values):
    return percentile(values, 50)


def tick_period(idle):
    """How often an engine's reaper looks at its sessions for an idle limit of `idle` seconds:
    a quarter of it, between 0.05 and 5 s (`session::idle::tick_period` in the engine)."""
    return min(max(idle / 4, 0.05), 5.0)


def rotation_bound(idle, step, lag=0.0):
    """The most sessions a decode holds at once when it reads from one prefill at a time, each
    read starting `step` seconds after the last one ended. A session closes between `idle`
    and `idle` plus one reaper tick after its last read; reads end at least `step` apart, so
    at most floor((idle + tick) / step) + 1 sessions are up at any instant, the one in use
    among them (while one is in use the previous read ended `step` ago at least). `lag`: how
    late the decode's timers ran (`timer_lag`), by which its reaper's tick may come late too
    on a machine busier than the run: 0 on an idle one."""
    return math.floor((idle + tick_period(idle) + lag) / step) + 1


def timer_lag(times, period, start, end):
    """How late a timer that fires every `period` seconds ran between `start` and `end`, from
    the times it was seen to fire (`times`, ascending): the longest gap between two firings in
    that span less the period, 0.0 when none was late (or fewer than two firings)."""
    seen = [t for t in times if start <= t <= end]
    gaps = [b - a for a, b in zip(seen, seen[1:])]
    return max([0.0] + [g - period for g in gaps])


def per_session(base, up, sessions):
    """What each of `sessions` sessions added to one process's figures, from its `base`
    sample (no session) and its `up` sample (all of them open): {figure: added per session}."""
    if sessions <= 0:
        return {}
    return {k: (up[k] - base[k]) / sessions for k in base if k in up}


def leftover(base, after, slack):
    """The figures of `after` (all sessions closed) above `base` by more than `slack[k]`:
    {figure: (base, after)}; empty when everything came back."""
    return {k: (base[k], after[k]) for k, s in slack.items() if k in base and k in after and after[k] - base[k] > s}
