#!/usr/bin/env python
"""Print verifications/s for each reward verifier through a BatchScorer (targets: dapo >= 20k/s, math_verify >= 1k/s
on 2 cores). A benchmark, not a test:  python tools/bench_rewards.py [--workers 2] [--only dapo math_verify]"""
from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--n-fast", type=int, default=100_000, help="items for the in-process verifiers")
    p.add_argument("--n-slow", type=int, default=4_000, help="items for math_verify")
    p.add_argument("--n-code", type=int, default=40, help="items for the code sandbox")
    p.add_argument("--response-chars", type=int, default=3000)
    p.add_argument("--only", nargs="*", default=None, help="verifier names to run")
    p.add_argument("--json", action="store_true", help="print rows as JSON lines")
    a = p.parse_args(argv)
    from justrl_megatron.bench.rewards import format_rows, run_reward_bench

    rows = run_reward_bench(n_fast=a.n_fast, n_slow=a.n_slow, n_code=a.n_code, workers=a.workers,
                            response_chars=a.response_chars, only=a.only)
    print(f"reward verifiers on {os.cpu_count()} cores, {a.workers} workers, ~{a.response_chars}-char responses")
    print(format_rows(rows))
    if a.json:
        for r in rows:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
