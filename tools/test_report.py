"""The test suite's time, read from pytest's JUnit XML: wall time, the slowest tests, time per module, and the guard.

    python tools/test_report.py REPORT.xml --wall SECONDS [--budget SECONDS] [--slowest 15] [--modules]

Exit 1, naming the budget, when --wall exceeds --budget (tools/run_tests.sh runs this after the suite). A test's
time is pytest's own (setup + call + teardown, so a module-scoped fixture counts in the first test that uses it).
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def read_cases(path: str) -> list[dict]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
        module = case.get("classname", "").split(".")
        cases.append({"id": f"{case.get('classname')}::{case.get('name')}",
                      "module": "/".join(m for m in module if not m[:1].isupper()),
                      "seconds": float(case.get("time") or 0.0), "outcome": outcome})
    return cases


def minutes(seconds: float) -> str:
    return f"{seconds:7.1f} s ({seconds / 60:4.1f} min)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report")
    p.add_argument("--wall", type=float, required=True, help="the pytest run's wall time, seconds")
    p.add_argument("--budget", type=float, default=None, help="fail when --wall exceeds this many seconds")
    p.add_argument("--slowest", type=int, default=15)
    p.add_argument("--modules", action="store_true", help="also print the time per module")
    args = p.parse_args(argv)
    try:
        cases = read_cases(args.report)
    except (OSError, ET.ParseError) as exc:
        print(f"test_report: no readable JUnit report at {args.report} ({exc})", file=sys.stderr)
        cases = []
    counts = defaultdict(int)
    for c in cases:
        counts[c["outcome"]] += 1
    summed = sum(c["seconds"] for c in cases)
    print(f"\n== test suite: wall {minutes(args.wall)}; {len(cases)} tests "
          f"({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))}); summed test time {minutes(summed)}")
    print(f"== the {args.slowest} slowest tests")
    for c in sorted(cases, key=lambda c: -c["seconds"])[:args.slowest]:
        print(f"{c['seconds']:8.1f} s  {c['id']}")
    if args.modules:
        per_module = defaultdict(float)
        for c in cases:
            per_module[c["module"]] += c["seconds"]
        print("== time per module")
        for module, seconds in sorted(per_module.items(), key=lambda kv: -kv[1]):
            print(f"{seconds:8.1f} s  {module}")
    if args.budget is not None and args.wall > args.budget:
        print(f"test_report: the suite took {args.wall:.0f} s, over its budget of {args.budget:.0f} s "
              f"({args.budget / 60:.0f} min; JUSTRL_TEST_BUDGET_S). CI stops merges at 90 minutes in all: make the "
              "slow tests above cheaper (docs/testing.md says how) before adding more.", file=sys.stderr)
        return 1
    print(f"== within the budget of {args.budget:.0f} s" if args.budget is not None else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
