"""Shared-prompt updates on CUDA (megatron-core 0.19 there): tests/mp/shared_prompt_parity.py on the device, where
the gathered rows go through the varlen flash path in bf16 and megatron 0.19's THD RoPE takes the per-token
frequencies. fp32 must match the unshared update as on the CPU; bf16 within bf16 rounding."""

import pytest

from helpers import rank_verdicts, run_mp


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    out = tmp_path_factory.mktemp("shared_prompt_gpu")
    run_mp("shared_prompt_parity.py", out, "one", nproc=1)
    run_mp("shared_prompt_parity.py", out, "one_bf16", nproc=1)
    return rank_verdicts(out, 1, prefix="one_rank")[0], rank_verdicts(out, 1, prefix="one_bf16_rank")[0]


@pytest.mark.parametrize("shape", ["qwen", "llama"])
def test_fp32_shared_prompt_update_equals_unshared_on_cuda(verdicts, shape):
    v = verdicts[0]["tp1"][shape]
    assert v["start_diff"] == 0.0 and v["shared_micro_batches"] >= 1, v
    assert v["logprob_diff"] <= 1e-5 and v["metrics_diff"] <= 1e-5, v
    assert v["grad_diff"] <= 1e-5 and v["weight_diff"] <= 1e-5 and v["weight_moved"] > 1e-5, v


@pytest.mark.parametrize("shape", ["qwen", "llama"])
def test_bf16_shared_prompt_update_stays_close_on_cuda(verdicts, shape):
    v = verdicts[1]["tp1_bf16"][shape]
    assert v["start_diff"] == 0.0 and v["shared_micro_batches"] >= 1, v
    assert v["logprob_diff"] < 0.05 and v["metrics_diff"] < 1e-2, v
    assert v["grad_diff"] <= 0.05 * max(v["grad_norm"], 1e-3), v
