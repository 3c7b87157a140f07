"""Built-in offline benchmarks: real competition problems shipped in PyPI packages, readable with no hub.

===================== ================================================================================================
name                  contents
===================== ================================================================================================
builtin:champ         CHAMP (``champ-dataset``, MIT): 270 competition-level problems (number theory, polynomials,
                      sequences, inequalities, combinatorics) with free-form reference answers
builtin:champ-numeric the 79 CHAMP problems whose answer is one plain number: the exact-answer verifiers
                      (``dapo`` strict box, ``gsm8k``, ``math_verify``) score them without a judge model
===================== ================================================================================================

Records are ``{"problem", "answer", "id", "data_source", "category"}``: any loader format that reads
problem/answer columns (``generic``, ``math``, ``aime``) takes them, e.g. ``data.train=builtin:champ-numeric`` or
``justrl-eval --data builtin:champ-numeric``.
"""
from __future__ import annotations

import functools
import json
import re

BUILTIN_PREFIX = "builtin:"
_NUMBER = re.compile(r"-?\d+(\.\d+)?")


@functools.lru_cache(maxsize=1)
def _champ() -> tuple[dict, ...]:
    from ..assets import package_file

    # The package's own loader parses every model conversation stored with the problems (72 MB): read the problems only.
    with open(package_file("champ_dataset", "dataset_files/v0.json"), encoding="utf-8") as f:
        problems = json.load(f)["problems"]
    # "@@" marks math spans in CHAMP's raw text; its own Problem.text / .answer drop them the same way.
    return tuple({"problem": p["_raw_text"].replace("@@", "").strip(),
                  "answer": p["_raw_answer"].replace("@@", "").strip(),
                  "id": p["identifier"], "data_source": "champ", "category": p["category"]} for p in problems.values())


def _champ_numeric() -> list[dict]:
    return [r for r in _champ() if _NUMBER.fullmatch(r["answer"])]


BUILTIN_DATASETS = {"champ": lambda: list(_champ()), "champ-numeric": _champ_numeric}


def builtin_records(name: str) -> list[dict]:
    """The records of built-in benchmark ``name`` (see the table above; fresh dicts, safe to modify)."""
    if name not in BUILTIN_DATASETS:
        raise ValueError(f"unknown built-in dataset {BUILTIN_PREFIX}{name}; available: "
                         f"{', '.join(BUILTIN_PREFIX + n for n in BUILTIN_DATASETS)}")
    return [dict(r) for r in BUILTIN_DATASETS[name]()]
