"""What a training checkpoint holds besides the folder: the model and optimizer sharded state dict, RNG states and
the parallel layout it was saved at, and what a resume at another layout may change.

Sharded optimizer state: the distributed optimizer's state is saved in megatron's `dp_reshardable` format: each rank
writes its own buckets (no gather onto DP rank 0, no communication, no copy beyond megatron's per-bucket views).
Plain optimizers keep their per-parameter format. Each checkpoint records its format (content metadata).

What a resume may change (run_config.py refuses the rest before any heavy work):
  * the data-parallel size: weights, optimizer state (both formats) and LR schedule reshard; RNG states are per rank,
    restored only at the same layout (a resharded run gets a warning);
  * TP / PP / VPP / EP / CP: model weights and plain-optimizer state reshard; the distributed optimizer's dp_reshardable
    state does not: refused in one line (`layout_refusal`) naming the way out (resume at the saved layout, or export
    the weights with `justrl-convert mcore-to-hf` and start afresh). Checkpoints from before dp_reshardable (the
    optimizer gathered, `fully_reshardable`) still load, at any layout.

megatron-core 0.16's DistributedOptimizer without apex / TE (the CPU build) needs three workarounds, kept here.
"""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections before megatron loads)

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from .. import compat
from .weights import model_sharded_state_dict


# The optimizer state's format; the same metadata must be used to save and to load, so a checkpoint records its own
# (megatron's content metadata; checkpoints without one used OPTIM_METADATA).
# Plain optimizers: per-parameter state, reshardable at any layout (the "fully_reshardable" name only keeps
# megatron's ChainedOptimizer from prefixing its keys: the format of every plain-optimizer checkpoint so far).
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


# The distributed optimizer: each rank writes its own buckets' state as it lies in memory (no gather onto DP rank 0,
# no communication, no extra copy), which reloads at another DP size but not at another TP / PP / EP / CP
# (`layout_refusal`). Checkpoints written before this format (OPTIM_METADATA: gathered, reshardable anywhere) load.
DISTOPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}


def _layout() -> dict:
    layout = {"world": dist.get_world_size() if dist.is_initialized() else 1,
              "tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
              "vpp": getattr(ps, "get_virtual_pipeline_model_parallel_world_size", lambda: None)()}
    ep, cp = ps.get_expert_model_parallel_world_size(), ps.get_context_parallel_world_size()
    # EP1 / CP1 as before: older checkpoints keep matching
    return {**layout, **({"ep": ep} if ep != 1 else {}), **({"cp": cp} if cp != 1 else {})}


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if compat.cuda_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and compat.cuda_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _prime_empty_adam_state(optimizer) -> None:
    """Give a never-stepped torch Adam its state tensors (step 0, zero moments) before loading into it.

    Without apex / TE (the CPU build), megatron's DistributedOptimizer reads the common `step` out of the torch
    optimizer's per-parameter state when it builds its (loading) state dict, and a fresh Adam has none yet. The values
    are placeholders: the checkpoint overwrites them.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or len(inner.state) > 0:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p.data),
                                  "exp_avg_sq": torch.zeros_like(p.data)}


def _distopt_subs_without_apex(optimizer) -> list:
    """The DistributedOptimizers of `optimizer` that run megatron-core's torch-Adam fallback (no apex / TE: the CPU
    build), whose per-parameter "step" the two workarounds below handle; none where megatron is missing."""
    try:
        from megatron.core.optimizer import distrib_optimizer as dopt
    except ImportError:
        return []
    return [s for s in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(s, dopt.DistributedOptimizer) and not getattr(dopt, "HAVE_APEX_OR_TE", True)
            and not getattr(s.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)]


@contextlib.contextmanager
def _distopt_load_without_apex(optimizer):
    """Work around two bugs of megatron-core 0.16's DistributedOptimizer load without apex / TE (CPU builds).

    There the torch Adam state carries a per-parameter "step", which `load_state_dict` restores from the param groups:
      1. it puts ONE step tensor into every parameter's state; torch Adam increments it in place per parameter, so
         after the first step it reads 2 + n_params instead of 3 (bias corrections go wrong: resume is not exact);
      2. the per-parameter loaders then copy every key of that state from the checkpoint tensors, which (by design)
         hold no "step" -> KeyError.
    Handing each copy its own current step back makes (2) a no-op; after the load each parameter gets its own step
    tensor (1). Instance-level, only for the duration of the load; nothing happens where apex or TE is present.
    """
    subs = _distopt_subs_without_apex(optimizer)
    originals = {}
    for sub in subs:
        original = sub._set_main_param_and_optimizer_states

        def with_step(model_param, tensors, sub=sub, original=original):
            group, order = sub.model_param_group_index_map[model_param]
            state = sub.optimizer.state.get(sub.optimizer.param_groups[group]["params"][order], {})
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
            return original(model_param, tensors)

        originals[sub] = original
        sub._set_main_param_and_optimizer_states = with_step
    try:
        yield
    finally:
        for sub in originals:
            del sub._set_main_param_and_optimizer_states  # back to the class method
    for sub in subs:
        for state in sub.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(s, DistributedOptimizer) for s in getattr(optimizer, "chained_optimizers", [optimizer]))


def _model_layout() -> dict:
    """The model-parallel layout (not DP): what the distributed optimizer's buckets, and so its saved state, depend on."""
    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "vpp": getattr(ps, "get_virtual_pipeline_model_parallel_world_size", lambda: None)(),
            "ep": ps.get_expert_model_parallel_world_size(), "cp": ps.get_context_parallel_world_size()}


