"""RMSNorm usable in the local (non-TransformerEngine) spec, also with sequence parallelism.

megatron's `WrappedTorchNorm` asserts that sequence parallel is off. Under SP each TP rank normalises a different slice
of the sequence, so the norm weight's gradient is partial per rank; tagging the weight `sequence_parallel=True` makes
megatron's `finalize_model_grads` all-reduce it over the TP group, which keeps the gradients right.
"""

import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As HF Qwen2/Llama: normalise in fp32, cast back, then scale (matters in bf16).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
