"""Dataset loaders: local parquet / jsonl / json files, a hub name through `datasets`, or a built-in offline benchmark
(``builtin:champ``, data/builtin.py) → uniform rows.

Every loader yields rows ``{"problem": str, "answer": str | dict, "data_source": str, "id": str}``; a row whose source
prompt text differs from its ``problem`` (DAPO's wrapper stripped, surrounding whitespace) also keeps that text exactly
as ``source_prompt`` (the ``justrl`` template trains on it, as JustRL did).

========== ===================================================================================================
fmt        source columns → row
========== ===================================================================================================
dapo       ``prompt`` (chat list or str; the "Solve … Answer:" wrapper is stripped), ``reward_model.ground_truth``
gsm8k      ``question``, ``answer`` (the text after ``####``, commas removed)
math       ``problem``/``prompt``, ``answer``/``reward_model`` if present (MATH-500) else the last ``\\boxed{}`` of
           ``solution`` (MATH)
aime       ``problem``/``question``/``prompt``, ``answer``/``reward_model`` (integers written without leading zeros)
countdown  ``nums``/``numbers``, ``target`` → answer ``{"numbers": [...], "target": int}``
mbpp       ``text``/``prompt``, ``test_list``, ``test_setup_code`` → answer ``{"tests": [...], "setup": str}``
generic    ``problem``/``question``/``prompt``, ``answer``/``ground_truth``/``reward_model``/``solution``
prepared   our own prepared parquet (prepared.py): rows also keep ``prompt``, the messages as written there
========== ===================================================================================================

A ground truth stored as one ``\\boxed{X}`` (JustRL's AIME24 parquet) becomes ``X``; a chat-list ``prompt`` column
(verl's layout, JustRL's eval parquets) gives the problem as its last user turn. The summary line names the columns
used.

Malformed rows (missing answer or one written as "None" / "nan", empty problem, non-UTF-8 text, wrong types, bad
JSON lines) are skipped and counted by reason; a source with a missing column or with zero usable rows is an error
naming the file and the column.
Exact duplicates (same problem and answer) are dropped when ``dedup`` is on: DAPO-Math-17k on the hub repeats each of
its ~17k prompts ~100 times, and the summary reports that factor.
"""
from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..boxed import is_null_answer, last_boxed_content
from .builtin import BUILTIN_PREFIX, builtin_records

FORMATS = ("dapo", "gsm8k", "math", "aime", "countdown", "mbpp", "generic", "prepared")
_SUFFIXES = (".parquet", ".jsonl", ".json")


class _Skip(Exception):
    """A malformed row; the message is the reason it is counted under."""


@dataclass
class LoadResult:
    """Rows of one source plus what was dropped on the way. ``skipped`` counts malformed rows by reason."""

    rows: list[dict]
    skipped: Counter = field(default_factory=Counter)
    source: str = ""
    fmt: str = ""
    read: int = 0  # records seen in the source
    duplicates: int = 0  # exact duplicates dropped (dedup=True)
    columns: dict = field(default_factory=dict)  # what each field was read from: {"problem": "prompt", ...}
    unboxed: int = 0  # ground truths stored as "\\boxed{X}", unwrapped to X

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def summary(self) -> str:
        parts = [f"{self.source} (fmt={self.fmt}): {len(self.rows):,} rows from {self.read:,} records"]
        if self.duplicates:
            factor = (len(self.rows) + self.duplicates) / max(len(self.rows), 1)
            parts.append(f"dropped {self.duplicates:,} duplicates (x{factor:.1f} duplication)")
        n_skipped = sum(self.skipped.values())
        if n_skipped:
            reasons = ", ".join(f"{k}={v:,}" for k, v in sorted(self.skipped.items()))
            parts.append(f"skipped {n_skipped:,} malformed ({reasons})")
        if self.columns:
            parts.append("columns " + ", ".join(f"{k}<-{v}" for k, v in self.columns.items()))
        if self.unboxed:
            parts.append(f"{self.unboxed:,} \\boxed{{}} answers unwrapped")
        return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------------- readers
