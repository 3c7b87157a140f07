"""The fast paths on CUDA (model/fast_paths.py, model.attention_backend): cuDNN packed attention equals the
reference and never syncs, per-token RoPE rows give megatron's logits exactly, the compiled log-prob head equals
the eager one, and forward + backward of an update make no device-to-host sync (the optimizer step at most one)."""

import math

import pytest
import torch

from justrl_megatron.model import attention, logprobs
from justrl_megatron.model.attention import cudnn_choice, packed_causal_attention
from test_gpu_attention import HEAD_DIM, LAYOUTS, LENS, TOL, _inputs, _rel, _truth


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads,groups", LAYOUTS, ids=["gqa", "mha"])
def test_cudnn_attention_equals_the_reference(dtype, heads, groups):
    name, fn = cudnn_choice("cuda", dtype, heads, groups, HEAD_DIM)
    assert fn is not None, f"no cuDNN attention form works on torch {torch.__version__}"
    q, k, v, w, cu = _inputs(heads, groups)
    scale = 1 / math.sqrt(HEAD_DIM)
    truth, truth_grads = _truth(q, k, v, w, cu, scale, dtype)
    dev = torch.device("cuda")
    ins = [x.to(device=dev, dtype=dtype).requires_grad_() for x in (q, k, v)]
    cu_dev = cu.to(dev)
    cu_dev.justrl_host_bounds = cu.tolist()
    out = packed_causal_attention(*ins, cu_dev, max(LENS), scale, backend="cudnn")
    grads = torch.autograd.grad((out.double() * w.to(dev)).sum(), ins)
    tol = TOL[dtype]
    assert _rel(out.detach().double().cpu(), truth) <= tol, name
    for a, t in zip(grads, truth_grads):
        assert _rel(a.double().cpu(), t) <= 2 * tol, name
    # with the bounds on the host (as every micro-batch carries them) the cuDNN path makes no host sync
    w_dev = w.to(device=dev, dtype=dtype)  # (a copy to the device is itself a sync: before the check)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = packed_causal_attention(*ins, cu_dev, max(LENS), scale, backend="cudnn")
        torch.autograd.grad((out * w_dev).sum(), ins)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_auto_backend_picks_a_working_backend_and_says_why(caplog):
    with caplog.at_level("INFO", logger="justrl_megatron.model.attention"):
        pick = attention.attention_backend("auto", "cuda", torch.bfloat16, 12, 2, HEAD_DIM)
    assert pick in ("cudnn", "flash")
    if cudnn_choice("cuda", torch.bfloat16, 12, 2, HEAD_DIM)[1] is not None:
        assert "model.attention_backend=auto" in caplog.text and "cudnn" in caplog.text


def test_the_policy_decides_auto_once_and_every_attention_layer_takes_it():
    policy = _tiny_policy(attention_backend="auto")
    chosen = policy.fast_paths.attention_backend
    assert chosen in ("cudnn", "flash")
    cores = [m for m in policy.modules[0].modules() if isinstance(m, attention.SDPAttention)]
    assert cores and {c.backend for c in cores} == {chosen}  # resolved, not "auto" decided per layer again
    assert policy.fast_paths.record()["model.attention_backend"] == chosen


def _tiny_policy(**kw):
    from justrl_megatron.bench.train import BUILTIN_SHAPES
    from justrl_megatron.model.policy import Policy

    return Policy.build(BUILTIN_SHAPES["tiny"], dtype="bf16", transformer_impl="local", lr=1e-4, seed=5, **kw)


def _samples(n=4, seed=0):
    from justrl_megatron.train.batching import Sample

    g = torch.Generator().manual_seed(seed)
    return [Sample(prompt_ids=torch.randint(1, 4096, (17,), generator=g).tolist(),
                   response_ids=torch.randint(1, 4096, (int(L),), generator=g).tolist(),
                   advantage=float(torch.randn((), generator=g)), group=i)
            for i, L in enumerate(torch.randint(20, 300, (n,), generator=g))]


def test_rope_once_gives_megatrons_logprobs_exactly():
    import dataclasses

    from justrl_megatron.train.step import compute_logprobs

    policy, samples = _tiny_policy(), _samples()
    assert policy.fast_paths.rope_once
    fast = compute_logprobs(policy, samples, max_tokens_per_micro_batch=4096)
    policy.fast_paths = dataclasses.replace(policy.fast_paths, rope_once=False)  # the step reads it from the policy
    slow = compute_logprobs(policy, samples, max_tokens_per_micro_batch=4096)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_compiled_head_equals_the_eager_head():
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(3000, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4224, 256, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    t = torch.randint(0, 4100, (3000,), device="cuda", generator=g)
    outs = []
    for compiled in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = logprobs.logprobs_from_hidden(hh, ww, t, vocab_size=4100, with_entropy=True, chunk_size=1000,
                                                compiled=compiled)
        (lp.sum() + 0.1 * ent.sum()).backward()
        outs.append((lp, ent, hh.grad, ww.grad))
    for name, a, b in zip(("logp", "entropy", "grad_hidden", "grad_weight"), *outs):
        bound = 1e-5 if a.dtype == torch.float32 else 1e-2  # fp32 sums in another order; bf16 one rounding
        assert _rel(a.float(), b.float()) <= bound, name


def test_forward_and_backward_make_no_host_sync(monkeypatch):
    """One update with every fast path on: no device-to-host sync inside megatron's forward/backward schedule,
    at most one in the optimizer step (the total norm's .item())."""
    from justrl_megatron.bench.train import sync_counts
    from justrl_megatron.train import step

    policy, samples = _tiny_policy(attention_backend="auto"), _samples()
    old = step.compute_logprobs(policy, samples, max_tokens_per_micro_batch=4096)
    step.grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=4096)  # warm
    in_schedule = {}
    real = step._run_schedule

    def counted(*args, **kwargs):
        if kwargs.get("forward_only"):
            return real(*args, **kwargs)
        counts = sync_counts(policy, lambda: in_schedule.setdefault("out", real(*args, **kwargs)))
        in_schedule["syncs"] = counts
        return in_schedule["out"]

    monkeypatch.setattr(step, "_run_schedule", counted)
    whole = sync_counts(policy, lambda: step.grpo_update(policy, samples, old, mini_batch_size=len(samples),
                                                          max_tokens_per_micro_batch=4096))
    assert in_schedule["syncs"]["update"] == 0, in_schedule["syncs"]["where"]
    assert whole["optimizer_step"] <= 1, whole
