"""Microbenchmarks of the update's kernels on CUDA, each fast path against the path it replaces, with the output
difference between them (gpu_check's `mfu` stage; `python -m justrl_megatron.bench.kernels` alone).

  attention  packed causal attention of one sequence, the model's head layout, forward and forward+backward:
             torch varlen flash (FlashAttention-2) vs cuDNN (model.attention_backend), TFLOP/s and max |difference|
  swiglu     megatron's compiled SwiGLU forward+backward at [tokens, 2 x ffn], GB/s against the device's bandwidth
  adamw      one AdamW step over N fp32 parameters: torch foreach vs fused (fast path `fused_adamw`)
  head       the log-prob head (output projection fused, model/logprobs.py) forward+backward: eager vs compiled
             (fast path `compiled_head`)

Times are medians of CUDA-event timings after warm-up calls; every figure is also in the returned dict.
"""

from __future__ import annotations

import json
import math
import sys

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import torch


def _time(fn, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of fn() on the current CUDA stream (the attention probe's clock, more repeats)."""
    from ..model.attention import cuda_seconds

    return cuda_seconds(fn, repeats=repeats, warmup=warmup)


def _maxdiff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def bench_attention(tokens: int = 16384, heads: int = 12, groups: int = 2, head_dim: int = 128,
                    dtype=torch.bfloat16) -> dict:
    from ..model.attention import cudnn_choice, varlen_choice

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(tokens, h, head_dim, device=dev, dtype=dtype, generator=g)
               for h in (heads, groups, groups))
    w = torch.randn(tokens, heads, head_dim, device=dev, dtype=dtype, generator=g)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
    scale = 1.0 / math.sqrt(head_dim)
    flops_fwd = 4 * heads * head_dim * tokens * (tokens + 1) / 2  # causal: half the score matrix
    forms = {"flash": varlen_choice(dev, dtype, heads, groups, head_dim),
             "cudnn": cudnn_choice(dev, dtype, heads, groups, head_dim)}
    out, grads, result = {}, {}, {"tokens": tokens, "heads": heads, "groups": groups, "head_dim": head_dim}
    for name, (form, fn) in forms.items():
        if fn is None:
            result[name] = {"available": False}
            continue
        call = (lambda fn=fn, x=None: fn(*(x or (q, k, v)), cu, tokens, scale)) if name == "flash" else \
            (lambda fn=fn, x=None: fn(*(x or (q, k, v)), [0, tokens], scale))
        inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o = call(x=inputs)
        grads[name] = torch.autograd.grad((o * w).sum(), inputs)
        out[name] = o.detach()
        t_fwd = _time(lambda: call())

        def fwd_bwd():
            xs = [x.detach().requires_grad_() for x in (q, k, v)]
            (call(x=xs) * w).sum().backward()

        t_all = _time(fwd_bwd)
        t_bwd = max(t_all - t_fwd, 1e-9)
        result[name] = {"available": True, "form": form, "forward_ms": t_fwd * 1e3, "backward_ms": t_bwd * 1e3,
                        "forward_tflops": flops_fwd / t_fwd / 1e12, "backward_tflops": 2 * flops_fwd / t_bwd / 1e12}
    if len(out) == 2:
        result["cudnn_vs_flash"] = {"out_max_abs_diff": _maxdiff(out["cudnn"], out["flash"]),
                                    "grad_max_abs_diff": max(_maxdiff(a, b) for a, b in zip(grads["cudnn"],
                                                                                           grads["flash"])),
                                    "forward_speedup": result["flash"]["forward_ms"] / result["cudnn"]["forward_ms"],
                                    "backward_speedup": result["flash"]["backward_ms"] / result["cudnn"]["backward_ms"]}
    return result


def bench_swiglu(tokens: int = 16384, ffn: int = 8960, dtype=torch.bfloat16) -> dict:
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    dev = torch.device("cuda")
    y = torch.randn(tokens, 1, 2 * ffn, device=dev, dtype=dtype)
    g = torch.randn(tokens, 1, ffn, device=dev, dtype=dtype)

    def fused():
        x = y.detach().requires_grad_()
        bias_swiglu_impl(x, None).backward(g)

    def plain():
        x = y.detach().requires_grad_()
        a, b = x.chunk(2, -1)
        (torch.nn.functional.silu(a) * b).backward(g)

    # bytes a perfect kernel moves: forward reads y, writes out; backward reads y and g, writes dy
    moved = y.numel() * y.element_size() * 2 + g.numel() * g.element_size() * 2
    t_fused, t_plain = _time(fused), _time(plain)
    return {"shape": [tokens, 2 * ffn], "fused_ms": t_fused * 1e3, "plain_ms": t_plain * 1e3,
            "fused_gb_per_s": moved / t_fused / 1e9, "plain_gb_per_s": moved / t_plain / 1e9}


def bench_adamw(parameters: int = 1_777_088_000, tensors: int = 339) -> dict:
    """One AdamW step over `parameters` fp32 values in `tensors` tensors (the 1.5B model's count and layout size),
    foreach vs fused, and the max difference of the parameters after one step from the same state."""
    dev = torch.device("cuda")
    sizes = [parameters // tensors] * tensors
    result = {"parameters": sum(sizes), "tensors": tensors}
    after = {}
    for mode in ("foreach", "fused"):
        g = torch.Generator(device=dev).manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, device=dev, generator=g)) for n in sizes]
        for p in params:
            p.grad = torch.randn(p.shape, device=dev, generator=g) * 1e-3
        opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.1, foreach=mode == "foreach",
                                fused=mode == "fused")
        opt.step()  # the first step allocates the state
        after[mode] = params[0].detach().clone()
        result[f"{mode}_ms"] = _time(opt.step, repeats=3, warmup=1) * 1e3
        del opt, params
        torch.cuda.empty_cache()
    result["max_abs_diff_after_one_step"] = _maxdiff(after["fused"], after["foreach"])
    result["fused_speedup"] = result["foreach_ms"] / result["fused_ms"]
    return result