class _Source:
    """Iterates the records (dicts) of a local file, a directory of files, or a hub dataset; tracks column names."""

    def __init__(self, path_or_name: str, split: str):
        self.label = path_or_name
        self.split = split
        self.columns: set[str] = set()
        self.records = None  # a built-in benchmark's records
        if path_or_name.startswith(BUILTIN_PREFIX):
            self.files, self.records = [], builtin_records(path_or_name[len(BUILTIN_PREFIX):])
        elif os.path.isdir(path_or_name):
            self.files = _data_files(path_or_name, split)
            if not self.files:
                raise FileNotFoundError(f"{path_or_name}: no .parquet/.jsonl/.json files in this directory")
        elif os.path.exists(path_or_name):
            if not path_or_name.endswith(_SUFFIXES):
                raise ValueError(f"{path_or_name}: unsupported file type (expected {' / '.join(_SUFFIXES)})")
            self.files = [path_or_name]
        elif _looks_like_path(path_or_name):
            raise FileNotFoundError(f"{path_or_name}: no such file or directory")
        else:
            self.files = None  # a hub name
        # parquet and hub sources know their columns before the first row, so a missing column fails fast
        self.schema_known = self.files is None or all(p.endswith(".parquet") for p in self.files)

    def __iter__(self) -> Iterator[Any]:
        if self.records is not None:
            self.columns.update(self.records[0])
            yield from self.records
            return
        if self.files is None:
            yield from self._hub()
            return
        for path in self.files:
            if path.endswith(".parquet"):
                yield from self._parquet(path)
            elif path.endswith(".jsonl"):
                yield from self._jsonl(path)
            else:
                yield from self._json(path)

    def _parquet(self, path):
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - any arrow error means an unreadable file
            raise ValueError(f"{path}: not a readable parquet file ({e})") from e
        self.columns.update(pf.schema_arrow.names)
        for batch in pf.iter_batches(batch_size=4096):
            yield from batch.to_pylist()

    def _jsonl(self, path):
        with open(path, "rb") as f:
            for raw in f:
                if not raw.strip():
                    continue
                # surrogateescape keeps bad bytes as lone surrogates, which the row checks then reject as non_utf8;
                # one bad line must not cost the whole file.
                text = raw.decode("utf-8", errors="surrogateescape")
                try:
                    rec = json.loads(text)
                except json.JSONDecodeError:
                    yield _Skip("bad_json")
                    continue
                if isinstance(rec, dict):
                    self.columns.update(rec)
                yield rec

    def _json(self, path):
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="surrogateescape")
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            # A ".json" file is often JSON lines in disguise.
            yield from self._jsonl(path)
            return
        if isinstance(data, dict):
            lists = [v for v in data.values() if isinstance(v, list)]
            if "data" in data and isinstance(data["data"], list):
                data = data["data"]
            elif len(lists) == 1:
                data = lists[0]
            else:
                raise ValueError(f"{path}: expected a JSON list of records (or {{'data': [...]}})")
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        for rec in data:
            if isinstance(rec, dict):
                self.columns.update(rec)
            yield rec

    def _hub(self):
        try:
            import datasets
        except ImportError as e:  # pragma: no cover - datasets is a hard dependency
            raise FileNotFoundError(f"{self.label}: not a local path and `datasets` is not installed") from e
        name, _, config = self.label.partition(":")
        try:
            ds = datasets.load_dataset(name, config or None, split=self.split)
        except Exception as e:  # noqa: BLE001 - offline, unknown name, bad split: all mean "cannot load"
            raise FileNotFoundError(f"{self.label}: not a local path, and loading it from the hub failed ({e})") from e
        self.columns.update(ds.column_names)
        yield from ds


