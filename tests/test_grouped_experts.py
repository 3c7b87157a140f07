"""Grouped MoE experts (model/grouped_experts.py, model.moe_grouped_gemm) compute what megatron's sequential experts
compute: a real megatron GPTModel with MoE layers built both ways from the same weights, logits and every
parameter's gradient compared (fp32: bit for bit; bf16: within the bounds below). tests/gpu/test_gpu_grouped_experts.py
checks the same on CUDA, where the grouped kernel is CUTLASS's."""

import pytest
import torch

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)
from justrl_megatron.model.hf_config import ModelShape

# Qwen3-MoE-like: q/k norms, 6 experts top-2 (one expert gets no token in some batches), GQA
TINY_MOE = dict(family="qwen3_moe", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                num_query_groups=2, head_dim=8, vocab_size=97, max_position_embeddings=128, rope_theta=10000.0,
                rms_norm_eps=1e-6, qkv_bias=False, tie_word_embeddings=False, init_std=0.05, qk_norm=True,
                num_experts=6, moe_top_k=2, moe_ffn_hidden_size=16)
# bf16: logits within this of 1 + max |logit|, gradients within this of 1 + max |gradient| (one bf16 rounding of
# each matmul output, in another summation order, through two layers)
BF16_TOL = 2e-2


def _pair(dtype):
    """(sequential, grouped) GPTModels with identical weights, on this machine's device."""
    from justrl_megatron.distributed import init_distributed, init_model_parallel
    from justrl_megatron.model.build import build_model_chunks
    from justrl_megatron.model.grouped_experts import grouped_experts_module
    from justrl_megatron.model.hf_config import transformer_config

    shape = ModelShape(**TINY_MOE)
    init_distributed()
    init_model_parallel(tp=1, pp=1, seed=7)
    config = transformer_config(shape, dtype=dtype, bf16=dtype == torch.bfloat16, params_dtype=dtype)
    models = [build_model_chunks(shape, config, transformer_impl="local", moe_grouped_gemm=grouped)[0]
              for grouped in (False, True)]
    models[1].load_state_dict(models[0].state_dict())
    experts = [layer.mlp.experts for layer in models[1].decoder.layers]
    assert all(type(e) is grouped_experts_module() for e in experts)
    assert [type(layer.mlp.experts).__name__ for layer in models[0].decoder.layers] == ["SequentialMLP"] * 2
    assert models[0].state_dict().keys() == models[1].state_dict().keys()  # same names: converters, checkpoints
    return shape, models


def _logits_and_grads(model, tokens):
    """Logits of `tokens` and every parameter's gradient of a fixed random projection of them (on the model's
    device; also tests/gpu/test_gpu_grouped_experts.py's)."""
    model.zero_grad()
    tokens = tokens.to(next(model.parameters()).device)
    pos = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0).expand_as(tokens)
    logits = model(tokens, pos, attention_mask=None).float()
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)).to(logits.device)
    (logits * w).sum().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_experts_equal_the_sequential_experts(dtype, monkeypatch):
    shape, (sequential, grouped) = _pair(dtype)
    tokens = torch.randint(0, shape.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_grads = _logits_and_grads(sequential, tokens)
    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    got_logits, got_grads = _logits_and_grads(grouped, tokens)
    assert len(calls) == 2 * shape.num_layers  # fc1 and fc2 of every layer, one call each
    assert ref_grads.keys() == got_grads.keys()
    assert any("experts.local_experts.5.linear_fc1" in n for n in ref_grads)  # every expert has a gradient
    if dtype == torch.float32:
        assert torch.equal(got_logits, ref_logits)
        for name in ref_grads:
            assert torch.equal(got_grads[name], ref_grads[name]), name
        return
    assert (got_logits - ref_logits).abs().max() <= BF16_TOL * (1 + ref_logits.abs().max())
    for name, ref in ref_grads.items():
        assert (got_grads[name] - ref).abs().max() <= BF16_TOL * (1 + ref.abs().max()), name


@pytest.mark.parametrize("align", [1, 16])
def test_the_stacked_weights_are_not_kept_for_backward(align):
    """The stack the grouped matmul multiplies by is rebuilt in backward, not saved: what the forward keeps is the
    tokens and activations, not [experts, out, in] copies of the weights; the output and gradients equal per-expert
    matmuls, also with every group padded to 16 rows as on CUDA (an empty expert included)."""
    from justrl_megatron.model.grouped_experts import grouped_swiglu_experts

    g = torch.Generator().manual_seed(0)
    experts, hidden, ffn, tokens = 4, 16, 8, 11
    fc1 = [(torch.randn(2 * ffn, hidden, generator=g) * 0.1).requires_grad_() for _ in range(experts)]
    fc2 = [(torch.randn(hidden, ffn, generator=g) * 0.1).requires_grad_() for _ in range(experts)]
    x = torch.randn(tokens, hidden, generator=g).requires_grad_()
    probs = torch.rand(tokens, generator=g)
    counts = torch.tensor([3, 0, 5, 3])

    def act(inter, p):
        gate, up = inter.chunk(2, -1)
        return torch.nn.functional.silu(gate) * up * p.unsqueeze(-1)

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = grouped_swiglu_experts(x, counts, probs, fc1, fc2, act, align=align)  # 16: CUDA's padded groups
    assert (experts, hidden, 2 * ffn) not in saved and (experts, ffn, hidden) not in saved
    out.backward(torch.ones_like(out))
    grads = [x.grad] + [w.grad for w in fc1 + fc2]
    for t in [x] + fc1 + fc2:
        t.grad = None
    bounds = [0, 3, 3, 8, 11]
    ref = torch.cat([act(x[a:b] @ fc1[e].t(), probs[a:b]) @ fc2[e].t() for e, (a, b) in
                     enumerate(zip(bounds[:-1], bounds[1:]))])
    ref.backward(torch.ones_like(ref))
    assert torch.allclose(out, ref, atol=1e-6)
    for got, t in zip(grads, [x] + fc1 + fc2):
        assert torch.allclose(got, t.grad, atol=1e-6)


def test_grouped_experts_are_refused_where_they_cannot_run(tmp_path):
    from justrl_megatron.config import compose
    from justrl_megatron.model import grouped_experts

    dense = ModelShape(**{**TINY_MOE, "family": "qwen3", "num_experts": 0, "moe_top_k": 0, "moe_ffn_hidden_size": 0})
    cfg = compose(["model.moe_grouped_gemm=true", "model.transformer_impl=local"])
    assert grouped_experts.problems(cfg, ModelShape(**TINY_MOE)) == []
    assert "needs an MoE model" in grouped_experts.problems(cfg, dense)[0]
    cfg = compose(["model.moe_grouped_gemm=true", "model.transformer_impl=local", "model.lora.enabled=true",
                   "model.lora.targets=[qkv,fc1]"])
    assert "LoRA adapters on the experts" in grouped_experts.problems(cfg, ModelShape(**TINY_MOE))[0]
    assert grouped_experts.problems(compose([]), dense) == []  # off: nothing to say
