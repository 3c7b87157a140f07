"""FP8 linears on a Hopper GPU (model/fp8.py, model.fp8): cuBLASLt's rowwise-scaled e4m3 matmuls give the
dequantized reference within one bf16 rounding, a ragged token count included; an FP8 policy's logprobs and updates
track the bf16 policy's (bench/update_ab.py's tolerance, as gpu_check's `fp8` stage). Elsewhere model.fp8 is refused
(tests/test_fp8.py) and these skip."""

import pytest
import torch

from justrl_megatron.model import fp8


@pytest.fixture(autouse=True)
def _hopper():
    why = fp8.hopper_problem()
    if why:
        pytest.skip(why)


def test_fp8_linear_on_cuda_equals_the_dequantized_reference():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 1536, device="cuda", generator=g).bfloat16().requires_grad_()  # 1000: padded to 1008
    w = (torch.randn(2048, 1536, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    y = fp8.fp8_linear(x, w)
    gy = torch.randn(y.shape, device="cuda", generator=g).bfloat16()
    y.backward(gy)
    for got, ref in ((y, fp8.reference_matmul(x.detach(), w.detach().t(), torch.bfloat16)),
                     (x.grad, fp8.reference_matmul(gy, w.detach(), torch.bfloat16)),
                     (w.grad, fp8.reference_matmul(gy.t(), x.detach(), torch.bfloat16))):
        assert (got.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()  # one bf16 rounding
    exact = x.detach().float() @ w.detach().float().t()
    assert (y.float() - exact).norm() / exact.norm() <= 0.08


def test_an_fp8_policy_tracks_the_bf16_one_over_updates():
    from justrl_megatron.bench import update_ab
    from justrl_megatron.bench.train import BUILTIN_SHAPES

    small = dict(updates=5, count=2, length=512, prompt_len=32, lr=1e-4)
    ref = update_ab.trajectory(BUILTIN_SHAPES["tiny"], fp8=False, **small)
    got = update_ab.trajectory(BUILTIN_SHAPES["tiny"], fp8=True, **small)
    assert update_ab.compare(ref, got, **update_ab.TOLERANCES["fp8"])["ok"], (ref, got)
