"""Tests of the test command's tally (python3 -m unittest discover -s tools/test)."""

import contextlib
import io
import json
import os
import tempfile
import unittest

import tally

CARGO_LOG = """\
   Compiling kvlink v0.1.0
running 3 tests
test a ... ok
test b ... kvlink-skip {"test":"b","reason":"no CUDA","detail":"libcuda.so: not found"}
ok
test c ... ok
test result: ok. 3 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.01s

running 2 tests
d: skipped: no RDMA device (no verbs library)
kvlink-skip {"test":"d","reason":"no RDMA device","detail":"no verbs library"}
kvlink-skip {"test":"d","reason":"no RDMA device","detail":"no verbs library"}
test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s
"""

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="6">
<testcase classname="t" name="ok1" time="0.1"/>
<testcase classname="t" name="ok2" time="0.1"><system-out>x</system-out></testcase>
<testcase classname="t" name="bad"><failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="t" name="broken"><error message="fixture failed">trace</error></testcase>
<testcase classname="t" name="s1"><skipped type="pytest.skip" message="Skipped: no vLLM">x</skipped></testcase>
<testcase classname="t" name="s2"><skipped type="pytest.skip" message="no vLLM">x</skipped></testcase>
</testsuite></testsuites>
"""


class Cargo(unittest.TestCase):
    def test_counts_sum_every_result_line(self):
        self.assertEqual(tally.cargo_counts(CARGO_LOG), (4, 1, 2))

    def test_skips_are_read_mid_line_and_once_per_test(self):
        self.assertEqual(tally.cargo_skips(CARGO_LOG), {("b", "no CUDA"), ("d", "no RDMA device")})

    def test_an_unreadable_skip_still_counts(self):
        self.assertEqual(tally.cargo_skips("kvlink-skip {broken\n"), {("?", "an unreadable skip record")})

    def test_skips_leave_the_passed_count(self):
        r = tally.tally_cargo(CARGO_LOG, 101)
        self.assertEqual((r["passed"], r["failed"], r["skipped"], r["ignored"]), (2, 1, 2, 2))
        self.assertEqual(r["reasons"], {"no CUDA": 1, "no RDMA device": 1})
        self.assertEqual(r["problems"], [])

    def test_failed_tests_are_named_with_their_panic(self):
        log = (
            "test a::b ... FAILED\ntest c ... ok\n\nfailures:\n\n---- a::b stdout ----\n\n"
            "thread 'a::b' panicked at tests/x.rs:3:5:\nassertion failed: ok\n\nfailures:\n    a::b\n"
        )
        self.assertEqual(tally.cargo_failures(log), {"a::b": "assertion failed: ok (tests/x.rs:3:5)"})
        self.assertEqual(tally.cargo_failures("test q ... FAILED\n"), {"q": ""})

    def test_an_exit_without_a_failure_is_a_problem(self):
        r = tally.tally_cargo("error[E0425]: cannot find value\n", 101)
        self.assertEqual(r["passed"], 0)
        self.assertIn("build error", r["problems"][0])


class Soak(unittest.TestCase):
    def test_verdict_lines_count(self):
        log = "soak: seed 5\nsoak: PASS seed=5 minutes=1\nsoak:  12.0 s  kill_decode D1\n"
        r = tally.tally_soak(log, 0)
        self.assertEqual((r["passed"], r["failed"], r["problems"]), (1, 0, []))
        r = tally.tally_soak(log + "soak: FAIL seed=6 minutes=1\n", 1)
        self.assertEqual((r["passed"], r["failed"], r["problems"]), (1, 1, []))

    def test_fleet_verdicts_are_counted_apart_from_the_soaks(self):
        log = "soak: PASS seed=5 minutes=1\nfleet: 4 prefills\nfleet: PASS 4x4 sessions=16\n"
        r = tally.tally_soak(log, 0, "fleet")
        self.assertEqual((r["passed"], r["failed"]), (1, 0))
        r = tally.tally_soak("fleet: up: D1 holds 0 sessions\nfleet: FAIL 4x4\n", 1, "fleet")
        self.assertEqual((r["passed"], r["failed"], r["problems"]), (0, 1, []))
        self.assertEqual(tally.tally_soak(log, 0)["passed"], 1, "the soak's own line")

    def test_each_failed_check_is_named_with_its_own_errors(self):
        log = (
            "a.py:3:1: F401 `os` imported but unused\n"
            "check: FAIL ruff check\n"
            "check: PASS ruff format\n"
            'core.py:9: error: Name "x" is not defined  [name-defined]\n'
            "Found 1 error in 1 file\n"
            "check: FAIL mypy kvlink\n"
        )
        r = tally.tally_soak(log, 1, "check")
        self.assertEqual((r["passed"], r["failed"], r["problems"]), (1, 2, []))
        self.assertEqual(r["failures"]["check: FAIL ruff check"], "a.py:3:1: F401 `os` imported but unused")
        self.assertIn("core.py:9: error", r["failures"]["check: FAIL mypy kvlink"])
        self.assertNotIn("F401", r["failures"]["check: FAIL mypy kvlink"])

    def test_an_exit_without_a_verdict_is_a_problem(self):
        r = tally.tally_soak("soak: seed 5\nTraceback\n", 1)
        self.assertEqual(r["passed"] + r["failed"], 0)
        self.assertIn("without a verdict", r["problems"][0])


class Pytest(unittest.TestCase):
    def test_each_testcase_counts_once(self):
        passed, failed, skipped, failures = tally.pytest_counts(JUNIT)
        self.assertEqual((passed, failed), (2, 2))
        self.assertEqual(skipped, ["no vLLM", "no vLLM"])
        self.assertEqual(failures, {"t::bad": "assert 1 == 2", "t::broken": "fixture failed"})

    def test_no_report_is_a_problem(self):
        r = tally.tally_pytest(None, 4)
        self.assertEqual(r["problems"], ["pytest exited 4 and wrote no report"])

    def test_a_failure_reported_explains_the_exit(self):
        r = tally.tally_pytest(JUNIT, 1)
        self.assertEqual(r["problems"], [])
        self.assertEqual(r["reasons"], {"no vLLM": 2})


class Rules(unittest.TestCase):
    def record(self, passed, skipped=0):
        return {
            "passed": passed,
            "failed": 0,
            "skipped": skipped,
            "reasons": {},
            "ignored": 0,
            "problems": [],
            "label": "x",
        }

    def test_too_few_passed_fails_the_part(self):
        r = tally.judge(self.record(3), 4, False)
        self.assertEqual(r["problems"], ["only 3 ran; at least 4 expected"])
        self.assertEqual(tally.failed_count(r), 1)

    def test_a_failed_run_counts_once(self):
        # The VM's soak failing its recovery check: one failure, not also "too few passed".
        log = (
            "soak:    31.9 s  cancel_burst D1\n"
            "    31.9 s cancel_burst     D1      before     4.8 MB/s, back in n/a  NOT RECOVERED\n"
            "soak: FAIL seed=7 minutes=1 requests=900 received=880 violations=0\n"
        )
        r = tally.judge(tally.tally_soak(log, 0), 1, False)
        self.assertEqual((r["passed"], tally.failed_count(r)), (0, 1))
        ((test, why),) = r["failures"].items()
        self.assertTrue(test.startswith("soak: FAIL seed=7"))
        self.assertIn("cancel_burst", why)
        self.assertIn("NOT RECOVERED", tally.line(dict(r, label="soak")))

    def test_no_verdict_is_one_problem_that_says_so(self):
        r = tally.judge(tally.tally_soak("soak: exited 1\n", 0), 1, False)
        self.assertEqual(r["problems"], ["the soak run exited 1 without a verdict"])

    def test_skips_fail_only_where_told(self):
        self.assertEqual(tally.judge(self.record(5, 2), 4, False)["problems"], [])
        self.assertIn("a skip is a failure", tally.judge(self.record(5, 2), 4, True)["problems"][0])

    def test_summary_totals_and_verdict(self):
        good = dict(self.record(5, 1), reasons={"no CUDA": 1}, ignored=3, note="helpers")
        left = dict(self.record(0), left_out="KVLINK_SKIP_VM=1")
        lines, ok = tally.summary([good, left])
        self.assertTrue(ok)
        self.assertEqual(lines[1], "  x: 5 passed, 0 failed, 1 skipped (1 no CUDA); 3 ignored, not counted; helpers")
        self.assertEqual(lines[2], "  x: not run (KVLINK_SKIP_VM=1)")
        self.assertEqual(lines[-1], "tests: 5 passed, 0 failed, 1 skipped")
        bad = dict(self.record(5), problems=["pytest exited 2 before reporting a failure"])
        lines, ok = tally.summary([good, bad])
        self.assertFalse(ok)
        self.assertEqual(lines[-1], "tests: 10 passed, 1 failed, 1 skipped")

    def test_part_times_are_listed_in_start_order_and_not_counted(self):
        times = [
            {"part": "host", "seconds": 212.4, "started": 55.0},
            {"part": "checks", "seconds": 55.0, "started": 0.0},
        ]
        lines, ok = tally.summary([self.record(5)] + times, total=1830)
        self.assertTrue(ok)
        self.assertEqual(lines[-2], "part times: checks 55 s (from 0 s), host 212 s (from 55 s); total 1830 s")
        self.assertEqual(lines[-1], "tests: 5 passed, 0 failed, 0 skipped")
        self.assertFalse(tally.summary(times)[1], "times alone are no result")

    def test_nothing_recorded_is_not_a_pass(self):
        self.assertFalse(tally.summary([])[1])


class Command(unittest.TestCase):
    def test_add_fail_skip_then_summary(self):
        out = io.StringIO()
        with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            log = os.path.join(d, "log")
            with open(log, "w") as f:
                f.write(CARGO_LOG.replace("1 failed", "0 failed"))
            t = os.path.join(d, "tally.jsonl")
            self.assertEqual(
                tally.main(
                    [
                        "--tally",
                        t,
                        "add",
                        "--part",
                        "host",
                        "--label",
                        "host",
                        "--kind",
                        "cargo",
                        "--log",
                        log,
                        "--rc",
                        "0",
                        "--min",
                        "2",
                    ]
                ),
                0,
            )
            self.assertEqual(
                tally.main(["--tally", t, "skip", "--part", "vm", "--label", "VM", "--why", "KVLINK_SKIP_VM=1"]), 0
            )
            self.assertEqual(tally.main(["--tally", t, "summary"]), 0)
            tally.main(["--tally", t, "fail", "--part", "sglang", "--label", "SGLang", "--why", "not installed"])
            self.assertEqual(tally.main(["--tally", t, "summary"]), 1)
            with open(t) as f:
                parts = [json.loads(line)["part"] for line in f]
            self.assertEqual(parts, ["host", "vm", "sglang"])
        self.assertIn("test: SGLang: not installed", out.getvalue())
        self.assertIn("    failed: not installed", out.getvalue())


if __name__ == "__main__":
    unittest.main()
