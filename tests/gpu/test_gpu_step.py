"""One GRPO step on CUDA matches the same step on the CPU (fp32: logprobs, loss, grad norm, gradients), and the bf16
step with the GPU kernels stays close to it. Both sides run tests/gpu/step_device.py in a subprocess (the CPU side
with CUDA hidden, so that compat's CPU path runs) from the same weights and old logprobs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
SHAPES = ["qwen", "llama"]


def _run(out, side):
    env = {**os.environ, "OMP_NUM_THREADS": "4"}
    if side == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, str(HERE / "step_device.py"), str(out), side], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out / f"{side}.pt")


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_device")
    cpu = _run(out, "cpu")
    return cpu, _run(out, "cuda")


def _max_diff(a, b):
    return max(float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_step_on_cuda_matches_cpu(sides, shape):
    cpu, cuda = sides[0][shape], sides[1][shape]
    assert cpu["device"] == "cpu" and cuda["device"].startswith("cuda")
    assert not cpu["bias_activation_fusion"] and cuda["bias_activation_fusion"]
    assert _max_diff(cuda["logprobs"], cpu["logprobs"]) <= 1e-4
    m, ref = cuda["metrics"], cpu["metrics"]
    assert m["loss"] == pytest.approx(ref["loss"], abs=1e-5)
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)
    for key in ("clip_frac_low", "clip_frac_high", "clip_frac_dual", "num_response_tokens"):
        assert m[key] == ref[key], key  # no token crossed a clip boundary between devices
    scale = max(float(g.abs().max()) for g in cpu["grads"].values())
    assert scale > 1e-3
    worst = max(float((cuda["grads"][k] - g).abs().max()) for k, g in cpu["grads"].items())
    assert worst <= 1e-3 * scale


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_step_with_gpu_kernels_stays_close(sides, shape):
    cpu, bf16 = sides[0][shape], sides[1][shape + "_bf16"]
    assert bf16["bias_activation_fusion"]
    if shape == "qwen":  # head_dim 16: packed rows ran through varlen flash (llama's head_dim 12 may not be a
        assert bf16["varlen"] is not None  # flash size: either path is exact, the numbers below hold for both)
    assert _max_diff(bf16["logprobs"], cpu["logprobs"]) < 0.05
    assert bf16["metrics"]["loss"] == pytest.approx(cpu["metrics"]["loss"], abs=1e-3)
    assert bf16["metrics"]["grad_norm"] == pytest.approx(cpu["metrics"]["grad_norm"], rel=0.02)
