"""The soak's report: requests, bytes, failures by cause, faults and how fast throughput came
back after each, resource slopes per worker life, violations, and the verdict."""

import statistics

from checks import baseline, pace, recovery, resumed, slope, spread_floor

# A worker life shorter than this is too short to judge its resources.
MIN_LIFE_S = 20.0
# Growth allowed between the second and the last quarter of a life (medians): a leak grows
# without bound, noise does not.
LIMITS = {"fds": 8, "threads": 8, "rss_anon_kib": 16 * 1024, "qps": 8, "mr_bytes": 1 << 20}
# Throughput must be back to this share of the rate before a fault within twice the quiet
# window after it (or to the lower quartile of the run's own windows before it, where the
# machine's rate moves more than that with no fault: checks.spread_floor), and every pair of
# workers that carried traffic before it must carry some again.
RECOVERED = 0.9
# The rate before a fault is the median over this many seconds before it (away from earlier
# faults).
BASELINE_S = 30.0
# The machine's pace after a fault (checks.pace) is judged on at least this many seconds of
# the untouched pair's traffic, before and after. The span after starts when the fault ends
# and runs to the next fault, which comes twice the quiet window later or more: a 60-second
# run with a quiet window of 4 s has 8 seconds or more between two faults.
PACE_LEAST_S = 5
# The run's own spread lowers the bar by at most this much: it never falls below this share of
# the rate before (times the pace).
SPREAD_LEAST = 0.6
# Faults that touch every pair, the untouched one too (a link under every session: each
# session has a rail on each link): no pair shows the machine's pace apart from the fault, so
# their rate cannot tell a slower machine from a slower transfer. They are judged on every pair
# carrying traffic again within the window (`checks.resumed`), which no machine's pace moves;
# their rate is reported, not judged.
TOUCH_ALL = {"link_flap"}


def resources(samples, warmup):
    """Per worker life: slope per minute and growth of each figure, and whether it is flat."""
    out = []
    for (name, life), series in sorted(samples.items()):
        series = [(t, s) for t, s in series if t >= warmup]
        if not series or series[-1][0] - series[0][0] < MIN_LIFE_S:
            continue
        row = {"worker": f"{name}.{life}", "seconds": round(series[-1][0] - series[0][0], 1)}
        q = len(series) // 4
        flat = True
        for key, limit in LIMITS.items():
            if key not in series[0][1]:
                continue  # QPs and registered bytes: only inside the VM
            points = [(t / 60, s[key]) for t, s in series]
            growth = (
                (statistics.median(v for _, v in points[-q:]) - statistics.median(v for _, v in points[q : 2 * q]))
                if q
                else 0
            )
            row[key] = {
                "per_min": round(slope(points), 2),
                "growth": growth,
                "first": points[0][1],
                "last": points[-1][1],
            }
            flat = flat and growth <= limit
        # The VM's totals rise as sessions first connect and dip while a worker is down: they
        # are reported, and each worker's own figures are judged.
        row["flat"] = flat or name == "VM"
        out.append(row)
    return out


def recoveries(faults, rates, per_second, quiet, control=(), run_end=None, pairs=None):
    """Per fault, whether the traffic came back within twice the quiet window after it:
    - every pair of workers that carried traffic before it carries some again (`pairs`, each
      pair's bytes per whole second; `checks.resumed`);
    - throughput, over the windows of `rates`, is back to a bar: `RECOVERED` of the rate before
      (`checks.baseline` over the per-second rates, away from earlier faults), or the lower
      quartile of the run's own windows over the same seconds where that is lower
      (`checks.spread_floor`: how far the rate moves with no fault; never below `SPREAD_LEAST`
      of the rate before), times the machine's pace
      after it (`checks.pace` on `control`, the per-second rates of the pair no fault targets,
      from the fault's end to the next fault or `run_end`);
    - for a fault that touches every pair (`TOUCH_ALL`), the pairs alone: no pair shows the
      machine's pace, so the rate's return (`rate_recovery_s`) is reported, not judged.
    A fault whose recovery window the run's end cut short and that was not back yet is judged
    on what the run could observe: not failed, and marked `cut` with the seconds it had."""
    out = []
    # The seconds before the traffic's first one are not the rate before any fault.
    first = next((t for t, r in per_second if r > 0), None)
    busy: list[tuple[float, float]] = [] if first is None else [(float("-inf"), first + 1)]
    for i, f in enumerate(faults):
        end = f["end"] if f["end"] is not None else f["start"]
        window = 2 * quiet
        before = baseline(per_second, f["start"], busy, BASELINE_S)
        floor = spread_floor(rates, f["start"] - BASELINE_S, f["start"], busy, PACE_LEAST_S)
        later = faults[i + 1]["start"] if i + 1 < len(faults) else run_end
        after = (end, later if later is not None else end + window)
        speed = (
            1.0
            if f["kind"] in TOUCH_ALL
            else pace(control, (f["start"] - BASELINE_S, f["start"]), after, busy, PACE_LEAST_S)
        )
        busy.append((f["start"], end + quiet))
        spread = max(SPREAD_LEAST * before, floor if floor is not None else before)
        bar = min(RECOVERED * before, spread) * speed
        rate_back = recovery(rates, end, bar, 1.0) if before > 0 else None
        pairs_back, missing = resumed(pairs or {}, f["start"], end, window)
        if f["kind"] in TOUCH_ALL:
            back = pairs_back
        elif rate_back is not None and pairs_back is not None:
            back = max(rate_back, pairs_back)
        else:
            back = None if missing else rate_back
        seen = window if run_end is None else max(0.0, min(window, run_end - end))
        cut = seen < window and (back is None or back > seen)
        ok = (before == 0 and not missing) or cut or (back is not None and back <= window)
        out.append(
            {
                **{k: f[k] for k in ("kind", "target", "detail", "start", "end")},
                "baseline_mb_s": round(before / 1e6, 1),
                "bar_mb_s": round(bar / 1e6, 1),
                "pace": round(speed, 2),
                "recovery_s": back,
                "rate_recovery_s": rate_back,
                "pairs_not_back": ["->".join(p) for p in missing],
                "ok": ok,
                "cut": round(seen, 1) if cut else None,
            }
        )
    return out


