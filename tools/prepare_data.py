#!/usr/bin/env python
"""Write a prepared training/eval parquet (columns: prompt, answer, data_source, id).

  python tools/prepare_data.py --input dapo-math-17k.parquet --format dapo --output data/dapo_train.parquet
  python tools/prepare_data.py --input gsm8k/test.jsonl --format gsm8k --template think --output data/gsm8k.parquet
  python tools/prepare_data.py --generate basic_arithmetic --n 512 --seed 0 --task-option max_terms=2 \
      --output data/demo.parquet
"""
from __future__ import annotations

import argparse
import ast
import sys

from justrl_megatron.data import FORMATS, prepare_dataset


def _option(text: str):
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="local file/directory, or a hub name (needs network)")
    src.add_argument("--generate", metavar="TASK", help="a reasoning-gym task, e.g. basic_arithmetic")
    p.add_argument("--format", default="generic", choices=FORMATS)
    p.add_argument("--output", required=True)
    p.add_argument("--template", default="justrl", help="justrl | plain | think | countdown | 'raw:<format>'")
    p.add_argument("--system", default=None, help="system prompt (chat templates)")
    p.add_argument("--split", default="train")
    p.add_argument("--no-dedup", action="store_true", help="keep exact duplicates (DAPO-Math-17k repeats ~100x)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--data-source", default=None, help="override data_source")
    p.add_argument("--n", type=int, default=1000, help="rows to generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task-option", type=_option, action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    try:
        n = prepare_dataset(a.output, path=a.input, fmt=a.format, task=a.generate, n=a.n, seed=a.seed,
                            task_options=dict(a.task_option), template=a.template, system=a.system, split=a.split,
                            dedup=not a.no_dedup, limit=a.limit, data_source=a.data_source)
    except (ValueError, FileNotFoundError) as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} rows to {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