def _looks_like_path(name: str) -> bool:
    """Hub names are "name" or "owner/name" (optionally ":config"); anything else that does not exist is a path."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or name.endswith(_SUFFIXES)


def _data_files(directory: str, split: str) -> list[str]:
    files = sorted(p for ext in ("parquet", "jsonl", "json")
                   for p in glob.glob(os.path.join(directory, "**", f"*.{ext}"), recursive=True))
    # Hub snapshots hold every split (data/train-*.parquet, data/test-*.parquet): keep the requested one if named.
    named = [p for p in files if re.search(rf"(^|[/_.-]){re.escape(split)}([/_.-]|$)", os.path.relpath(p, directory))]
    return named or files


# ----------------------------------------------------------------------------------------------------- field checks
def _get(rec: dict, names: tuple[str, ...]):
    for n in names:
        if n in rec and rec[n] is not None:
            return rec[n]
    return None


def _text(value, what: str, strip: bool = True) -> str:
    """A non-empty, valid UTF-8 string (surrounding whitespace stripped unless ``strip=False``), or _Skip with the
    reason."""
    if value is None:
        raise _Skip(f"missing_{what}")
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise _Skip("non_utf8") from None
    if not isinstance(value, str):
        raise _Skip(f"bad_type_{what}")
    try:
        value.encode("utf-8")  # lone surrogates = undecodable bytes from the reader
    except UnicodeEncodeError:
        raise _Skip("non_utf8") from None
    stripped = value.strip()
    if not stripped:
        raise _Skip(f"empty_{what}")
    return stripped if strip else value


def _scalar_answer(value) -> str:
    """Answers may be stored as numbers (AIME as int): integral values are written without a fractional part."""
    if isinstance(value, bool):
        raise _Skip("bad_type_answer")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise _Skip("bad_type_answer")
        return str(int(value)) if value.is_integer() else repr(value)
    text = _text(value, "answer")
    if is_null_answer(text):  # "None" / "nan" written out by str() or a dataframe: no ground truth
        raise _Skip("null_answer")
    return text


_MAX_ANSWER_DEPTH = 32  # a structured ground truth nested deeper than this is not one a verifier reads


def _check_structured(value, depth: int = 0) -> None:
    """A dict / list ground truth must be non-empty and hold a value at every depth: a null (None, NaN, inf) leaf
    anywhere ({"foo": null}, [null, {...}]) makes it one no verifier can match. Strings are kept as they are (an
    empty setup string or an expected "None" can be a code test's real value)."""
    if depth > _MAX_ANSWER_DEPTH:
        raise _Skip("bad_type_answer")
    if isinstance(value, (dict, list, tuple)):
        if not value and depth == 0:
            raise _Skip("empty_answer")
        for item in value.values() if isinstance(value, dict) else value:
            _check_structured(item, depth + 1)
    elif value is None or (isinstance(value, float) and not math.isfinite(value)):
        raise _Skip("null_answer")


def _ground_truth(rec: dict, names: tuple[str, ...]):
    """The first present answer column; verl's ``reward_model`` column holds it under ``ground_truth``."""
    value = _get(rec, names)
    if isinstance(value, dict) and "ground_truth" in value:
        return value["ground_truth"]
    return value


def _unbox(answer: str) -> str:
    """``\\boxed{X}`` -> ``X`` when the whole answer is one box (JustRL's AIME24 ground truths); others unchanged."""
    if answer.startswith("\\boxed{") and answer.endswith("}") and last_boxed_content(answer) == answer[7:-1]:
        return answer[7:-1].strip()
    return answer


def _source_prompt(raw, problem: str) -> dict:
    """The source's prompt text, exactly as stored, where it differs from the parsed problem."""
    exact = _text(raw, "problem", strip=False)
    return {} if exact == problem else {"source_prompt": exact}


def _user_content(prompt) -> Any:
    """The problem text inside a chat-format prompt (the last user turn), or the prompt itself if it is a string."""
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise _Skip("bad_type_problem")
        return users[-1].get("content")
    return prompt


# ------------------------------------------------------------------------------------------------------ row parsers
# Each parser maps one source record to (problem, answer, id or None[, extra row fields: the source prompt text, or a
# prepared row's messages]); the column tuples name accepted aliases.
_DAPO_HEAD = "Solve the following math problem step by step."
_DAPO_HEAD_END = "where $Answer is the answer to the problem."
_DAPO_TAIL = 'Remember to put your answer on its own line after "Answer:".'


def strip_dapo_wrapper(prompt: str) -> str:
    """The bare problem of a DAPO-Math-17k prompt ("Solve the following … Answer: $Answer …\\n\\n{problem}\\n\\n
    Remember to put your answer on its own line after "Answer:"."); other text is returned stripped.

    Plain string operations: this runs 1.8M times on the hub's copy, where a regex with a leading ``\\s*`` was the
    loader's main cost."""
    text = prompt.strip()
    if text.startswith(_DAPO_HEAD):
        cut = text.find(_DAPO_HEAD_END)
        if cut >= 0:
            text = text[cut + len(_DAPO_HEAD_END):].lstrip()
    if text.endswith(_DAPO_TAIL):
        text = text[:-len(_DAPO_TAIL)].rstrip()
    return text


def _parse_dapo(rec):
    raw = _user_content(_get(rec, ("prompt", "problem", "question")))
    problem = strip_dapo_wrapper(_text(raw, "problem"))
    if not problem:
        raise _Skip("empty_problem")
    rm = rec.get("reward_model")
    answer = rm.get("ground_truth") if isinstance(rm, dict) else _get(rec, ("answer", "solution", "ground_truth"))
    extra = rec.get("extra_info")
    rid = extra.get("index") if isinstance(extra, dict) else None
    return problem, _scalar_answer(answer), rid, _source_prompt(raw, problem)


_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.S)
_NUMBER = re.compile(r"^-?[\d,]*\.?\d+$")


