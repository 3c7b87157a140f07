"""RMSNorm usable in the local (non-TransformerEngine) spec, also with sequence parallelism.

megatron's `WrappedTorchNorm` asserts that sequence parallel is off. Under SP each TP rank normalises a different slice
of the sequence, so the norm weight's gradient is partial per rank; tagging the weight `sequence_parallel=True` makes
megatron's `finalize_model_grads` all-reduce it over the TP group, which keeps the gradients right.

Two numerically equivalent forms: on the CPU the HF formula as written (fp32 normalise, cast back, scale; the CPU
tests rely on it bitwise); on CUDA `torch.nn.functional.rms_norm`, one fused kernel (torch >= 2.8) that accumulates in
fp32 and rounds once at the end instead of twice (equal to the HF form within bf16 rounding), instead of ~6 kernels
and an fp32 copy of the activations per norm.
"""

import torch
import torch.nn.functional as F

from .exact import FP32_SUM
from .exact import rms_norm as exact_rms_norm


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As HF Qwen2/Llama: normalise in fp32, cast back, then scale (matters in bf16).
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),), weight, eps)


class RMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(x, FP32_SUM):  # rollout.exact's log-prob pass: the engine's fused add + norm (model/exact.py)
            return exact_rms_norm(x, self.weight, self.eps)
        if x.is_cuda and x.dtype == self.weight.dtype:  # mixed dtypes keep the reference form's promotion rules
            return rms_norm_fused(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)
