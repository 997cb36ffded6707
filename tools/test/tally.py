#!/usr/bin/env python3
"""The test command's one tally: every part's results, cargo and pytest alike, in one file.

Each part of tools/test.sh records what ran with `add` (or `fail` when it could not run, or
`skip` when it was left out on purpose); `summary` prints the closing lines and sets the exit
status. Records are JSON lines in the file named by $KVLINK_TALLY (or --tally).

Counts come from the test runners themselves:
- cargo: libtest's "test result:" lines; a skip is a test that passed after writing
  `kvlink-skip {"test": ..., "reason": ..., "detail": ...}` (tests/common's `skip`), so it is
  taken out of the passed count. Ignored tests are the two-process tests' child helpers.
- pytest: its JUnit XML report (--junitxml): one testcase each, passed, failed (a failure or
  an error) or skipped with its message.
- soak: tools/soak.sh's verdict lines, `soak: PASS ...` or `soak: FAIL ...`, one test each.
- fleet: the fleet run's (tools/soak.sh --fleet), `fleet: PASS ...` or `fleet: FAIL ...`.
- check: a check's (tools/test/pychecks.sh), `check: PASS NAME` or `check: FAIL NAME`.

A part fails when a test failed, when its runner exited non-zero without reporting a failure
(a build or collection error), when fewer tests than its minimum passed, or, where skips are
not allowed (--skips fail: the command installed everything those tests need), on any skip.

  tally.py add --part host --label host --kind cargo --log LOG --rc 0 --min 160
  tally.py add --part python --label python --kind pytest --junit X.xml --rc 0 --min 49 --skips fail
  tally.py fail --part sglang --label "SGLang backend" --why "sglang could not be installed"
  tally.py skip --part vm --label "SoftRoCE VM" --why "KVLINK_SKIP_VM=1"
  tally.py time --part host --seconds 212 [--started 40]
  tally.py summary [--total 1830]
"""

import argparse
import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter

SKIP_MARK = "kvlink-skip "
CARGO_RESULT = re.compile(r"^test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored;")


def cargo_counts(text):
    """(ran, failed, ignored) summed over every "test result:" line of a cargo test log."""
    ran = failed = ignored = 0
    for line in text.splitlines():
        m = CARGO_RESULT.match(line)
        if m:
            ran += int(m.group(1))
            failed += int(m.group(2))
            ignored += int(m.group(3))
    return ran, failed, ignored


def cargo_skips(text):
    """The skips a cargo test log reports, as a set of (test, reason).

    A skip record may start mid-line: with one test thread libtest has already written
    "test name ... " when the test writes its skip to stderr.
    """
    decoder = json.JSONDecoder()
    skips = set()
    for line in text.splitlines():
        at = line.find(SKIP_MARK)
        if at < 0:
            continue
        try:
            record, _ = decoder.raw_decode(line, at + len(SKIP_MARK))
            skips.add((str(record["test"]), str(record["reason"])))
        except (ValueError, KeyError, TypeError):
            skips.add(("?", "an unreadable skip record"))
    return skips


def pytest_counts(xml_text):
    """(passed, failed, skipped reasons, {failed test: why}) from a pytest JUnit XML report."""
    root = ET.fromstring(xml_text)
    passed = failed = 0
    skipped = []
    failures = {}
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            failed += 1
            bad = next(child for child in case if child.tag in ("failure", "error"))
            message = (bad.get("message") or "").strip()
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            failures[name] = message.splitlines()[0] if message else ""
        elif "skipped" in kinds:
            skip = case.find("skipped")
            why = skip.get("message", "") if skip is not None else ""
            skipped.append(why.removeprefix("Skipped: ").strip() or "no reason given")
        else:
            passed += 1
    return passed, failed, skipped, failures


CARGO_FAILED = re.compile(r"^test (\S+) \.\.\. FAILED$")
CARGO_STDOUT = re.compile(r"^---- (\S+) stdout ----$")


def cargo_failures(text):
    """The failed tests of a cargo test log, as {test: why}: why is the first line after its
    panic ("panicked at FILE:LINE:COL:") in the test's captured output, or "" when none was
    captured."""
    lines = text.splitlines()
    failed = {m.group(1): "" for m in map(CARGO_FAILED.match, lines) if m}
    current = None
    for i, line in enumerate(lines):
        m = CARGO_STDOUT.match(line)
        if m:
            current = m.group(1)
            continue
        if current in failed and not failed[current] and "panicked at " in line:
            rest = line.split("panicked at ", 1)[1]
            where = rest.rstrip(":")
            message = lines[i + 1].strip() if i + 1 < len(lines) else ""
            failed[current] = f"{message} ({where})" if message else where
    return failed