def _parse_gsm8k(rec):
    problem = _text(_get(rec, ("question", "problem")), "problem")
    solution = _scalar_answer(_get(rec, ("answer",)))
    m = _GSM8K_FINAL.search(solution)
    final = m.group(1) if m else solution
    final = final.replace(",", "").strip()
    if not _NUMBER.match(final):
        raise _Skip("no_final_answer")
    return problem, final, None


_MATH_PROBLEM = ("problem", "question", "prompt")


def _parse_math(rec):
    problem = _text(_user_content(_get(rec, _MATH_PROBLEM)), "problem")
    answer = _ground_truth(rec, ("answer", "reward_model"))
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        solution = _text(_get(rec, ("solution",)), "answer")
        answer = last_boxed_content(solution)
        if answer is None or not answer.strip():
            raise _Skip("no_boxed_answer")
    return problem, _scalar_answer(answer), _get(rec, ("unique_id", "id"))


_AIME_PROBLEM = ("problem", "question", "Problem", "Question", "prompt")
_AIME_ANSWER = ("answer", "Answer", "reward_model")


def _parse_aime(rec):
    problem = _text(_user_content(_get(rec, _AIME_PROBLEM)), "problem")
    answer = _scalar_answer(_ground_truth(rec, _AIME_ANSWER))
    return problem, answer, _get(rec, ("id", "ID", "unique_id"))


def _aime_answer(answer: str) -> str:
    return str(int(answer)) if answer.isdigit() else answer  # "033" and 33 are the same AIME answer


def countdown_problem(numbers: list[int], target: int) -> str:
    """The TinyZero countdown question (the COUNTDOWN_RAW template adds the format instructions)."""
    return (f"Using the numbers {list(numbers)}, create an equation that equals {target}. You can use basic arithmetic "
            f"operations (+, -, *, /) and each number can only be used once.")


def _as_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float)
                                                                          and not value.is_integer()):
        raise _Skip(f"bad_type_{what}")
    return int(value)


def _parse_countdown(rec):
    nums, target = _get(rec, ("nums", "numbers")), _get(rec, ("target",))
    if nums is None:
        raise _Skip("missing_numbers")
    if target is None:
        raise _Skip("missing_answer")
    if not isinstance(nums, (list, tuple)) or not nums:
        raise _Skip("bad_type_numbers")
    numbers = [_as_int(n, "numbers") for n in nums]
    target = _as_int(target, "answer")
    return countdown_problem(numbers, target), {"numbers": numbers, "target": target}, None


