"""Device-to-host syncs of the training step on CUDA (model/optimizer_kernels.py; fast_paths).

`count_syncs(fn)` (bench/train.py; the mfu stage counts with it too) counts them with torch's sync debug mode: in
mode "warn" every synchronizing CUDA call (`.item()`, `float(t)`, `.tolist()`, a blocking copy to or from the host,
`torch.cuda.synchronize()`) emits one UserWarning
("called a synchronizing CUDA operation"); `test_count_syncs_sees_each_sync` checks that on this torch. A
forward/backward count belongs here too (wrap `compute_logprobs` or `forward_backward` in `count_syncs`).
"""

import os

import pytest
import torch

from justrl_megatron.bench.train import count_syncs
from step_parity import MAX_TOKENS, SHAPES, STEP_KW, make_samples, old_from


def test_count_syncs_sees_each_sync():
    x = torch.arange(5.0, device="cuda")
    values, n, _ = count_syncs(lambda: [float(v) for v in x])
    assert values == [0.0, 1.0, 2.0, 3.0, 4.0] and n == 5
    assert count_syncs(lambda: x * 2 + 1)[1] == 0


@pytest.fixture(scope="module")
def bf16_policy():
    from helpers import LAUNCHER_ENV
    from justrl_megatron.model.policy import Policy

    saved = {k: os.environ.get(k) for k in (*LAUNCHER_ENV, "JUSTRL_FAST_PATHS_OFF")}
    os.environ.pop("JUSTRL_FAST_PATHS_OFF", None)  # every fast path on
    policy = Policy.build(SHAPES["qwen"], dtype="bf16", transformer_impl="local", lr=1e-3, warmup_steps=0,
                          grad_clip=1.0, distributed_optimizer=True, seed=1234)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return policy


def _optimizer_step_syncs(policy, updates=2):
    """One GRPO update per entry (a full mini-batch: one optimizer step each); the syncs inside
    `policy.optimizer.step()` of each, as (count, where). The first step's include one-off work (megatron 0.19's
    `has_grad_norm_group` builds a CUDA flag from the host and reads it back, then caches it: 2 syncs): compare the
    last."""
    from justrl_megatron.train.step import compute_logprobs, grpo_update

    samples = make_samples()
    logprobs = compute_logprobs(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    old = old_from([lp.float().cpu() for lp in logprobs])
    counts = []
    step = policy.optimizer.step

    def counted():
        result, n, where = count_syncs(step)
        counts.append((n, where))
        return result

    policy.optimizer.step = counted
    try:
        for _ in range(updates):
            grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=MAX_TOKENS,
                        **STEP_KW)
    finally:
        del policy.optimizer.step  # back to the class's method
    assert len(counts) == updates
    return counts


def test_optimizer_step_syncs_once(bf16_policy, monkeypatch):
    """With the fast paths on, the step syncs once: megatron's `.item()` of the all-reduced grad norm, which the clip
    needs on the host. Without `foreach_grad_norm` megatron's fallback syncs once per gradient tensor (the control
    that shows this count can see them)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core import utils
    from justrl_megatron.model import fast_paths, optimizer_kernels as ok

    policy = bf16_policy
    assert policy.device.type == "cuda" and policy.dtype == torch.bfloat16
    if clip_grads.l2_norm_impl is not ok.foreach_l2_norm:
        assert clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm
        pytest.skip("apex / TransformerEngine kernels in use: nothing to replace")
    inners = ok._inner_optimizers(policy.optimizer)
    assert inners and all(g["fused"] is True for i in inners for g in i.param_groups)

    fast = _optimizer_step_syncs(policy)
    print("syncs per optimizer step, fast paths on:", [n for n, _ in fast], [w for _, w in fast])
    assert fast[-1][0] <= 1, fast[-1][1]
    steps = {str(s["step"].device) for i in inners for s in i.state.values()}
    assert steps == {str(policy.device)}, steps  # fused AdamW keeps its step counts on the device

    off = fast_paths.FastPaths(foreach_grad_norm=False)
    try:
        assert ok.install_optimizer_kernels(policy.optimizer, policy.device, off)  # megatron's fallbacks put back
        assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
        slow = _optimizer_step_syncs(policy, updates=1)
    finally:
        ok.install_optimizer_kernels(policy.optimizer, policy.device)
    assert clip_grads.l2_norm_impl is ok.foreach_l2_norm
    n_grads = sum(p.requires_grad for c in policy.chunks for p in c.parameters())
    print("syncs per optimizer step, foreach_grad_norm off:", slow[0][0], "gradient tensors:", n_grads)
    assert slow[0][0] > fast[-1][0] + 10, slow[0][1][:5]


def test_foreach_kernels_match_megatron_fallbacks_on_cuda():
    """fp32 on CUDA: the same norm as megatron's fallback (rel 1e-6: summation order), the same scale bit for bit."""
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale
    from justrl_megatron.model import optimizer_kernels as ok

    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(s, device="cuda", generator=g) for s in [(64, 33), (), (0,), (1000,), (5, 7, 3)]]
    ours, _ = ok.foreach_l2_norm(0, torch.zeros(1, dtype=torch.int, device="cuda"), [tensors], False)
    ref, _ = local_multi_tensor_l2_norm(0, None, [tensors], False)
    assert ours.device == tensors[0].device and float(ours) == pytest.approx(float(ref), rel=1e-6)
    dst_ours = [torch.empty_like(t, dtype=torch.bfloat16) for t in tensors]
    dst_ref = [torch.empty_like(t, dtype=torch.bfloat16) for t in tensors]
    for scale in (1.0, 0.37):
        ok.foreach_scale(0, None, [tensors, dst_ours], scale)
        local_multi_tensor_scale(0, None, [tensors, dst_ref], scale)
        assert all(torch.equal(a, b) for a, b in zip(dst_ours, dst_ref))
    a, b = [t.clone() for t in tensors], [t.clone() for t in tensors]
    ok.foreach_scale(0, None, [a, a], 0.37)
    local_multi_tensor_scale(0, None, [b, b], 0.37)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
