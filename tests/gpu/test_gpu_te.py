"""TransformerEngine spec vs local spec on CUDA, from the same HF weights: logits of padded rows and logprobs of
packed (THD) rows. Skips with "needs transformer-engine" where TE is not importable (the lent GPU box has none)."""

import pytest
import torch

from gpu_util import hf_policy, random_samples, require
from justrl_megatron.convert.verify import megatron_logits, random_tokens
from justrl_megatron.train.step import compute_logprobs

TOL = {"fp32": (2e-3, 2e-3), "bf16": (5e-2, 0.15)}  # (logits relative, logprobs absolute)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_te_spec_matches_local_spec(hf_models, family, dtype):
    require("transformer_engine", "needs transformer-engine")
    shape, local = hf_policy(hf_models[family], dtype, "local")
    _, te = hf_policy(hf_models[family], dtype, "te")
    assert (local.transformer_impl, te.transformer_impl) == ("local", "te")
    logit_tol, lp_tol = TOL[dtype]
    tokens = random_tokens(shape.vocab_size, batch=2, seq_len=48, seed=5)
    a, b = (megatron_logits(p.chunks, tokens, shape.vocab_size) for p in (local, te))
    assert float((a - b).abs().max()) / (1 + float(a.abs().max())) <= logit_tol
    samples = random_samples(shape.vocab_size, seed=6)
    lp_local, lp_te = (compute_logprobs(p, samples, max_tokens_per_micro_batch=256) for p in (local, te))
    assert max(float((x - y).abs().max()) for x, y in zip(lp_local, lp_te)) <= lp_tol
    assert all(torch.isfinite(x).all() for x in lp_te)
