"""The memory plan (model/memory.py) against the allocator: the peak of bf16 updates of 16,384 tokens (the second of
two: Adam's state alive during backward, as in every step after the first) on a
4-layer model of the 1.5B's width must stay below the plan's prediction, and the plan must not be wildly pessimistic
(prediction <= 1.5 x measured), without and with full recompute. The plan follows the kernels that run there
(`gpu_kernels`: the fused SwiGLU and F.rms_norm on CUDA). Measured in a fresh subprocess (tests/gpu/memory_peak.py)
so that nothing else counts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
TOKENS = 16384


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_one_update_fits_the_memory_plan(recompute, tmp_path):
    from justrl_megatron.model.memory import estimate_peak_bytes, gpu_kernels
    from memory_peak import SHAPE

    proc = subprocess.run([sys.executable, str(HERE / "memory_peak.py"), str(tmp_path), recompute, str(TOKENS)],
                          capture_output=True, text=True, timeout=900, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    m = json.loads((tmp_path / f"peak_{recompute}.json").read_text())
    assert m["num_micro_batches"] == 1 and m["grad_norm"] > 0
    assert m["bias_activation_fusion"], "the plan assumes the fused SwiGLU the local spec turns on on CUDA"
    predicted = estimate_peak_bytes(SHAPE, tokens=TOKENS, recompute=recompute, tp=1, pp=1, dp=1,
                                    dtype=torch.bfloat16, sequence_parallel=False, distributed_optimizer=True,
                                    impl="local", kernels=gpu_kernels("local"))
    gib = {"measured_gib": m["peak_bytes"] / 2**30, "predicted_gib": predicted / 2**30, **m}
    assert m["peak_bytes"] <= predicted, gib  # the plan must never promise a fit that OOMs
    assert predicted <= 1.5 * m["peak_bytes"], gib  # nor waste the GPU