def mbpp_problem(text: str, tests: list[str]) -> str:
    return (f"{text}\nYour code should pass these tests:\n\n" + "\n".join(tests)
            + "\n\nWrite the complete Python function in a ```python code block.")


def _parse_mbpp(rec):
    text = _text(_get(rec, ("text", "prompt", "problem")), "problem")
    tests = rec.get("test_list")
    if tests is None:
        raise _Skip("missing_answer")
    if not isinstance(tests, (list, tuple)) or not tests:
        raise _Skip("bad_type_tests")
    tests = [_text(t, "tests") for t in tests]
    setup = rec.get("test_setup_code") or ""
    if not isinstance(setup, str):
        raise _Skip("bad_type_setup")
    return mbpp_problem(text, tests), {"tests": tests, "setup": setup}, _get(rec, ("task_id", "id"))


_GENERIC_ANSWER = ("answer", "ground_truth", "reward_model", "solution", "target", "output")


_GENERIC_PROBLEM = ("problem", "question", "prompt", "text", "input")


def _parse_generic(rec):
    raw = _user_content(_get(rec, _GENERIC_PROBLEM))
    problem = _text(raw, "problem")
    answer = _ground_truth(rec, _GENERIC_ANSWER)
    if not isinstance(answer, (dict, list)):
        answer = _scalar_answer(answer)
    else:
        _check_structured(answer)
    return problem, answer, _get(rec, ("id", "unique_id", "task_id")), _source_prompt(raw, problem)


def _parse_prepared(rec):
    prompt = rec.get("prompt")
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        raise _Skip("bad_type_prompt")
    for m in prompt:
        _text(m["content"], "problem")  # UTF-8 and non-empty
    users = [m["content"] for m in prompt if m["role"] in ("user", "raw")]
    if not users:
        raise _Skip("bad_type_prompt")
    answer = _scalar_answer(rec.get("answer"))
    return users[-1], answer, rec.get("id"), {"prompt": [{"role": m["role"], "content": m["content"]} for m in prompt]}


@dataclass(frozen=True)
class _Format:
    parse: Callable[[dict], tuple]
    columns: tuple[tuple[str, ...], ...]  # each tuple: aliases of one required column
    data_source: str
    fields: tuple[str, ...] = ("problem", "answer")  # what each required column holds (for the summary)
    normalize: Callable[[str], str] | None = None  # applied to string answers after \\boxed{} unwrapping


_FORMATS = {
    "dapo": _Format(_parse_dapo, (("prompt", "problem", "question"), ("reward_model", "answer", "solution",
                                                                     "ground_truth")), "math_dapo"),
    "gsm8k": _Format(_parse_gsm8k, (("question", "problem"), ("answer",)), "openai/gsm8k"),
    "math": _Format(_parse_math, (_MATH_PROBLEM, ("answer", "reward_model", "solution")), "math"),
    "aime": _Format(_parse_aime, (_AIME_PROBLEM, _AIME_ANSWER), "aime", normalize=_aime_answer),
    "countdown": _Format(_parse_countdown, (("nums", "numbers"), ("target",)), "countdown", ("numbers", "answer")),
    "mbpp": _Format(_parse_mbpp, (("text", "prompt", "problem"), ("test_list",)), "mbpp", ("problem", "tests")),
    "generic": _Format(_parse_generic, (_GENERIC_PROBLEM, _GENERIC_ANSWER), "generic"),
    "prepared": _Format(_parse_prepared, (("prompt",), ("answer",), ("data_source",), ("id",)), "prepared",
                        ("prompt", "answer", "data_source", "id")),
}


