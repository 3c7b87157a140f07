"""The FP8 linear layers (model/fp8.py, model.fp8): the math against a dequantize-then-matmul reference (torch's CPU
build runs `torch._scaled_mm` with rowwise scales too), the layers in a real megatron GPTModel, and the refusal on
anything but a Hopper GPU, in one line before the model loads. tests/gpu/test_gpu_fp8.py runs them on the H200."""

import pytest
import torch

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)
from justrl_megatron.model import fp8
from justrl_megatron.model.hf_config import ModelShape

# e4m3 keeps 3 mantissa bits: an output of K products carries ~2^-4 relative error per operand, averaged over K
FP8_REL = 0.08  # |fp8 - bf16| / |bf16| over a whole output (measured 0.035 at K=64)


def _inputs(rows=37, k=64, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    w[3, 5] = 4.0  # an outlier costs precision in its own row only
    return x, w


def test_rowwise_quantization_scales_each_row_to_the_e4m3_range():
    x, _ = _inputs()
    q, scale = fp8.quantize(x, dim=1)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (x.size(0), 1) and scale.dtype == torch.float32
    assert torch.allclose(q.float().abs().amax(1), torch.full((x.size(0),), fp8.E4M3_MAX))
    assert ((q.float() * scale - x.float()).abs() <= x.float().abs() * 2 ** -3 + 1e-6).all()  # half an e4m3 step


def test_fp8_linear_computes_the_dequantized_reference_exactly_and_bf16_within_tolerance():
    x, w = _inputs()
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    bias = torch.randn(w.size(0)).bfloat16()
    y = fp8.fp8_linear(xx.view(37, 1, 64), ww, bias)  # megatron's [s, b, h]; 37 rows padded to 48 inside
    assert y.shape == (37, 1, 48) and y.dtype == torch.bfloat16
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    y.backward(g)
    g2 = g.view(37, 48)
    assert torch.equal(y.view(37, 48), fp8.reference_matmul(x, w.t(), torch.bfloat16) + bias)
    assert torch.equal(xx.grad.view(37, 64), fp8.reference_matmul(g2, w, torch.bfloat16))
    assert torch.equal(ww.grad, fp8.reference_matmul(g2.t(), x, torch.bfloat16))
    exact = x.float() @ w.float().t() + bias.float()
    assert (y.view(37, 48).float() - exact).norm() / exact.norm() <= FP8_REL
    assert (ww.grad.float() - g2.float().t() @ x.float()).norm() / (g2.float().t() @ x.float()).norm() <= FP8_REL


TINY = dict(family="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
            num_query_groups=2, head_dim=16, vocab_size=96, max_position_embeddings=64, rope_theta=10000.0,
            rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False, init_std=0.05)


def test_the_local_spec_puts_fp8_linears_in_the_decoder_and_keeps_its_weights():
    from justrl_megatron.distributed import init_distributed, init_model_parallel
    from justrl_megatron.model.build import build_model_chunks
    from justrl_megatron.model.hf_config import transformer_config

    shape = ModelShape(**TINY)
    init_distributed()
    init_model_parallel(tp=1, pp=1, seed=5)
    config = transformer_config(shape, dtype=torch.bfloat16, bf16=True, params_dtype=torch.bfloat16)
    plain, quantized = (build_model_chunks(shape, config, transformer_impl="local", fp8=on)[0] for on in (False, True))
    quantized.load_state_dict(plain.state_dict())
    column, row = fp8.fp8_linear_classes()
    layer = quantized.decoder.layers[0]
    assert isinstance(layer.self_attention.linear_qkv, column) and isinstance(layer.mlp.linear_fc2, row)
    assert type(plain.decoder.layers[0].mlp.linear_fc1).__name__ == "ColumnParallelLinear"
    assert all(p.dtype == torch.bfloat16 for p in quantized.parameters())  # weights (and what vLLM gets) stay bf16
    tokens = torch.randint(0, shape.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40).unsqueeze(0)
    out = {}
    for name, model in (("bf16", plain), ("fp8", quantized)):
        logits = model(tokens, pos, attention_mask=None).float()
        logits.square().mean().backward()
        out[name] = (logits.detach(), model.decoder.layers[0].mlp.linear_fc1.weight.grad.float())
    (ref, ref_grad), (got, got_grad) = out["bf16"], out["fp8"]
    assert (got - ref).norm() / ref.norm() <= FP8_REL
    assert (got_grad - ref_grad).norm() / ref_grad.norm() <= 2 * FP8_REL  # through two layers of FP8 backward


def test_fp8_is_refused_without_a_hopper_gpu_in_one_line_before_the_model_loads():
    from justrl_megatron.config import ConfigError, compose, validate

    cfg = compose(["model.fp8=true"])
    found = fp8.problems(cfg)
    assert len(found) == 1 and "needs an NVIDIA Hopper GPU" in found[0] and "model.fp8=false" in found[0]
    with pytest.raises(ConfigError, match="model.fp8=true needs an NVIDIA Hopper GPU"):
        validate(cfg, world_size=1)
    cfg = compose(["model.fp8=true", "parallel.tensor=2", "model.dtype=fp32", "model.lora.enabled=true"])
    said = "\n".join(fp8.problems(cfg))
    assert "parallel.tensor=1" in said and "model.dtype=bf16" in said and "model.lora" in said
    assert fp8.problems(compose([])) == []


def test_fp8_and_grouped_experts_are_local_spec_settings(monkeypatch):
    """Where TransformerEngine would build the model (transformer_impl auto with TE, or te), both are refused in one
    line each, by the spec's TE check (TE has its own FP8 recipes and grouped experts)."""
    from justrl_megatron.config import compose
    from justrl_megatron.model import spec

    monkeypatch.setattr(spec, "te_available", lambda: True)
    cfg = compose(["model.fp8=true", "model.moe_grouped_gemm=true"])
    lines = [p for p in spec.transformer_engine_problems(cfg) if "local spec's" in p]
    assert len(lines) == 2 and all(p.endswith("set model.transformer_impl=local") for p in lines)
    assert not [p for p in spec.transformer_engine_problems(compose(["model.fp8=true", "model.transformer_impl=local"]))
                if "local spec's" in p]
