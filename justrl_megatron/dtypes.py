"""The one dtype table: config / CLI names <-> torch dtypes, and how `model.dtype` resolves.

`model.dtype` "auto" means bf16 on GPU and fp32 on CPU; the trainer, the converter and the rollout engine (vLLM takes
the torch name, e.g. "bfloat16") all resolve it here, so trainer and engine run the same precision.
"""
from __future__ import annotations

import torch

from . import compat

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}
_SHORT = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


def resolve_dtype(dtype) -> torch.dtype:
    """`model.dtype`: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32 | a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if compat.cuda_available() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be auto, bf16 or fp32, got {dtype!r}")
    return DTYPES[dtype]


def dtype_name(dtype) -> str:
    """`model.dtype` resolved as the trainer resolves it, as a config name: "bf16" | "fp32" | "fp16"."""
    return _SHORT[resolve_dtype(dtype)]


def torch_name(dtype) -> str:
    """The torch spelling of a dtype or dtype name ("bf16" -> "bfloat16"), as HF configs and vLLM write it."""
    return str(dtype if isinstance(dtype, torch.dtype) else DTYPES[dtype]).removeprefix("torch.")
