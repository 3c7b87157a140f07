"""The optimizer step without apex or TransformerEngine: foreach grad norm and scale, torch's fused AdamW (CUDA only).

Why: where neither apex nor TE is importable, megatron-core's optimizer falls back to pure-Python stand-ins for apex's
multi-tensor kernels (megatron/core/utils.py, bound in megatron/core/optimizer/clip_grads.py and optimizer.py):

  * `local_multi_tensor_l2_norm` takes `torch.norm` of every gradient, then builds a host tensor from those CUDA
    scalars (`torch.tensor(l2)`) and a CUDA tensor from its `float(...)`: one device-to-host sync per parameter tensor
    (about 200 per step for a 1.5B model), each stalling the CPU until the GPU has drained its queue;
  * `local_multi_tensor_scale` (the clip, and `_multi_tensor_copy_this_to_that`: the fp32 main weights copied into
    the bf16 model weights after every step) is a Python loop of `dst.copy_(src * scale)`, two kernels per tensor;
  * the inner optimizer is `torch.optim.AdamW` with its default foreach implementation (several kernels per op).

`install_optimizer_kernels(optimizer, device)` (called once by `Policy.build`) replaces the first two with foreach
versions (`foreach_l2_norm`, `foreach_scale`: no host sync, the norm accumulated in fp32) by rebinding those module
names, and switches torch's AdamW to `fused=True`. Each acts only when the parameters are on CUDA and only over
megatron's own fallbacks (apex / TE kernels are never replaced), so the CPU path and the demo figures stay exactly as
they are. Each is a switch of fast_paths (`foreach_grad_norm`, `fused_adamw`); `JUSTRL_FAST_PATHS_OFF` turns it off,
and an install with `foreach_grad_norm` off puts megatron's fallbacks back (the rebinding is process-wide).

What the step still syncs on: megatron's `.item()` of the all-reduced total norm (get_grad_norm_fp32), which the
clip needs on the host (and on megatron 0.19's first step, 2 more: `has_grad_norm_group` reads a flag once and caches
it). Not touched, as they are off here: `count_zeros_fp32` (`log_num_zeros_in_grad`) and the
found-inf `.item()` of fp16 loss scaling (bf16 has no grad scaler). Checkpoint saving reads each AdamW step
(`s["step"].item()` in DistributedOptimizer.state_dict), which with fused AdamW lives on the GPU: a sync per parameter
at save time only. megatron 0.19's `multi_tensor_scale_tensor_impl` (a clip by a CUDA tensor, which would remove the
norm's `.item()`) stays None: it turns the step's grad norm into a tensor, which the step guard reads as a number.
"""

from __future__ import annotations

import importlib
import logging

import torch

from . import fast_paths

logger = logging.getLogger(__name__)


