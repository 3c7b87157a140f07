"""model/optimizer_kernels.py on the CPU: the foreach grad norm and scale compute what megatron's no-apex fallbacks
compute, fused AdamW steps like foreach AdamW, and the install leaves a CPU policy's optimizer exactly as megatron
built it (its sync counts on CUDA: tests/gpu/test_gpu_syncs.py)."""

import copy
import os

import pytest
import torch

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections before megatron loads)
from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

from justrl_megatron.model import optimizer_kernels as ok

SHAPES = [(7, 5), (), (0,), (3, 0), (129,), (4, 3, 2), ()]


def _tensors(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * (i + 1)).to(dtype) for i, s in enumerate(SHAPES)]


# fp32: the same per-tensor norms, summed in another order -> rounding only. bf16: megatron's fallback rounds every
# per-tensor norm and their norm to bf16 (8 bits of mantissa: 2^-8 relative each); ours keeps fp32 throughout.
@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_foreach_l2_norm_matches_megatron_fallback(dtype, rel):
    for seed in range(3):
        lists = [_tensors(dtype, seed) + _tensors(dtype, seed + 10)[:3]]  # megatron passes one list
        ours, none = ok.foreach_l2_norm(2048 * 32, torch.zeros(1, dtype=torch.int), lists, False)
        ref, _ = local_multi_tensor_l2_norm(2048 * 32, torch.zeros(1, dtype=torch.int), lists, False)
        assert none is None and ours.shape == (1,) and ours.dtype == torch.float32
        assert ours.device == lists[0][0].device
        assert float(ours) == pytest.approx(float(ref), rel=rel)
        split = ok.foreach_l2_norm(0, None, [lists[0][:4], lists[0][4:]], False)[0]  # several lists: one norm
        assert float(split) == pytest.approx(float(ours), rel=1e-6)
    exact = ok.foreach_l2_norm(0, None, [[torch.tensor(3.0), torch.tensor([4.0])]], False)[0]
    assert float(exact) == 5.0
    for empty in ([[]], [], [[torch.zeros(0)]]):
        norm, _ = ok.foreach_l2_norm(0, torch.zeros(1, dtype=torch.int), empty, False)
        assert norm.shape == (1,) and float(norm) == 0.0


@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_foreach_scale_matches_megatron_fallback_bitwise(src_dtype, dst_dtype, scale):
    # the same ops in the same dtypes (src * scale in src's dtype, cast into dst's): equal bit for bit
    src = _tensors(src_dtype, 1)
    dst_ours = [torch.full_like(t, 9.0, dtype=dst_dtype) for t in src]
    dst_ref = [t.clone() for t in dst_ours]
    ok.foreach_scale(0, None, [src, dst_ours], scale)
    local_multi_tensor_scale(0, None, [src, dst_ref], scale)
    for a, b in zip(dst_ours, dst_ref):
        assert a.dtype == dst_dtype and torch.equal(a, b)
    # in place (the clip: [grads, grads])
    ours, ref = _tensors(src_dtype, 2), _tensors(src_dtype, 2)
    ok.foreach_scale(0, None, [ours, ours], scale)
    local_multi_tensor_scale(0, None, [ref, ref], scale)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    ok.foreach_scale(0, None, [[], []], scale)  # nothing to do


def _adamw_params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(6, 4), (4,), (), (3, 5)]]


def test_fused_adamw_switch_matches_foreach():
    """The switch's mechanics: an AdamW built like megatron's (foreach default) switched to fused by the pre-step
    hook, also after load_state_dict brings back foreach groups with host-side steps. torch has a fused AdamW on the
    CPU; the kernel orders its fp32 math differently: 1e-6 absolute on weights of size ~1 after 3 steps."""
    ref_params, fused_params = _adamw_params(0), _adamw_params(0)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_params, **kw)
    fused = torch.optim.AdamW(fused_params, **kw)
    assert fused.param_groups[0]["fused"] is None
    fused._justrl_fused_hook = fused.register_step_pre_hook(ok._fused_ready)  # what _use_fused_adamw does (CUDA)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in ref_params]
        for ps_ in (ref_params, fused_params):
            for p, gr in zip(ps_, grads):
                p.grad = gr.clone()
        ref.step()
        fused.step()
        assert fused.param_groups[0]["fused"] is True and fused.param_groups[0]["foreach"] is None
        if step == 0:  # a resume from foreach state: groups say foreach, steps are host tensors / numbers
            saved = copy.deepcopy(ref.state_dict())
            saved["state"][2]["step"] = float(saved["state"][2]["step"])
            fused.load_state_dict(saved)
            assert fused.param_groups[0]["fused"] is None  # the saved groups came back ...
            for p, q in zip(ref_params, fused_params):
                q.data.copy_(p.data)
    assert all(torch.is_tensor(s["step"]) and s["step"].dtype == torch.float32 and float(s["step"]) == 3.0
               for s in fused.state.values())  # ... and the hook made them fused-ready again
    for p, q in zip(ref_params, fused_params):
        torch.testing.assert_close(q.data, p.data, rtol=0, atol=1e-6)


def test_install_on_cpu_is_a_no_op(monkeypatch):
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer as mopt
    from justrl_megatron.model.hf_config import ModelShape
    from justrl_megatron.model.policy import Policy
    from helpers import LAUNCHER_ENV

    before = {k: os.environ.get(k) for k in LAUNCHER_ENV}
    shape = ModelShape(family="qwen2", num_layers=1, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                       num_query_groups=2, head_dim=8, vocab_size=120, max_position_embeddings=64, rope_theta=10000.0,
                       rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False, init_std=0.02)
    try:
        policy = Policy.build(shape, dtype="fp32", transformer_impl="local", lr=1e-3, warmup_steps=0, grad_clip=1.0,
                              distributed_optimizer=True, seed=7)
        assert policy.device.type == "cpu"
        assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
        assert clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale
        assert mopt.multi_tensor_scale_impl is utils.local_multi_tensor_scale
        inners = ok._inner_optimizers(policy.optimizer)
        assert inners and all(isinstance(i, torch.optim.AdamW) for i in inners)
        assert all(g["fused"] is None for i in inners for g in i.param_groups)
        assert not any(getattr(i, "_justrl_fused_hook", None) for i in inners)
        assert ok.install_optimizer_kernels(policy.optimizer, torch.device("cpu")) == []
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