def bench_head(rows: int = 15360, hidden: int = 1536, vocab: int = 151936, dtype=torch.bfloat16) -> dict:
    from ..model import logprobs

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(rows, hidden, device=dev, dtype=dtype, generator=g)
    w = (torch.randn(vocab, hidden, device=dev, dtype=dtype, generator=g) * 0.02)
    t = torch.randint(0, vocab, (rows,), device=dev, generator=g)
    result, outs = {"rows": rows, "hidden": hidden, "vocab": vocab}, {}
    for mode in ("eager", "compiled"):
        def run(keep=False, mode=mode):
            hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
            lp, ent = logprobs.logprobs_from_hidden(hh, ww, t, vocab_size=vocab, with_entropy=True,
                                                    compiled=mode == "compiled")
            (lp.sum() + 0.01 * ent.sum()).backward()
            if keep:
                outs[mode] = (lp.detach(), ent.detach(), hh.grad, ww.grad)

        run(keep=True)
        result[f"{mode}_ms"] = _time(run, repeats=3, warmup=1) * 1e3
    result["compiled_speedup"] = result["eager_ms"] / result["compiled_ms"]
    result["max_abs_diff"] = {name: _maxdiff(a, b) for name, a, b in
                              zip(("logp", "entropy", "grad_hidden", "grad_weight"), outs["compiled"], outs["eager"])}
    return result


BENCHES = {"attention": bench_attention, "swiglu": bench_swiglu, "adamw": bench_adamw, "head": bench_head}


def run_all(progress=None) -> dict:
    """Every microbenchmark; a failing one is recorded with its error and the others still run."""
    out = {}
    for name, fn in BENCHES.items():
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001  (a report, not a gate: the record says what failed)
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        torch.cuda.empty_cache()
        if progress:
            progress(dict(out))
    return out


if __name__ == "__main__":
    print(json.dumps(run_all(), indent=1))
    sys.exit(0)
