"""The non-finite step guard's cost (train/step.py::optimizer_step_if_finite), side by side with megatron's bare step.

    python -m justrl_megatron.bench.guard [model=tiny] [dtype=fp32] [samples=8] [seq_len=256] [repeats=7]

One policy; each round, on the same gradients, times (interleaved, so that machine load hits both alike):
  off    megatron's `optimizer.step()` alone (no guard);
  on     `optimizer_step_if_finite` (grad check + the fused max-|w| pass + megatron's step);
  copy   the guard as it was before (a host copy of every trainable weight + a max-|w| check after the step);
and one whole update (`grpo_update`: forward, backward, guarded step). Prints medians and minima (the least disturbed
run: load on a shared machine only adds time) and (on - off) as a share of the update: the guard's overhead.
"""

from __future__ import annotations

import justrl_megatron.compat  # noqa: F401  (first)

import json
import statistics
import sys
import time

import torch

from .. import compat


def _sync():
    if compat.cuda_available():
        torch.cuda.synchronize()


def bench_guard(*, model: str = "tiny", dtype: str = "fp32", samples: int = 8, seq_len: int = 256,
                repeats: int = 7, shape=None) -> dict:
    """``shape`` (a ModelShape) instead of a named ``model``: the GPU test's moderate model."""
    from ..algo.loss_config import LossConfig
    from ..distributed import init_distributed
    from ..model.build import nonfinite_parameters
    from ..model.policy import Policy
    from ..train import step as step_mod
    from ..train.batching import Sample
    from .train import resolve_shape

    init_distributed()
    if shape is not None:
        model = f"{shape.num_layers} layers, hidden {shape.hidden_size}, ffn {shape.ffn_hidden_size}"
    shape = shape or resolve_shape(model)
    policy = Policy.build(shape, dtype=dtype, transformer_impl="local", lr=1e-6, weight_decay=0.1, grad_clip=1.0,
                          seed=1)
    g = torch.Generator().manual_seed(0)
    batch = [Sample(prompt_ids=torch.randint(1, shape.vocab_size, (seq_len // 4,), generator=g).tolist(),
                    response_ids=torch.randint(1, shape.vocab_size, (seq_len - seq_len // 4,), generator=g).tolist(),
                    advantage=1.0 if i % 2 else -1.0, group=i // 4) for i in range(samples)]
    kw = dict(max_tokens_per_micro_batch=samples * seq_len, loss=LossConfig())  # the loss's own defaults
    old = step_mod.compute_logprobs(policy, batch, max_tokens_per_micro_batch=samples * seq_len)

    def backward_only(policy, step):  # the update's gradients, kept for the timed steps below
        raise _GradsReady

    def grads():
        try:
            step_mod.grpo_update(policy, batch, old, mini_batch_size=samples, on_grads=backward_only, **kw)
        except _GradsReady:
            pass

    def old_guard():  # the former guard: its own grad copy + norm, a host copy of the trainable weights,
        # megatron's step, then a max-|w| check with a host sync
        found_inf = policy.optimizer.prepare_grads()
        norm = float(policy.optimizer.get_grad_norm())
        params = [p for c in policy.chunks for p in c.parameters() if p.requires_grad]
        before = [p.detach().to("cpu", copy=True) for p in params]
        policy.optimizer.step()
        bool(nonfinite_parameters(policy.chunks, trainable_only=True)) or found_inf or norm
        del before

    ways = {"off": lambda: policy.optimizer.step(), "on": lambda: step_mod.optimizer_step_if_finite(policy),
            "copy": old_guard}
    times: dict[str, list[float]] = {k: [] for k in (*ways, "update")}
    for _ in range(repeats):
        for name, fn in ways.items():
            grads()
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        step_mod.grpo_update(policy, batch, old, mini_batch_size=samples, **kw)
        _sync()
        times["update"].append(time.perf_counter() - t0)
    grads()
    copies = _host_copies(lambda: step_mod.optimizer_step_if_finite(policy))
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}  # the least disturbed run of each: machine load only adds time
    params = sum(p.numel() for c in policy.chunks for p in c.parameters())
    return {"model": model, "dtype": dtype, "params": params, "tokens": samples * seq_len, "repeats": repeats,
            "threads": torch.get_num_threads(), "device": str(policy.device),
            "host_copies_in_a_guarded_step": copies, "median_s": {k: round(v, 5) for k, v in med.items()},
            "min_s": {k: round(v, 5) for k, v in low.items()},
            "guard_overhead_of_update": round((med["on"] - med["off"]) / med["update"], 5),
            "old_guard_overhead_of_update": round((med["copy"] - med["off"]) / med["update"], 5),
            "guard_overhead_of_update_min": round((low["on"] - low["off"]) / low["update"], 5),
            "old_guard_overhead_of_update_min": round((low["copy"] - low["off"]) / low["update"], 5),
            "all_s": {k: [round(x, 5) for x in v] for k, v in times.items()}}


class _GradsReady(Exception):
    pass


def _host_copies(fn) -> int:
    """How many tensors ``fn`` copied with ``Tensor.to(..., copy=True)`` (the former guard's host copy)."""
    seen = []

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.to and kwargs.get("copy"):
                seen.append(1)
            return func(*args, **kwargs)

    with Count():
        fn()
    return len(seen)


def main(argv: list[str] | None = None) -> int:
    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv))
    typed = {k: (int(v) if k in ("samples", "seq_len", "repeats") else v) for k, v in args.items()}
    print(json.dumps(bench_guard(**typed), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