def fp32_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The per-tensor 2-norms of a non-empty list, in fp32 and in the list's order, as one 1-D tensor on the first
    tensor's device: one fused `_foreach_norm(..., dtype=float32)` per (device, dtype) group, then one stack. CUDA's
    fused kernel takes a list of ONE dtype only (a mixed list runs a kernel per tensor), and a cast per tensor would
    be a launch each: either makes the pass several times slower than reading the bytes."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    norms: list = [None] * len(tensors)
    with torch.no_grad():
        for idx in groups.values():
            for i, n in zip(idx, torch._foreach_norm([tensors[i] for i in idx], 2, dtype=torch.float32)):
                norms[i] = n
    device = tensors[0].device
    return torch.stack([n if n.device == device else n.to(device) for n in norms])


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for megatron's `local_multi_tensor_l2_norm` (and apex's multi_tensor_l2norm): the l2 norm over every
    tensor of `tensor_lists` as a 1-element fp32 tensor on their device, without a host sync. Per-tensor norms in fp32
    (`fp32_norms`), their norm in fp32. Returns (norm, None), as the local fallback does."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        device = noop_flag.device if isinstance(noop_flag, torch.Tensor) else None
        return torch.zeros(1, dtype=torch.float32, device=device), None
    return torch.linalg.vector_norm(fp32_norms(tensors), 2).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for megatron's `local_multi_tensor_scale` (apex's multi_tensor_scale): `dst = src * scale` for the
    pairs of tensor_lists[0] (src) and tensor_lists[1] (dst), computed in src's dtype and cast into dst's, as
    `dst.copy_(src * scale)` does. In place where src is dst in fp32 (the clip of megatron's fp32 main grads); a plain
    copy where scale is 1 (x * 1.0 == x)."""
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if len(src) != len(dst):
        raise ValueError(f"multi_tensor_scale: {len(src)} sources, {len(dst)} destinations")
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)) and all(d.dtype == torch.float32 for d in dst):
        if scale != 1.0:  # (in place for fp32 only: torch's CPU kernel of an in-place bf16 multiply rounds the scale
            # to bf16 first, which `src * scale` does not)
            torch._foreach_mul_(dst, scale)
        return
    torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))


# (module, name, megatron's fallback in megatron.core.utils, ours): every binding of the fallbacks the step reads
_BINDINGS = (
    ("megatron.core.optimizer.clip_grads", "l2_norm_impl", "local_multi_tensor_l2_norm", foreach_l2_norm),
    ("megatron.core.optimizer.clip_grads", "multi_tensor_scale_impl", "local_multi_tensor_scale", foreach_scale),
    ("megatron.core.optimizer.optimizer", "multi_tensor_scale_impl", "local_multi_tensor_scale", foreach_scale),
)


def _bind_foreach(on: bool) -> list[str]:
    """Rebinds megatron's fallbacks to ours (on) or ours back to megatron's (off); a name bound to anything else
    (apex's or TE's kernels, or a name this megatron version lacks) is left alone. Returns what it rebound."""
    utils = importlib.import_module("megatron.core.utils")
    changed = []
    for module_name, name, local_name, ours in _BINDINGS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        current, local = getattr(module, name, None), getattr(utils, local_name, None)
        if current is None or local is None:
            continue
        if on and current is local:
            setattr(module, name, ours)
            changed.append(f"{module_name}.{name} -> {ours.__name__}")
        elif not on and current is ours:
            setattr(module, name, local)
            changed.append(f"{module_name}.{name} -> megatron's {local_name}")
    return changed


def _inner_optimizers(optimizer) -> list:
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [inner for inner in (getattr(s, "optimizer", None) for s in subs) if inner is not None]


def _fused_ready(inner, *args, **kwargs) -> None:
    """What fused AdamW needs, re-established before every step (a step pre-hook): `fused` set in every group (a
    `load_state_dict` brings back the saved groups, which may say otherwise) and each state's `step` an fp32 tensor on
    its parameter's device (torch keeps it on the host for foreach; loaded states may hold it there or as a number)."""
    for group in inner.param_groups:
        group["fused"], group["foreach"] = True, None
        for p in group["params"]:
            state = inner.state.get(p)
            if not state or "step" not in state:
                continue
            step = state["step"]
            if not torch.is_tensor(step):
                state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
            elif step.device != p.device or step.dtype != torch.float32:
                state["step"] = step.to(dtype=torch.float32, device=p.device)


def _use_fused_adamw(optimizer) -> list[str]:
    """torch's AdamW/Adam inner optimizers whose parameters are all on CUDA switched to `fused=True` (not apex's or
    TE's FusedAdam, nor megatron's hybrid CPU optimizer: their classes differ)."""
    switched = []
    for inner in _inner_optimizers(optimizer):
        if type(inner) not in (torch.optim.AdamW, torch.optim.Adam):
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if not params or any(p.device.type != "cuda" or not torch.is_floating_point(p) for p in params):
            continue
        if any(g.get("differentiable") for g in inner.param_groups):
            continue
        inner.defaults["fused"], inner.defaults["foreach"] = True, None
        inner._step_supports_amp_scaling = True  # what torch's constructor sets for fused
        _fused_ready(inner)
        if not getattr(inner, "_justrl_fused_hook", None):
            inner._justrl_fused_hook = inner.register_step_pre_hook(_fused_ready)
        switched.append(f"{type(inner).__name__}(fused=True) over {len(params)} tensors")
    return switched


def install_optimizer_kernels(optimizer, device, fast: fast_paths.FastPaths | None = None) -> list[str]:
    """The fast paths of the optimizer step for a policy on `device` (see the module docstring); nothing on the CPU.
    `fast`: the policy's resolved fast paths (None: all on). Returns (and logs) what was installed or put back."""
    if torch.device(device).type != "cuda":
        return []
    fast = fast or fast_paths.FastPaths()
    done = _bind_foreach(fast.foreach_grad_norm)
    if fast.fused_adamw:
        done += _use_fused_adamw(optimizer)
    if done:
        logger.info("optimizer kernels: %s", "; ".join(done))
    return done
