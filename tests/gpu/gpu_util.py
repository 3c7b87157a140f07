"""Helpers of the tests/gpu tests (imported by them and by conftest.py)."""

import importlib.util

import pytest
import torch


def cuda_available() -> bool:
    from justrl_megatron import compat

    return compat.cuda_available()


def require(module: str, reason: str) -> None:
    """Skip (inside the test, so that "needs CUDA" wins where CUDA is absent) when `module` is not importable."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(reason)


def hf_policy(hf_dir, dtype, impl="local", **kw):
    """A Policy on this device holding the weights of an HF folder: (shape, policy)."""
    from transformers import AutoConfig

    from justrl_megatron.convert.load import load_hf_weights
    from justrl_megatron.model.hf_config import model_shape
    from justrl_megatron.model.policy import Policy

    shape = model_shape(AutoConfig.from_pretrained(hf_dir))
    policy = Policy.build(shape, dtype=dtype, transformer_impl=impl, **{"lr": 1e-3, "seed": 1234, **kw})
    load_hf_weights(policy.chunks, hf_dir, progress=False)
    policy.optimizer.reload_model_params()  # mixed precision keeps fp32 master copies
    return shape, policy


def random_samples(vocab, n=6, seed=3):
    """GRPO samples of random tokens (prompt 2-19, response 1-39 tokens)."""
    from justrl_megatron.train.batching import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, r = int(torch.randint(2, 20, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
        ids = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        out.append(Sample(prompt_ids=ids[:p], response_ids=ids[p:], advantage=0.0))
    return out