def _check_columns(source: _Source, fmt: _Format):
    for aliases in fmt.columns:
        if not source.columns.intersection(aliases):
            names = " / ".join(repr(a) for a in aliases)
            raise ValueError(f"{source.label}: missing column {names} (columns present: {sorted(source.columns)})")


def _columns_used(source: _Source, fmt: _Format) -> dict:
    """Which column each field came from: the first alias the source has (the parsers try them in that order)."""
    used = {}
    for name, aliases in zip(fmt.fields, fmt.columns):
        column = next((a for a in aliases if a in source.columns), None)
        if column is not None:
            used[name] = "reward_model.ground_truth" if column == "reward_model" else column
    return used


def _dedup_key(problem: str, answer) -> str:
    a = answer if isinstance(answer, str) else json.dumps(answer, sort_keys=True)
    return hashlib.blake2b(f"{problem}\0{a}".encode("utf-8"), digest_size=16).hexdigest()


def load_rows(path_or_name: str, fmt: str, *, split: str = "train", dedup: bool = True, limit: int | None = None,
              data_source: str | None = None, verbose: bool = True) -> LoadResult:
    """Load ``path_or_name`` (file, directory, or hub name ``"owner/name[:config]"``) as ``fmt`` rows.

    Rows of ``fmt="prepared"`` carry their ready ``prompt`` messages too (the problem is then the templated user turn).
    ``"builtin:<name>"`` reads a built-in offline benchmark (data/builtin.py).

    With ``dedup=False`` duplicates stay but share their strings with the first copy (DAPO-Math-17k's 1.79M rows then
    cost what its 17k distinct prompts do). ``data_source`` overrides the one in the data; ``limit`` stops after that
    many usable rows. The summary line goes to stderr unless ``verbose=False``.
    """
    if fmt not in _FORMATS:
        raise ValueError(f"unknown dataset format {fmt!r}; known: {FORMATS}")
    spec = _FORMATS[fmt]
    source = _Source(path_or_name, split)
    result = LoadResult(rows=[], source=path_or_name, fmt=fmt)
    first: dict[str, dict] = {}  # dedup key -> the first row with it
    checked = not source.schema_known
    for index, rec in enumerate(source):
        if not checked:
            _check_columns(source, spec)
            checked = True
        result.read += 1
        try:
            if isinstance(rec, _Skip):
                raise rec
            if not isinstance(rec, dict):
                raise _Skip("not_an_object")
            problem, answer, rid, *extra = spec.parse(rec)
        except _Skip as e:
            result.skipped[str(e)] += 1
            continue
        if isinstance(answer, str):
            unboxed = _unbox(answer)
            result.unboxed += unboxed != answer
            answer = spec.normalize(unboxed) if spec.normalize else unboxed
        key = _dedup_key(problem, answer)
        earlier = first.get(key)
        if earlier is not None:
            if dedup:
                result.duplicates += 1
                continue
            problem, answer = earlier["problem"], earlier["answer"]
        src = data_source or (rec.get("data_source") if isinstance(rec.get("data_source"), str) else None) \
            or spec.data_source
        row = {"problem": problem, "answer": answer, "data_source": src,
               "id": str(rid) if rid is not None and str(rid) else f"{src}-{index}"}
        if extra:  # the source prompt text, or fmt="prepared"'s messages (the template must not run again on those)
            # a duplicate shares the first copy's objects where they are equal; its own text where not
            row.update({k: earlier[k] if earlier is not None and earlier.get(k) == v else v
                        for k, v in extra[0].items()})
        if earlier is None:
            first[key] = row
        result.rows.append(row)
        if limit is not None and len(result.rows) >= limit:
            break
    if result.read == 0:
        raise ValueError(f"{path_or_name}: no records (empty source)")
    _check_columns(source, spec)
    result.columns = _columns_used(source, spec)
    if not result.rows:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(result.skipped.items())) or "the source is empty"
        raise ValueError(f"{path_or_name}: no usable rows for fmt={fmt!r} ({result.read} records; {reasons})")
    if verbose:
        print(f"[data] {result.summary()}", file=sys.stderr)
    return result
