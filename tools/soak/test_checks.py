"""Tests of the soak's invariants and report arithmetic (python3 -m unittest discover -s
tools/soak), on event sequences written by hand: each violation the ledger must catch, and
what it must let pass."""

import unittest

from checks import BACKSTOP, Ledger, baseline, recovery, resumed, slope
from report import recoveries, resources


def ledger():
    return Ledger(request_timeout=10.0, lease=3.0, keepalive=0.5, slack=2.0)


def request(l, rid="r1", t=0.0, abort=20.0, expected=100):
    l.issue(rid, "P1", "D1", expected, t, abort)
    l.held(rid, t + 0.01)
    l.read_sent(rid, t + 0.02)


def kinds(l):
    return [k for _, k, _ in l.violations]


class Outcomes(unittest.TestCase):
    def test_a_confirmed_read_passes(self):
        l = ledger()
        request(l)
        l.on_received("r1", 0.1, 100, 100)
        l.on_sent("r1", 0.1)
        l.check_deadlines(1000)
        self.assertEqual(l.violations, [])
        self.assertEqual((l.received, l.bytes_verified), (1, 100))

    def test_bytes_not_all_verified_are_a_violation(self):
        l = ledger()
        request(l)
        l.on_received("r1", 0.1, 100, 96)
        self.assertEqual(kinds(l), ["bytes"])
        l = ledger()
        request(l)
        l.on_corrupt("r1", 0.1, "tensor 0 differs")
        self.assertEqual(kinds(l), ["bytes"])

    def test_received_from_a_hold_that_failed_is_caught_in_either_order(self):
        l = ledger()
        request(l)
        l.on_hold_end("r1", 0.5, "expired")
        l.on_received("r1", 0.6, 100, 100)
        self.assertEqual(kinds(l), ["unconfirmed"])
        l = ledger()
        request(l)
        l.on_received("r1", 0.6, 100, 100)
        l.on_hold_end("r1", 0.7, "peer")
        self.assertEqual(kinds(l), ["unconfirmed"])

    def test_a_confirmed_hold_whose_read_failed_is_caught_in_either_order(self):
        for cancelled in (False, True):
            for cause in ("peer", "cancelled"):
                for sent_first in (False, True):
                    l = ledger()
                    request(l)
                    if cancelled:
                        l.cancelled("r1")
                    sent = ("sent", 0.2)
                    failed = ("failed", 0.3)
                    for kind, t in [sent, failed] if sent_first else [failed, sent]:
                        if kind == "sent":
                            l.on_sent("r1", t)
                        else:
                            l.on_read_failed("r1", t, cause)
                    # Only a cancel the soak sent, racing the prefill's confirmation, may end so.
                    want = [] if cancelled and cause == "cancelled" else ["confirmed-failed"]
                    self.assertEqual(kinds(l), want, (cancelled, cause, sent_first))

    def test_a_decode_stopped_during_its_read_may_time_out_a_confirmed_hold(self):
        for stopped in (False, True):
            for cause in ("unconfirmed", "expired", "peer"):
                l = ledger()
                request(l)
                l.on_sent("r1", 0.2)
                if stopped:
                    l.stop("D1", 0.1)
                    l.resume("D1", 3.0)
                l.on_read_failed("r1", 3.0, cause)
                # Only a failure by the decode's own clock, and only after it was stopped.
                want = [] if stopped and cause != "peer" else ["confirmed-failed"]
                self.assertEqual(kinds(l), want, (stopped, cause))

    def test_a_prefill_that_died_voids_its_hold(self):
        l = ledger()
        request(l)
        l.died("P1", 0.3)
        l.on_received("r1", 0.4, 100, 100)
        l.check_deadlines(1000)
        self.assertEqual(l.violations, [])

    def test_a_prefill_that_died_before_its_hold_began_ends_the_request(self):
        l = ledger()
        l.issue("r1", "P1", "D1", 100, 0.0, 20.0)
        l.died("P1", 0.1)
        self.assertEqual(l.open_requests(), [])

    def test_a_failed_read_is_counted_by_cause(self):
        l = ledger()
        request(l)
        l.on_read_failed("r1", 0.2, "unconfirmed")
        l.on_hold_end("r1", 0.3, "expired")
        self.assertEqual(l.failures, {"read:unconfirmed": 1, "hold:expired": 1})
        self.assertEqual(l.violations, [])

    def test_an_outcome_twice_or_for_no_request(self):
        l = ledger()
        request(l)
        l.on_read_failed("r1", 0.2, "peer")
        l.on_received("r1", 0.3, 100, 100)
        l.on_sent("nobody", 0.3)
        self.assertEqual(kinds(l), ["twice", "unknown"])

    def test_an_ended_request_leaves_the_open_ones(self):
        l = ledger()
        request(l)
        l.on_received("r1", 0.1, 100, 100)
        self.assertEqual(len(l.open_requests()), 1, "its hold is still open")
        l.on_sent("r1", 0.1)
        self.assertEqual(l.open_requests(), [])
        l.on_sent("r1", 0.2)
        self.assertEqual(kinds(l), ["twice"])


