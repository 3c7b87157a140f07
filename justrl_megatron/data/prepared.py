"""The prepared training format: one parquet file, one row per prompt.

Columns: ``prompt`` (list of ``{"role", "content"}`` messages; a raw-template prompt is the single message
``{"role": "raw", ...}``), ``answer`` (string; structured answers such as countdown's numbers+target or MBPP's tests
are JSON-encoded — the verifiers that need them decode it), ``data_source``, ``id``.
"""
from __future__ import annotations

import json
import os

from .prompts import as_message_list, row_messages



def _schema():
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema([("prompt", pa.list_(message)), ("answer", pa.string()), ("data_source", pa.string()),
                      ("id", pa.string())])


def encode_answer(answer) -> str:
    """Strings stay as they are (a MATH answer like "[1,2]" must not turn into a list); the rest becomes JSON."""
    return answer if isinstance(answer, str) else json.dumps(answer, sort_keys=True)


def prepare_rows(rows, template: str = "justrl", system: str | None = None) -> list[dict]:
    """Rows in the prepared format: a row with a ``prompt`` keeps it, else it goes through the template
    (:func:`~.prompts.row_messages`: ``justrl`` keeps a DAPO row's full source prompt)."""
    out = []
    for r in rows:
        prompt = row_messages(r, template, system)
        out.append({"prompt": as_message_list(prompt), "answer": encode_answer(r["answer"]),
                    "data_source": str(r["data_source"]), "id": str(r["id"])})
    return out


def write_parquet(rows, path: str, *, template: str = "justrl", system: str | None = None) -> int:
    """Write ``rows`` (loader rows or already-prepared rows) to ``path``; returns the row count.

    The file appears atomically (written next to it, then renamed), so a crash never leaves half a dataset.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    prepared = prepare_rows(rows, template, system)
    if not prepared:
        raise ValueError(f"{path}: refusing to write an empty dataset")
    table = pa.Table.from_pylist(prepared, schema=_schema())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return len(prepared)


def read_parquet(path: str) -> list[dict]:
    """Rows of a prepared parquet file (prompt as a list of message dicts, answer as the stored string)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    missing = [c for c in ("prompt", "answer", "data_source", "id") if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: not a prepared dataset, missing column(s) {missing}")
    return table.select(["prompt", "answer", "data_source", "id"]).to_pylist()


def prepare_dataset(output: str, *, path: str | None = None, fmt: str = "generic", task: str | None = None,
                    n: int = 1000, seed: int = 0, task_options: dict | None = None, template: str = "justrl",
                    system: str | None = None, split: str = "train", dedup: bool = True, limit: int | None = None,
                    data_source: str | None = None) -> int:
    """The data stage: load ``path`` as ``fmt`` (or generate ``n`` rows of reasoning-gym ``task``), apply the prompt
    template, write the prepared parquet to ``output``; returns the number of rows written."""
    from .generated import generate_rows
    from .loaders import load_rows

    if (path is None) == (task is None):
        raise ValueError("give exactly one of path (a dataset to load) or task (a generated task)")
    if path is not None:
        rows = load_rows(path, fmt, split=split, dedup=dedup, limit=limit, data_source=data_source).rows
    else:
        rows = generate_rows(task, n, seed, **(task_options or {}))
        if data_source:
            rows = [{**r, "data_source": data_source} for r in rows]
    return write_parquet(rows, output, template=template, system=system)
