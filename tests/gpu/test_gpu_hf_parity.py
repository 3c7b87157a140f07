"""HF vs Megatron on CUDA, for a tiny random Qwen2 (untied, QKV bias, GQA) and a tiny Llama (tied): logits of padded
rows and logprobs of packed (THD) rows, fp32 tight and bf16 loose, with the local spec's GPU kernels on (varlen flash
in bf16, fused rms_norm, fused SwiGLU). The reference is transformers in fp32 on the CPU (eager attention)."""

import pytest
import torch

from gpu_util import hf_policy, random_samples
from justrl_megatron.convert.verify import hf_logits, megatron_logits, random_tokens
from justrl_megatron.train.step import compute_logprobs

# (logits max |diff| / (1 + max |logit|), packed logprobs max |diff|)
TOL = {"fp32": (1e-4, 1e-4), "bf16": (5e-2, 0.15)}


def _hf_logprobs(hf_dir, samples, weight_dtype):
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logp = torch.log_softmax(hf_logits(hf_dir, ids, weight_dtype=weight_dtype)[0].double(), -1)
        p = len(s.prompt_ids)
        out.append(logp[p - 1:s.length - 1].gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1))
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_hf_vs_megatron_on_cuda(hf_models, family, dtype):
    hf_dir = hf_models[family]
    shape, policy = hf_policy(hf_dir, dtype)
    assert policy.device.type == "cuda" and policy.transformer_impl in ("local", "te")
    assert policy.config.bias_activation_fusion, "the fused SwiGLU should be on for the local spec on CUDA"
    weight_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    logit_tol, lp_tol = TOL[dtype]

    tokens = random_tokens(shape.vocab_size, batch=2, seq_len=48, seed=3)
    ref = hf_logits(hf_dir, tokens, weight_dtype=weight_dtype)
    got = megatron_logits(policy.chunks, tokens, shape.vocab_size)
    assert float((got - ref).abs().max()) / (1 + float(ref.abs().max())) <= logit_tol

    samples = random_samples(shape.vocab_size)
    lp = compute_logprobs(policy, samples, max_tokens_per_micro_batch=256)  # packed rows: the THD path
    ref_lp = _hf_logprobs(hf_dir, samples, weight_dtype)
    assert max(float((a.double() - b).abs().max()) for a, b in zip(lp, ref_lp)) <= lp_tol
