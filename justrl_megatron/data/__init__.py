"""Datasets and prompts: loaders for the math/code sets, generated tasks, built-in benchmarks, prompt templates, the
prepared format."""
from ..boxed import last_boxed_content
from .builtin import BUILTIN_DATASETS, builtin_records
from .generated import RECOMMENDED_TASKS, generate_rows
from .loaders import FORMATS, LoadResult, countdown_problem, load_rows, strip_dapo_wrapper
from .prepared import encode_answer, prepare_dataset, prepare_rows, read_parquet, write_parquet
from .prompts import (CHAT_TEMPLATES, COUNTDOWN_RAW, JUSTRL_EVAL_SUFFIX, JUSTRL_SUFFIX, RAW_TEMPLATES, build_messages,
                      render_prompt, row_messages)

__all__ = [
    "BUILTIN_DATASETS", "CHAT_TEMPLATES", "COUNTDOWN_RAW", "FORMATS", "JUSTRL_EVAL_SUFFIX", "JUSTRL_SUFFIX",
    "LoadResult", "RAW_TEMPLATES", "RECOMMENDED_TASKS", "build_messages", "builtin_records", "countdown_problem",
    "encode_answer", "generate_rows", "last_boxed_content", "load_rows", "prepare_dataset", "prepare_rows",
    "read_parquet", "render_prompt", "row_messages", "strip_dapo_wrapper", "write_parquet",
]
