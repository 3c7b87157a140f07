"""The GPU fast paths of the local (non-TransformerEngine) spec: what each switch is, how a run decides them once,
and what it records.

Every switch computes what the default path computes (each has a CPU test stating its tolerance) and acts on CUDA
only, so the CPU path and the demo figures never change. They are config keys, `model.fast_paths.<name>` (all on by
default); `JUSTRL_FAST_PATHS_OFF` (a comma list of names, or `all`) overrides them in one launch, which is how
gpu_check's `mfu` stage measures each one against the baseline on the same card. A typo in it is refused by the
config pre-flight (`problems`), in one line, before any model is built.

  rope_once          RoPE of packed rows from per-token rotation rows made once per micro-batch (megatron's packed
                     RoPE reads the sequence boundaries on the host in every layer: `.tolist()` / `.item()`)
  foreach_grad_norm  the grad norm and clip as foreach ops (megatron's no-apex fallback builds a tensor from one
                     CUDA scalar per parameter tensor: one host sync each)
  fused_adamw        torch's fused AdamW kernel instead of its foreach implementation (apex/TE absent)
  compiled_head      the log-prob head's per-chunk fp32 math (log-softmax, gather, entropy) as one compiled kernel

Decided once: `Policy.build` turns the config's switches, the override and `model.attention_backend` into one
`FastPaths` (`resolve`). `attention_backend=auto` is measured on rank 0 only and broadcast, so every rank attends
with the same kernel (their bf16 gradients differ by up to 3e-2); the resolved backend reaches the attention modules
through their layer spec (`spec.block_spec`: the core attention's `ModuleSpec.params`), the switches reach the step
through the Policy. `FastPaths.record()` is what the run writes beside its config_history entry
(run_config.record_resolved), so a resume that resolves otherwise says so.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

SWITCHES = ("rope_once", "foreach_grad_norm", "fused_adamw", "compiled_head")
ATTENTION_BACKENDS = ("auto", "flash", "cudnn")  # model.attention_backend; resolved: flash | cudnn
ENV = "JUSTRL_FAST_PATHS_OFF"


def parse_off(raw: str | None) -> set[str]:
    """The switches an override names (`all`: every one). Raises ValueError naming an unknown one."""
    names = {n.strip() for n in (raw or "").split(",") if n.strip()}
    if "all" in names:
        return set(SWITCHES)
    unknown = names - set(SWITCHES)
    if unknown:
        raise ValueError(f"{ENV}={raw!r}: unknown fast path(s) {sorted(unknown)}; known: {', '.join(SWITCHES)}, all")
    return names


def env_override() -> str:
    return os.environ.get(ENV, "").strip()


@dataclasses.dataclass(frozen=True)
class FastPaths:
    """The fast paths one launch runs with, identical on every rank."""

    rope_once: bool = True
    foreach_grad_norm: bool = True
    fused_adamw: bool = True
    compiled_head: bool = True
    attention_backend: str = "flash"  # resolved: flash | cudnn
    override: str = ""  # the JUSTRL_FAST_PATHS_OFF this launch saw ("" when unset)

    def enabled(self, name: str) -> bool:
        if name not in SWITCHES:
            raise KeyError(f"unknown fast path {name!r}; known: {', '.join(SWITCHES)}")
        return getattr(self, name)

    def record(self) -> dict:
        """The resolved choices as dotted config keys (run_config.record_resolved)."""
        return {"model.attention_backend": self.attention_backend,
                **{f"model.fast_paths.{n}": getattr(self, n) for n in SWITCHES}, f"env.{ENV}": self.override}


def switches(settings=None, override: str | None = None) -> dict[str, bool]:
    """{switch: on} from `settings` (the `model.fast_paths` section, a dict or object; None: all on) with the
    override (None: this process' JUSTRL_FAST_PATHS_OFF) turning some off."""
    off = parse_off(env_override() if override is None else override)
    get = settings.get if isinstance(settings, dict) else (lambda n, d: getattr(settings, n, d))
    return {n: bool(get(n, True) if settings is not None else True) and n not in off for n in SWITCHES}


def broadcast_choice(decide: Callable[[], str]) -> str:
    """`decide()` on trainer rank 0, its answer on every trainer rank (distributed.trainer_broadcast); without a
    process group, the local answer."""
    import torch.distributed as dist

    from ..distributed import trainer_broadcast

    if not dist.is_available() or not dist.is_initialized():
        return decide()
    return trainer_broadcast(decide() if dist.get_rank() == 0 else None)


def resolve(settings=None, *, attention_backend: str = "auto", decide_attention: Callable[[str], str] | None = None,
            override: str | None = None) -> FastPaths:
    """This launch's FastPaths: the switches (`switches`) and the attention backend, `auto` decided by
    `decide_attention(choice)` on rank 0 and broadcast (None: flash, the CPU's answer)."""
    override = env_override() if override is None else override
    decide = (lambda: decide_attention(attention_backend)) if decide_attention else (lambda: "flash")
    backend = broadcast_choice(decide) if attention_backend == "auto" else decide()
    return FastPaths(**switches(settings, override), attention_backend=backend, override=override)


def problems(cfg, shape=None) -> list[str]:
    """The fast-path settings' refusals (config pre-flight): an unknown name in JUSTRL_FAST_PATHS_OFF, an unknown key
    under model.fast_paths is the schema's."""
    try:
        parse_off(env_override())
    except ValueError as exc:
        return [str(exc)]
    return []
