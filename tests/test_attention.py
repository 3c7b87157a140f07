"""The local spec's GPU kernel choices, tested where they can be on a CPU: the varlen probe's selection logic (real
candidate functions, real reference), the once-per-micro-batch fallback plan, the two RMSNorm forms, and which
TransformerConfig fusions the local spec asks for. What needs CUDA itself is in tests/gpu/test_gpu_attention.py."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from justrl_megatron import compat
from justrl_megatron.model import attention, spec
from justrl_megatron.model.attention import (PackedPlan, packed_attention, packed_causal_attention, packed_plan,
                                             probe_varlen, varlen_choice)
from justrl_megatron.model.norm import RMSNorm, rms_norm_fused, rms_norm_reference


def _exact(q, k, v, cu, mx, scale):
    return packed_causal_attention(q, k, v, cu, mx, scale)


def _not_causal(q, k, v, cu, mx, scale):  # attends to the whole sequence: what a form that ignores causality does
    outs = []
    bounds = cu.tolist()
    k, v = attention._expand_kv(q, k, v)
    for a, b in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = (x[a:b].transpose(0, 1) for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def _default_scale(q, k, v, cu, mx, scale):  # ignores the scale it was given
    return packed_causal_attention(q, k, v, cu, mx, 1 / math.sqrt(q.size(-1)))


def _unknown_keyword(q, k, v, cu, mx, scale):
    return packed_causal_attention(q, k, v, cu, mx, scale, is_causal=True)


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_probe_takes_the_first_form_that_gives_the_right_answer(heads, groups):
    candidates = [("raises", _unknown_keyword, False), ("not-causal", _not_causal, False),
                  ("default-scale", _default_scale, False), ("exact", _exact, False), ("late", _exact, False)]
    name, fn, errors = probe_varlen(candidates, torch.device("cpu"), torch.float32, heads, groups, 16)
    assert name == "exact" and fn is _exact
    assert errors["raises"].startswith("TypeError")
    assert errors["not-causal"].startswith("wrong answer") and errors["default-scale"].startswith("wrong answer")
    assert "late" not in errors  # never tried


def test_probe_skips_expanded_forms_for_mha_and_reports_none_working():
    candidates = [("not-causal", _not_causal, False), ("expanded", _exact, True)]
    assert probe_varlen(candidates, torch.device("cpu"), torch.float32, 4, 4, 8)[0] is None  # expanded == first
    assert probe_varlen(candidates, torch.device("cpu"), torch.float32, 4, 2, 8)[0] == "expanded"


def test_this_torch_has_the_varlen_forms_but_no_cpu_kernel(monkeypatch, caplog):
    """torch 2.13's varlen_attn exists (so the candidate list is real) but has no CPU flash kernel: every form fails,
    the choice is cached, and the fallback is announced once per process, not per layer or per key."""
    monkeypatch.setattr(attention, "_VARLEN", {})
    monkeypatch.setattr(attention, "_WARNED", set())
    names = [c[0] for c in attention.varlen_candidates()]
    assert names == ["window_size+enable_gqa", "window_size", "window_size+expanded_kv", "is_causal",
                     "is_causal+expanded_kv"]
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        for _ in range(3):
            assert varlen_choice("cpu", torch.bfloat16, 4, 2, 16) == (None, None)
        assert varlen_choice("cpu", torch.float16, 4, 4, 16) == (None, None)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "NotImplementedError" in warnings[0].getMessage()
    assert len(attention._VARLEN) == 2


def test_fallback_plan_once_per_micro_batch():
    from megatron.core.packed_seq_params import PackedSeqParams

    g = torch.Generator().manual_seed(4)
    lens = [6, 2, 9]
    cu = torch.tensor([0, 6, 8, 17], dtype=torch.int32)
    q, k, v = (torch.randn(17, n, 8, generator=g) for n in (4, 2, 2))
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    assert packed_plan(psp, cu)._bounds is None  # nothing read on the host until the fallback needs it
    plans, outs = [], []
    for _layer in range(3):  # what SDPAttention does in every layer of one micro-batch
        outs.append(packed_attention(q, k, v, psp, 0.3))
        plans.append(packed_plan(psp, cu))
    assert plans[0] is plans[1] is plans[2] and plans[0].bounds == [0, 6, 8, 17] and plans[0].lengths == lens
    assert all(torch.equal(o, packed_causal_attention(q, k, v, cu, 9, 0.3)) for o in outs)  # same numbers
    cu2 = cu.clone()  # the next micro-batch (a new tensor) never sees the old bounds
    assert packed_plan(psp, cu2) is not plans[0]
    stale = PackedPlan(torch.tensor([0, 17], dtype=torch.int32))
    assert torch.equal(packed_causal_attention(q, k, v, cu, 9, 0.3, plan=stale), outs[0])  # a foreign plan is ignored


def test_rms_norm_cpu_form_is_the_reference_and_the_fused_form_agrees():
    class Cfg:
        params_dtype, sequence_parallel = torch.bfloat16, False

    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(Cfg(), 96, eps=1e-6)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(96, generator=g).bfloat16())
    x = (3 * torch.randn(40, 96, generator=g)).bfloat16()
    ref = rms_norm_reference(x, norm.weight, 1e-6)
    assert torch.equal(norm(x), ref)  # the CPU keeps the HF formula bitwise
    fused = rms_norm_fused(x, norm.weight, 1e-6)  # what CUDA runs (same torch op, CPU kernel here)
    assert fused.dtype == torch.bfloat16
    assert ((fused.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs() + 1e-6).all()  # one bf16 rounding
    x32, w32 = x.float(), norm.weight.detach().float()
    assert (rms_norm_fused(x32, w32, 1e-6) - rms_norm_reference(x32, w32, 1e-6)).abs().max() < 1e-6


def _shape():
    from justrl_megatron.model.hf_config import model_shape
    from transformers import Qwen2Config

    return model_shape(Qwen2Config(architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=256))


@pytest.mark.skipif(compat.cuda_available(), reason="checks the CPU choice; tests/gpu checks the CUDA one")
def test_local_spec_fusions_stay_off_on_cpu():
    from justrl_megatron.model.spec import gpu_fusions

    assert gpu_fusions("local") == {}  # CPU: plain ops, bitwise as the CPU tests expect
    assert gpu_fusions("te") == dict(apply_rope_fusion=True, bias_activation_fusion=True)


def test_the_fusion_flags_exist_in_this_megatron():
    from justrl_megatron.model.hf_config import transformer_config

    cfg = transformer_config(_shape(), bias_activation_fusion=True)  # the fused SwiGLU passes validation
    assert cfg.bias_activation_fusion and cfg.gated_linear_unit and cfg.activation_func is F.silu


@pytest.mark.skipif(spec.te_available(), reason="TransformerEngine present: fused RoPE is available")
def test_fused_rope_needs_transformer_engine():
    from justrl_megatron.model.hf_config import transformer_config

    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):  # why the local spec keeps it off
        transformer_config(_shape(), apply_rope_fusion=True)


@pytest.mark.slow
def test_fused_swiglu_check_compiles_and_agrees_on_cpu():
    """The same check that gates bias_activation_fusion on CUDA, run on the CPU (inductor's C++ backend)."""
    from justrl_megatron.model.spec import fused_swiglu_check

    assert fused_swiglu_check("cpu") is None
