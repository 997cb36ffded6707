"""Tests of the fleet run's arithmetic (fleet_math.py): no process is started."""

import unittest

from fleet_math import leftover, median, per_session, percentile, rotation_bound, tick_period, timer_lag


class FleetMathTest(unittest.TestCase):
    def test_percentiles_take_the_nearest_rank(self):
        xs = list(range(1, 101))
        self.assertEqual(percentile(xs, 50), 50)
        self.assertEqual(percentile(xs, 99), 99)
        self.assertEqual(percentile(xs, 100), 100)
        self.assertEqual(percentile([7], 99), 7)
        self.assertEqual(median([3, 1, 2]), 2)
        self.assertIsNone(percentile([], 50))

    def test_the_tick_follows_the_engine(self):
        self.assertEqual(tick_period(2.0), 0.5)
        self.assertEqual(tick_period(0.1), 0.05)
        self.assertEqual(tick_period(120.0), 5.0)

    def test_the_rotation_bound_counts_every_session_not_yet_reaped(self):
        # Idle 2 s, reaped within 2.5 s; a new prefill every 0.5 s: 5 behind, 1 in use.
        self.assertEqual(rotation_bound(2.0, 0.5), 6)
        self.assertEqual(rotation_bound(120.0, 1.0), 126)
        # Slower than the limit: each closed before the next opens.
        self.assertEqual(rotation_bound(2.0, 10.0), 1)
        self.assertEqual(rotation_bound(2.0, 0.7), 4)

    def test_a_decode_whose_timers_ran_late_may_hold_what_the_lateness_allows(self):
        # Stats every second; on a loaded machine one came 0.6 s late: the reaper may have too.
        on_time = [float(t) for t in range(10)]
        self.assertEqual(timer_lag(on_time, 1.0, 0.0, 10.0), 0.0)
        late = [0.0, 1.0, 2.6, 3.6, 4.6]
        self.assertAlmostEqual(timer_lag(late, 1.0, 0.0, 10.0), 0.6)
        self.assertEqual(timer_lag(late, 1.0, 3.0, 10.0), 0.0, "only the span's firings")
        self.assertEqual(rotation_bound(2.0, 0.5, 0.6), 7)
        self.assertEqual(rotation_bound(2.0, 0.5, 0.0), rotation_bound(2.0, 0.5), "no lag, no slack")

    def test_per_session_cost_and_what_is_left(self):
        base = {"fds": 20, "threads": 6, "rss_anon_kib": 4000}
        up = {"fds": 84, "threads": 6, "rss_anon_kib": 6048}
        self.assertEqual(per_session(base, up, 32), {"fds": 2.0, "threads": 0.0, "rss_anon_kib": 64.0})
        self.assertEqual(per_session(base, up, 0), {})
        slack = {"fds": 2, "threads": 1}
        self.assertEqual(leftover(base, {"fds": 22, "threads": 7}, slack), {})
        self.assertEqual(leftover(base, {"fds": 30, "threads": 6}, slack), {"fds": (20, 30)})


if __name__ == "__main__":
    unittest.main()