def _content_metadata(optimizer) -> dict:
    """What a checkpoint says about its own contents (megatron's content metadata, in common.pt)."""
    metadata = DISTOPT_METADATA if optimizer is not None and _is_distributed(optimizer) else OPTIM_METADATA
    return {"justrl_optimizer": dict(metadata), "justrl_model_layout": _model_layout()}


def _saved_content(path: Path) -> dict:
    """A checkpoint's content metadata ({} for checkpoints from before it was written)."""
    load = getattr(dist_checkpointing, "load_content_metadata", None)
    if load is None:
        from megatron.core.dist_checkpointing.serialization import load_content_metadata as load
    return load(str(path)) or {}


def layout_refusal(path: str | os.PathLike, optimizer) -> str | None:
    """One line when the distributed optimizer's state in `path` cannot load at this layout (its dp_reshardable
    format reshards over data parallelism only), naming what to do; None when it can."""
    saved = _saved_content(Path(path))
    if optimizer is None or saved.get("justrl_optimizer", OPTIM_METADATA) != DISTOPT_METADATA:
        return None
    before, now = saved["justrl_model_layout"], _model_layout()
    names = {"tp": "tensor", "pp": "pipeline", "vpp": "virtual_pipeline", "ep": "expert", "cp": "context"}
    changed = [k for k in names if before.get(k) != now[k]]
    if not changed:
        return None
    keep = " ".join(f"parallel.{names[k]}={before.get(k)}" for k in changed)
    changed = [f"{k} {before.get(k)} -> {now[k]}" for k in changed]
    return (f"{path} holds the distributed optimizer's state sharded for its model-parallel layout, which only the "
            f"data-parallel size may change ({', '.join(changed)}): resume with {keep} (any number of data-parallel "
            f"ranks), or export the weights (`justrl-convert mcore-to-hf --ckpt {path} --out DIR`) and start a new "
            f"run from DIR (the optimizer state starts afresh)")


def _sharded_state_dict(chunks, optimizer, is_loading: bool, metadata: dict | None = None) -> dict:
    """`metadata`: the optimizer format (loading: the checkpoint's; saving: this optimizer's, `_content_metadata`)."""
    sd = model_sharded_state_dict(chunks)
    if optimizer is not None:
        if is_loading:
            _prime_empty_adam_state(optimizer)
        metadata = metadata or _content_metadata(optimizer)["justrl_optimizer"]
        with _distopt_buckets_without_step(optimizer):
            sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=dict(metadata))
    return sd


@contextlib.contextmanager
def _distopt_buckets_without_step(optimizer):
    """Keep torch Adam's per-parameter "step" out of the dp_reshardable buckets (megatron-core 0.16 without apex / TE,
    the CPU build). That format saves every per-parameter state tensor as a slice of its bucket; a 1-element "step"
    does not fit that mapping and reads back as 0 (Adam's bias corrections then restart: measured, the second step
    after a resume differed). The step is saved once in the param groups anyway, and the load restores it from there
    (`_distopt_load_without_apex`). Instance-level, only while the sharded state dict is built."""
    subs = _distopt_subs_without_apex(optimizer)
    for sub in subs:
        original = sub._get_main_param_and_optimizer_states

        def without_step(model_param, original=original):
            return {k: v for k, v in original(model_param).items() if k != "step"}

        sub._get_main_param_and_optimizer_states = without_step
    try:
        yield
    finally:
        for sub in subs:
            del sub._get_main_param_and_optimizer_states  # back to the class method