class Deadlines(unittest.TestCase):
    def test_an_open_read_past_its_deadline(self):
        l = ledger()
        request(l)
        bound = 0.02 + 10.0 + BACKSTOP + 2.0
        l.check_deadlines(bound - 0.1)
        self.assertEqual(l.violations, [])
        l.check_deadlines(bound + 0.1)
        self.assertIn("read-deadline", kinds(l))

    def test_a_hold_that_never_began(self):
        l = ledger()
        l.issue("r1", "P1", "D1", 100, 0.0, 20.0)
        l.check_deadlines(4.9)
        self.assertEqual(l.violations, [])
        l.check_deadlines(5.1)
        self.assertEqual(kinds(l), ["hold-deadline"])
        self.assertEqual(l.open_requests(), [])

    def test_a_stopped_decode_extends_its_reads(self):
        l = ledger()
        request(l)
        l.stop("D1", 1.0)
        l.resume("D1", 5.0)
        l.on_sent("r1", 0.5)
        l.check_deadlines(0.02 + 10.0 + BACKSTOP + 2.0 + 3.9)
        self.assertEqual(l.violations, [])

    def test_a_hold_ends_within_the_lease_after_its_reader_died(self):
        l = ledger()
        request(l, abort=20.0)
        l.died("D1", 1.0)
        l.on_hold_end("r1", 1.0 + 3.0 + 1.5 + 1.9, "expired")
        self.assertEqual(l.violations, [])
        l = ledger()
        request(l, abort=20.0)
        l.died("D1", 1.0)
        l.on_hold_end("r1", 1.0 + 3.0 + 1.5 + 2.1, "expired")
        self.assertEqual(kinds(l), ["hold-deadline"])

    def test_a_prefill_that_did_not_poll_may_report_late(self):
        l = ledger()
        request(l, abort=0.3)
        l.stop("P1", 0.1)
        l.resume("P1", 3.0)
        l.on_hold_end("r1", 3.1, "expired")
        self.assertEqual(l.violations, [])


