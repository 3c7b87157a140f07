"""Grouped MoE experts on CUDA (model/grouped_experts.py, model.moe_grouped_gemm): torch's grouped bf16 kernels give
the sequential experts' logits and gradients within the CPU test's bf16 bound (tests/test_grouped_experts.py), and a
grouped policy's update tracks the sequential one's (bench/update_ab.py's tolerance, as gpu_check's `moe` stage)."""

import torch

from test_grouped_experts import BF16_TOL, TINY_MOE, _logits_and_grads, _pair
from justrl_megatron.model.hf_config import ModelShape


def test_grouped_experts_equal_the_sequential_experts_on_cuda():
    shape, (sequential, grouped) = _pair(torch.bfloat16)
    assert next(grouped.parameters()).is_cuda
    tokens = torch.randint(0, shape.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_grads = _logits_and_grads(sequential, tokens)
    got_logits, got_grads = _logits_and_grads(grouped, tokens)
    assert ref_grads.keys() == got_grads.keys()
    assert (got_logits - ref_logits).abs().max() <= BF16_TOL * (1 + ref_logits.abs().max())
    for name, ref in ref_grads.items():
        assert (got_grads[name] - ref).abs().max() <= BF16_TOL * (1 + ref.abs().max()), name


def test_a_grouped_policy_tracks_the_sequential_one_over_updates():
    from justrl_megatron.bench import update_ab

    shape = ModelShape(**{**TINY_MOE, "hidden_size": 128, "num_experts": 8, "moe_ffn_hidden_size": 64})
    small = dict(updates=5, count=2, length=256, prompt_len=16, lr=1e-4)
    ref = update_ab.trajectory(shape, moe_grouped_gemm=False, **small)
    got = update_ab.trajectory(shape, moe_grouped_gemm=True, **small)
    assert update_ab.compare(ref, got, **update_ab.TOLERANCES["moe_grouped_gemm"])["ok"], (ref, got)