def tally_cargo(text, rc):
    """A record's counts from a cargo test log and its exit status."""
    ran, failed, ignored = cargo_counts(text)
    skips = sorted(cargo_skips(text))
    problems = []
    if rc != 0 and failed == 0:
        problems.append(f"cargo test exited {rc} before reporting a failure (build error?)")
    return {
        "passed": ran - len(skips),
        "failed": failed,
        "skipped": len(skips),
        "reasons": dict(Counter(reason for _, reason in skips)),
        "ignored": ignored,
        "problems": problems,
        "failures": cargo_failures(text),
    }


# The lines of a soak's or a fleet's report that say why it failed.
SOAK_WHY = {
    "soak": re.compile(r"NOT RECOVERED|GROWING|^VIOLATION "),
    "fleet": re.compile(r"^fleet: failed: "),
    # mypy's errors, ruff's findings (concise output) and the files its formatter would change.
    "check": re.compile(r": error: |^\S+:\d+:\d+: [A-Z]+\d+ |^Would reformat: "),
}


def tally_soak(text, rc, word="soak"):
    """A record's counts from the verdict lines of soak runs (`word` "soak"), fleet runs
    ("fleet") or checks ("check", `check: PASS|FAIL NAME`) and the exit status. A run that
    ended without a verdict (it crashed, or the VM never ran it) is one problem, named with
    the run's last words. A failed run is named with the lines of its output, before its
    verdict and after the one before, that say why."""
    verdict_re = re.compile(rf"^{word}: (?:PASS|FAIL)\b.*$")
    lines: list[str] = []
    said: list[list[str]] = []
    before: list[str] = []
    for ln in text.splitlines():
        if verdict_re.match(ln):
            lines.append(ln)
            said.append(before)
            before = []
        elif SOAK_WHY[word].search(ln):
            before.append(ln.strip())
    verdicts = [line.split()[1] for line in lines]
    problems = []
    if "FAIL" not in verdicts and (rc != 0 or not verdicts):
        exited = re.findall(rf"^{word}: exited (\d+)", text, re.M)
        how = f"exited {exited[-1]}" if exited else (f"exited {rc}" if rc else "printed nothing")
        problems.append(f"the {word} run {how} without a verdict")
    failures = {}
    for verdict, whole, why in zip(verdicts, lines, said):
        if verdict == "FAIL":
            failures[whole.strip()] = "; ".join(why[:5]) or "see its report above"
    return {
        "passed": verdicts.count("PASS"),
        "failed": verdicts.count("FAIL"),
        "skipped": 0,
        "reasons": {},
        "ignored": 0,
        "problems": problems,
        "failures": failures,
    }


def tally_pytest(xml_text, rc):
    """A record's counts from a pytest JUnit report (None: there is none) and its exit status."""
    if xml_text is None:
        return {
            "passed": 0,
            "failed": 0,
            "skipped": 0,
            "reasons": {},
            "ignored": 0,
            "problems": [f"pytest exited {rc} and wrote no report"],
            "failures": {},
        }
    passed, failed, skipped, failures = pytest_counts(xml_text)
    problems = []
    if rc != 0 and failed == 0:
        problems.append(f"pytest exited {rc} before reporting a failure")
    return {
        "passed": passed,
        "failed": failed,
        "skipped": len(skipped),
        "reasons": dict(Counter(skipped)),
        "ignored": 0,
        "problems": problems,
        "failures": failures,
    }


def judge(record, minimum, skips_fail):
    """Adds to a record's problems what its part's rules forbid: too few run, any skip. A test
    that ran and failed is counted once, as a failure: the minimum is of tests run (passed or
    failed), so that a suite that ran fewer than it should is caught without a failed test
    counting twice. A record that already has a problem of its own (no verdict, a build
    error) is not charged again for having run nothing."""
    if skips_fail and record["skipped"]:
        record["problems"].append(
            f"{record['skipped']} skipped; this command installs what they need, so a skip is a failure"
        )
    ran = record["passed"] + record["failed"]
    if ran < minimum and not (ran == 0 and record["problems"]):
        record["problems"].append(f"only {ran} ran; at least {minimum} expected")
    return record


def reasons_text(reasons):
    """ " (2 no CUDA, 1 no RDMA device)" or ""."""
    if not reasons:
        return ""
    ordered = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    return " (" + ", ".join(f"{n} {why}" for why, n in ordered) + ")"


def failed_count(record):
    """Failed tests, plus one for each problem of the part's own (a build error, too few run)."""
    return record["failed"] + len(record["problems"])


