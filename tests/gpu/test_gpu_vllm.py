"""The colocated vLLM cycle on CUDA: generate -> sleep -> update -> sync -> wake -> generate (tests/gpu/vllm_cycle.py,
in a subprocess: vLLM patches torch globally). Skips with "needs vllm" where vLLM is not importable."""

import json
import os
import subprocess
import sys
from pathlib import Path

from gpu_util import require

HERE = Path(__file__).resolve().parent


def _run(script: str, hf_dir, tmp_path: Path, written: str) -> dict:
    """tests/gpu/SCRIPT HF_DIR TMP in a subprocess (vLLM patches torch globally); the JSON it wrote."""
    require("vllm", "needs vllm")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(tmp_path / "vllm_cache")}
    proc = subprocess.run([sys.executable, str(HERE / script), str(hf_dir), str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((tmp_path / written).read_text())


def test_colocated_cycle(hf_models, tmp_path):
    v = _run("vllm_cycle.py", hf_models["qwen2"], tmp_path, "cycle.json")
    assert v["v0_version"] == 0 and v["v1_version"] == 1
    assert v["freed_by_sleep_gib"] > 1.0, v  # KV cache (30% of the GPU) and weights released while training
    assert v["asleep_after_wake"] == []
    # bf16 on both sides: vLLM's sampled-token logprobs match the trainer's before and after the sync ...
    assert v["gap_v0"]["logprob_diff_mean"] < 0.05 and v["gap_v1"]["logprob_diff_mean"] < 0.05, v
    # ... and the update moved the policy away from what the engine sampled with, which the sync then followed
    assert v["gap_before_sync"]["logprob_diff_mean"] > 3 * v["gap_v1"]["logprob_diff_mean"], v
    assert v["sync"]["bytes"] > 0 and v["grad_norm"] > 0


def test_exact_mode_on_gpu_a_batch_invariant_engine_and_a_deterministic_trainer(hf_models, tmp_path):
    """Issue 64, item 5, written for the day vLLM runs on the lent GPU (tests/gpu/vllm_exact.py): rollout.exact puts
    the engine in vLLM's batch-invariant mode and megatron in its deterministic settings. After a GRPO update and a
    sync, a group sampled alone gets the same tokens and the same log-probs, to the bit, as inside the batch; the
    trainer's log-prob pass gives the same values twice; the trainer vs engine gap (the trainer's GPU kernels are
    not the engine's: docs/numerics.md) stays within the default path's bf16 bound."""
    v = _run("vllm_exact.py", hf_models["qwen2"], tmp_path, "exact.json")
    assert v["batch_invariant_env"] == "1" and v["grad_norm"] > 0, v
    assert v["engine_alone_vs_batch"]["same_tokens"] and v["engine_alone_vs_batch"]["max_abs"] == 0.0, v
    assert v["trainer_repeat_max_abs"] == 0.0, v
    assert v["gap_v1"]["logprob_diff_mean"] < 0.05, v
