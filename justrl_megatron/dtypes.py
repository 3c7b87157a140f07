"""The one dtype table: config / CLI names <-> torch dtypes, and how `model.dtype` resolves.

`model.dtype` "auto" means bf16 on GPU, bf16 on a CPU that multiplies bf16 natively (AVX512-BF16 or AMX: torch's bf16
matmul runs ~2.4x its fp32 rate there) and fp32 on other CPUs (AVX2-only ones emulate bf16, slower than fp32). bf16
means bf16 weights with fp32 master weights and optimizer state (model/policy.py). The trainer, the converter and the
rollout engine (vLLM takes the torch name, e.g. "bfloat16") all resolve it here, so trainer and engine run the same
precision. JUSTRL_CPU_BF16=0 / 1 overrides the CPU detection (the test suite pins 0: its tolerances are fp32's).
"""
from __future__ import annotations

import functools
import os

import torch

from . import compat

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}
_SHORT = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


def resolve_dtype(dtype) -> torch.dtype:
    """`model.dtype`: auto (bf16 on GPU and on CPUs with native bf16, else fp32) | bf16 | fp32 | a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if compat.cuda_available() or cpu_has_native_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be auto, bf16 or fp32, got {dtype!r}")
    return DTYPES[dtype]


CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 dot products


@functools.lru_cache(maxsize=None)
def _cpuinfo_flags() -> frozenset:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 dot products natively (what `model.dtype=auto` turns into bf16 on a CPU)."""
    forced = os.environ.get("JUSTRL_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    return any(flag in _cpuinfo_flags() for flag in CPU_BF16_FLAGS)


def dtype_name(dtype) -> str:
    """`model.dtype` resolved as the trainer resolves it, as a config name: "bf16" | "fp32" | "fp16"."""
    return _SHORT[resolve_dtype(dtype)]


def torch_name(dtype) -> str:
    """The torch spelling of a dtype or dtype name ("bf16" -> "bfloat16"), as HF configs and vLLM write it."""
    return str(dtype if isinstance(dtype, torch.dtype) else DTYPES[dtype]).removeprefix("torch.")