def report(soak):
    """(text, summary dict, whether the soak passed)."""
    ledger, traffic = soak.ledger, soak.traffic
    rates = traffic.rates(window=3)
    res = resources(soak.samples, soak.o.warmup)
    control = traffic.rates(window=1, pair=(soak.prefills[0].name, soak.decodes[0].name))
    rec = recoveries(
        soak.faults.log,
        rates,
        traffic.rates(window=1),
        soak.o.quiet,
        control,
        run_end=soak.o.minutes * 60,
        pairs=traffic.pair_seconds,
    )
    kinds: dict[str, int] = {}
    for f in soak.faults.log:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    seconds = max(1.0, soak.now())
    summary = {
        "seed": soak.o.seed,
        "minutes": soak.o.minutes,
        "requests": traffic.issued,
        "received": ledger.received,
        "bytes_verified": ledger.bytes_verified,
        "mb_per_s": round(ledger.bytes_verified / seconds / 1e6, 1),
        "failures": dict(sorted(ledger.failures.items())),
        "faults": kinds,
        "recoveries": rec,
        "resources": res,
        "violations": [{"t": round(t, 2), "kind": k, "what": w} for t, k, w in ledger.violations],
    }
    ok = not ledger.violations and all(r["ok"] for r in rec) and all(r["flat"] for r in res)
    return text(summary), summary, ok


def text(s):
    lines = [
        f"requests {s['requests']}, received and verified {s['received']} "
        f"({s['bytes_verified'] / 1e9:.2f} GB, {s['mb_per_s']} MB/s)",
        "failed by cause: " + (", ".join(f"{k} {n}" for k, n in s["failures"].items()) or "none"),
        "faults: " + (", ".join(f"{k} {n}" for k, n in sorted(s["faults"].items())) or "none"),
    ]
    for r in s["recoveries"]:
        back = "n/a" if r["recovery_s"] is None else f"{r['recovery_s']:.0f} s"
        pace = "" if r["pace"] == 1.0 else f" (machine at {r['pace']:.0%} of its pace before)"
        cut = "" if r["cut"] is None else f"; the run ended {r['cut']:.0f} s after it: not judged"
        lost = "" if not r["pairs_not_back"] else f"; no traffic again on {', '.join(r['pairs_not_back'])}"
        if r["kind"] in TOUCH_ALL:
            rate = "n/a" if r["rate_recovery_s"] is None else f"{r['rate_recovery_s']:.0f} s"
            judged = f"rate back to {r['bar_mb_s']} MB/s in {rate} (not judged), every pair back in {back}"
        else:
            judged = f"bar {r['bar_mb_s']} MB/s, back in {back}"
        lines.append(
            f"  {r['start']:7.1f} s {r['kind']:<16} {r['target'] or '':<7} "
            f"before {r['baseline_mb_s']:>7} MB/s{pace}, {judged}{lost}{cut}"
            f"{'' if r['ok'] else '  NOT RECOVERED'}"
        )
    lines.append("resources (per minute; growth from the 2nd to the last quarter):")
    for r in s["resources"]:
        parts = [f"{k} {r[k]['per_min']:+}/min ({r[k]['first']} -> {r[k]['last']})" for k in LIMITS if k in r]
        lines.append(
            f"  {r['worker']:<6} {r['seconds']:>6} s  " + ", ".join(parts) + ("" if r["flat"] else "  GROWING")
        )
    for v in s["violations"][:20]:
        lines.append(f"VIOLATION {v['t']:.1f} s {v['kind']}: {v['what']}")
    return "\n".join(lines)