class Arithmetic(unittest.TestCase):
    def test_slope_and_recovery(self):
        self.assertAlmostEqual(slope([(0, 1), (1, 3), (2, 5)]), 2.0)
        self.assertEqual(slope([(1, 1)]), 0.0)
        rates = [(10.0, 100.0), (11.0, 20.0), (12.0, 50.0), (13.0, 95.0)]
        self.assertEqual(recovery(rates, 11.0, 100.0), 2.0)
        self.assertIsNone(recovery(rates, 11.0, 200.0))

    def test_a_fault_must_be_recovered_from_within_twice_the_quiet_window(self):
        rates = [(float(t), 100.0) for t in range(0, 10)] + [(10.0, 0.0), (11.0, 0.0)]
        rates += [(float(t), 100.0) for t in range(12, 30)]
        fault = {"kind": "kill_decode", "target": "D1", "detail": "", "start": 10.0, "end": 10.5}
        (r,) = recoveries([fault], rates, rates, quiet=6.0)
        self.assertTrue(r["ok"])
        self.assertEqual(r["recovery_s"], 1.5)
        slow = [(t, 0.0 if 10 <= t < 25 else r_) for t, r_ in rates]
        self.assertFalse(recoveries([fault], slow, slow, quiet=6.0)[0]["ok"])
        # Back, but only to 85% of the rate before: not recovered.
        lower = [(t, 85.0 if t >= 10 else r_) for t, r_ in rates]
        self.assertFalse(recoveries([fault], lower, lower, quiet=6.0)[0]["ok"])

    def test_a_machine_that_slowed_down_lowers_the_bar_as_the_untouched_pair_shows(self):
        # The VM's 60-second soak on a loaded host: from the fault on, everything runs at 70%,
        # the pair no fault touches as well. Judged against the rate before alone, the fault
        # never recovers; against the machine's own pace, it did.
        fault = {"kind": "cancel_burst", "target": "D1", "detail": "", "start": 31.9, "end": 31.9}
        total = [(float(t), 100.0 if t < 32 else 70.0) for t in range(1, 60)]
        control = [(t, r / 4) for t, r in total]
        (r,) = recoveries([fault], total, total, quiet=4.0)
        self.assertFalse(r["ok"], "the old rule")
        (r,) = recoveries([fault], total, total, quiet=4.0, control=control, run_end=60.0)
        self.assertTrue(r["ok"], r)
        self.assertEqual(r["pace"], 0.7)
        # The next fault 10 s later (a quiet window of 4 s): the untouched pair's seconds
        # inside the recovery window show the pace. The loaded rehearsal's VM soak failed three
        # faults when only the 2 s between that window and the next fault counted.
        second = dict(fault, start=42.0, end=42.0)
        (r, _) = recoveries([fault, second], total, total, quiet=4.0, control=control, run_end=60.0)
        self.assertEqual((r["ok"], r["pace"]), (True, 0.7))
        # The faulted workers slower and the untouched pair as fast as before: not recovered.
        steady = [(t, 25.0) for t, _ in total]
        (r,) = recoveries([fault], total, total, quiet=4.0, control=steady, run_end=60.0)
        self.assertFalse(r["ok"], r)
        self.assertEqual(r["pace"], 1.0)
        # A link taken down under every session touches the untouched pair too: no pace, so
        # its rate is reported and not judged (a slower machine is not a failed recovery)...
        flap = dict(fault, kind="link_flap", target="dummy0")
        pairs = {("P0", "D0"): {t: 1 for t in range(1, 60)}, ("P1", "D1"): {t: 1 for t in range(1, 60)}}
        (r,) = recoveries([flap], total, total, quiet=4.0, control=control, run_end=60.0, pairs=pairs)
        self.assertEqual((r["ok"], r["pace"], r["rate_recovery_s"]), (True, 1.0, None))
        self.assertLess(r["recovery_s"], 1.0)
        # ...and it is judged on every pair carrying traffic again within the window.
        gone = {**pairs, ("P1", "D1"): {t: 1 for t in range(1, 30)}}
        (r,) = recoveries([flap], total, total, quiet=4.0, control=control, run_end=60.0, pairs=gone)
        self.assertEqual((r["ok"], r["pairs_not_back"]), (False, ["P1->D1"]))
        # The untouched pair faster after (it took the faulted decode's share): the bar stays.
        faster = [(t, 25.0 if t < 32 else 40.0) for t, _ in total]
        (r,) = recoveries([fault], total, total, quiet=4.0, control=faster, run_end=60.0)
        self.assertEqual((r["ok"], r["pace"]), (False, 1.0))

    def test_a_fault_the_end_of_the_run_cut_short_is_judged_on_what_it_saw(self):
        fault = {"kind": "stall_decode", "target": "D1", "detail": "", "start": 50.0, "end": 54.0}
        rates = [(float(t), 0.0 if t >= 50 else 100.0) for t in range(1, 58)]
        (r,) = recoveries([fault], rates, rates, quiet=4.0, run_end=58.0)
        self.assertTrue(r["ok"], r)
        self.assertEqual(r["cut"], 4.0)
        # The whole window seen and still not back: failed.
        (r,) = recoveries([fault], rates, rates, quiet=4.0, run_end=62.0)
        self.assertEqual((r["ok"], r["cut"]), (False, None))
        # Back within what the run saw: recovered, not cut.
        back = [(t, 100.0 if t >= 56 else r_) for t, r_ in rates]
        (r,) = recoveries([fault], back, back, quiet=4.0, run_end=58.0)
        self.assertEqual((r["ok"], r["cut"], r["recovery_s"]), (True, None, 2.0))

    def test_a_peak_just_before_a_fault_does_not_raise_the_bar(self):
        # The rate moves around 100 with a peak of 140 in the 3 s before the fault (the
        # rehearsal's 60-second soak failed a wrong_key fault on such a peak).
        per_second = [(float(t), 140.0 if 27 <= t < 30 else 100.0) for t in range(1, 45)]
        self.assertEqual(baseline(per_second, 30.0, [], 30.0), 100.0)
        fault = {"kind": "wrong_key", "target": "P0", "detail": "", "start": 30.0, "end": 33.0}
        rate = dict(per_second)
        windows = [(float(t), sum(rate[t - k] for k in range(3)) / 3) for t in range(3, 45)]
        (r,) = recoveries([fault], windows, per_second, quiet=5.0)
        self.assertTrue(r["ok"], r)

    def test_a_noisy_machine_is_judged_against_its_own_spread(self):
        # The VM under emulation: 3-second windows alternate 80 and 120 around a median of 100
        # with no fault. Back at 85 after the fault is where the run usually is: recovered.
        windows = [(float(t), 80e6 if t % 2 else 120e6) for t in range(3, 30)]
        windows += [(float(t), 0.0 if t < 32 else 85e6) for t in range(30, 50)]
        per_second = [(t, 100e6 if t < 30 else r_) for t, r_ in windows]
        fault = {"kind": "kill_prefill", "target": "P1", "detail": "", "start": 30.0, "end": 31.0}
        (r,) = recoveries([fault], windows, per_second, quiet=4.0)
        self.assertEqual((r["ok"], r["bar_mb_s"]), (True, 80.0), r)
        # Back at 70, below anything the run showed before: not recovered.
        low = [(t, 70e6 if t >= 32 else r_) for t, r_ in windows]
        (r,) = recoveries([fault], low, per_second, quiet=4.0)
        self.assertFalse(r["ok"], r)
        # A steady machine keeps the bar at 90% of the rate before.
        steady = [(t, 100e6 if t < 30 else r_) for t, r_ in windows]
        (r,) = recoveries([fault], steady, per_second, quiet=4.0)
        self.assertEqual((r["ok"], r["bar_mb_s"]), (False, 90.0), r)

    def test_every_pair_must_carry_traffic_again(self):
        rates = [(float(t), 100.0) for t in range(1, 50)]
        fault = {"kind": "kill_prefill", "target": "P1", "detail": "", "start": 30.0, "end": 31.0}
        pairs = {("P0", "D0"): {t: 25 for t in range(1, 50)}, ("P1", "D0"): {t: 25 for t in range(1, 50)}}
        (r,) = recoveries([fault], rates, rates, quiet=4.0, pairs=pairs)
        self.assertEqual((r["ok"], r["pairs_not_back"]), (True, []), r)
        # P1 to D0 never again, though the total is as before (P0 took its share).
        pairs[("P1", "D0")] = {t: 25 for t in range(1, 30)}
        (r,) = recoveries([fault], rates, rates, quiet=4.0, pairs=pairs)
        self.assertEqual((r["ok"], r["pairs_not_back"]), (False, ["P1->D0"]), r)
        # Back 6 s after the fault's end: the fault's recovery time is the pair's.
        pairs[("P1", "D0")] = {t: 25 for t in list(range(1, 30)) + list(range(37, 50))}
        (r,) = recoveries([fault], rates, rates, quiet=4.0, pairs=pairs)
        self.assertEqual((r["ok"], r["recovery_s"]), (True, 7.0), r)
        self.assertEqual(resumed(pairs, 30.0, 31.0, 8.0), (7.0, []))
        # A pair that carried nothing before the fault is not waited for.
        pairs[("P1", "D1")] = {45: 25}
        self.assertEqual(resumed(pairs, 30.0, 31.0, 8.0), (7.0, []))

    def test_the_rate_before_leaves_out_earlier_faults_and_the_fault_itself(self):
        per_second = [(float(t), 0.0 if 10 <= t < 16 else 100.0) for t in range(1, 40)]
        # The dip of the fault at 10 s is left out of the next fault's rate before.
        self.assertEqual(baseline(per_second, 30.0, [(10.0, 16.0)], 30.0), 100.0)
        self.assertEqual(baseline(per_second, 30.0, [], 30.0), 100.0)
        self.assertEqual(baseline(per_second, 16.0, [(10.0, 16.0)], lookback=6.0), 0.0)
        # Only seconds wholly before the start count: the second from 30 does not.
        spike = per_second[:29] + [(30.0, 1e9)]
        self.assertEqual(baseline(spike, 30.5, [], 30.0), 100.0)

    def test_a_growing_life_is_not_flat(self):
        flat = [(float(t), {"fds": 30, "threads": 9, "rss_anon_kib": 9000}) for t in range(60)]
        grow = [(t, dict(s, fds=30 + int(t))) for t, s in flat]
        out = resources({("D0", 1): flat, ("P0", 1): grow, ("P1", 2): flat[:5]}, warmup=0)
        self.assertEqual([r["worker"] for r in out], ["D0.1", "P0.1"], "a 5 s life is not judged")
        self.assertTrue(out[0]["flat"])
        self.assertFalse(out[1]["flat"])
        self.assertAlmostEqual(out[1]["fds"]["per_min"], 60.0, places=0)


if __name__ == "__main__":
    unittest.main()