def line(record):
    """One part's closing line."""
    if record.get("left_out"):
        return f"  {record['label']}: not run ({record['left_out']})"
    text = (
        f"  {record['label']}: {record['passed']} passed, {failed_count(record)} failed, "
        f"{record['skipped']} skipped{reasons_text(record['reasons'])}"
    )
    if record.get("ignored"):
        text += f"; {record['ignored']} ignored, not counted"
    if record.get("note"):
        text += f"; {record['note']}"
    for test, why in record.get("failures", {}).items():
        text += f"\n    failed: {test}" + (f": {why}" if why else "")
    for problem in record["problems"]:
        text += f"\n    failed: {problem}"
    return text


def times_text(times, total):
    """The parts' wall times, in the order they started, and the total: "part times: checks
    55 s (from 0 s), host 212 s (from 55 s); total 1830 s". Parts side by side overlap."""
    ordered = sorted(times, key=lambda r: (r.get("started", 0), r["part"]))
    text = ", ".join(f"{r['part']} {r['seconds']:.0f} s (from {r.get('started', 0):.0f} s)" for r in ordered)
    return f"part times: {text or 'none'}" + (f"; total {total:.0f} s" if total is not None else "")


def summary(records, total=None):
    """The closing lines and whether the whole run passed."""
    times = [r for r in records if "seconds" in r]
    records = [r for r in records if "seconds" not in r]
    lines = ["test summary:"] + [line(r) for r in records]
    if times or total is not None:
        lines.append(times_text(times, total))
    counted = [r for r in records if not r.get("left_out")]
    passed = sum(r["passed"] for r in counted)
    failed = sum(failed_count(r) for r in counted)
    skipped = sum(r["skipped"] for r in counted)
    lines.append(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
    ok = bool(counted) and failed == 0
    if not counted:
        lines.append("test: no part recorded a result")
    return lines, ok


def read_records(path):
    """Every record in the tally file (none when it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def append(path, record):
    """Adds a record to the tally file and says its problems on stderr."""
    for problem in record["problems"]:
        print(f"test: {record['label']}: {problem}", file=sys.stderr)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_text(path):
    """A file's text, or None when it does not exist."""
    if not path or not os.path.exists(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tally", default=os.environ.get("KVLINK_TALLY", "target/test-tally.jsonl"))
    sub = p.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser("add", help="record a test run")
    add.add_argument("--kind", choices=["cargo", "pytest", "soak", "fleet", "check"], required=True)
    add.add_argument("--log", help="cargo, soak: the run's output")
    add.add_argument("--junit", help="pytest: its --junitxml report")
    add.add_argument("--rc", type=int, required=True)
    add.add_argument("--min", type=int, required=True)
    add.add_argument("--skips", choices=["count", "fail"], default="count")
    add.add_argument("--note", default="")
    for name in ("fail", "skip"):
        q = sub.add_parser(name, help=f"record a part that {'could not run' if name == 'fail' else 'was left out'}")
        q.add_argument("--why", required=True)
    for q in (add, sub.choices["fail"], sub.choices["skip"]):
        q.add_argument("--part", required=True)
        q.add_argument("--label", required=True)
    t = sub.add_parser("time", help="record a part's wall time")
    t.add_argument("--part", required=True)
    t.add_argument("--seconds", type=float, required=True)
    t.add_argument("--started", type=float, default=0.0, help="seconds into the run")
    s = sub.add_parser("summary", help="print the closing lines; exit 1 unless every part passed")
    s.add_argument("--total", type=float, default=None, help="the run's wall time in seconds")
    args = p.parse_args(argv)

    if args.cmd == "add":
        if args.kind == "cargo":
            record = tally_cargo(read_text(args.log) or "", args.rc)
        elif args.kind in ("soak", "fleet", "check"):
            record = tally_soak(read_text(args.log) or "", args.rc, args.kind)
        else:
            record = tally_pytest(read_text(args.junit), args.rc)
        record = judge(record, args.min, args.skips == "fail")
        record.update(part=args.part, label=args.label, note=args.note)
        append(args.tally, record)
    elif args.cmd == "fail":
        append(
            args.tally,
            {
                "part": args.part,
                "label": args.label,
                "passed": 0,
                "failed": 0,
                "skipped": 0,
                "reasons": {},
                "ignored": 0,
                "problems": [args.why],
            },
        )
    elif args.cmd == "skip":
        append(
            args.tally,
            {
                "part": args.part,
                "label": args.label,
                "passed": 0,
                "failed": 0,
                "skipped": 0,
                "reasons": {},
                "ignored": 0,
                "problems": [],
                "left_out": args.why,
            },
        )
    elif args.cmd == "time":
        with open(args.tally, "a", encoding="utf-8") as f:
            f.write(json.dumps({"part": args.part, "seconds": args.seconds, "started": args.started}) + "\n")
    else:
        lines, ok = summary(read_records(args.tally), args.total)
        print("\n".join(lines))
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
