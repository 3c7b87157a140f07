"""The GPU fast paths of the local (non-TransformerEngine) spec, each of which can be switched off for an A/B run.

Every switch computes what the default path computes (each has a CPU test stating its tolerance) and acts on CUDA
only, so the CPU path and the demo figures never change. All are on by default; `JUSTRL_FAST_PATHS_OFF` (a comma
list of names, or `all`) turns some off in this process, which is how gpu_check's `mfu` stage measures each one
against the baseline on the same card.

  rope_once          RoPE of packed rows from per-token rotation rows made once per micro-batch (megatron's packed
                     RoPE reads the sequence boundaries on the host in every layer: `.tolist()` / `.item()`)
  foreach_grad_norm  the grad norm and clip as foreach ops (megatron's no-apex fallback builds a tensor from one
                     CUDA scalar per parameter tensor: one host sync each)
  fused_adamw        torch's fused AdamW kernel instead of its foreach implementation (apex/TE absent)
  compiled_head      the log-prob head's per-chunk fp32 math (log-softmax, gather, entropy) as one compiled kernel

Attention has a config key of its own (`model.attention_backend`, attention.py), not a switch here.
"""

from __future__ import annotations

import os

SWITCHES = ("rope_once", "foreach_grad_norm", "fused_adamw", "compiled_head")
ENV = "JUSTRL_FAST_PATHS_OFF"


def disabled() -> set[str]:
    """The switches this process has turned off (read on every call: an A/B run changes it between builds)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return set()
    names = {n.strip() for n in raw.split(",") if n.strip()}
    if "all" in names:
        return set(SWITCHES)
    unknown = names - set(SWITCHES)
    if unknown:
        raise ValueError(f"{ENV}: unknown fast path(s) {sorted(unknown)}; known: {', '.join(SWITCHES)}, all")
    return names


def enabled(name: str) -> bool:
    if name not in SWITCHES:
        raise KeyError(f"unknown fast path {name!r}; known: {', '.join(SWITCHES)}")
    return name not in disabled()
