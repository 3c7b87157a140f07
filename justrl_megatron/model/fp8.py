"""FP8 linear layers for the local spec (`model.fp8=true`): the decoder's matmuls in float8 with rowwise scaling.

Each of the three matmuls of a linear layer (forward y = x W^T, input gradient dx = dy W, weight gradient
dW = dy^T x) runs as one `torch._scaled_mm` on e4m3 operands. Every operand is scaled along the dimension the matmul
sums over, one fp32 scale per row or column (rowwise scaling, as torchao's `rowwise` float8 recipe): a row's
largest magnitude maps to e4m3's largest finite value, 448, so one outlier costs precision in its own row only.
The product is rescaled by the two scale vectors inside the kernel and comes out in the input's dtype (bf16).
What stays as it was: the weights and their fp32 master copies, the optimizer, the gradient buffers (dW is
returned in the weight's dtype, as megatron's own linear returns it), the log-prob head and embeddings (not decoder
linears), MoE experts (model/grouped_experts.py), and the weights sent to vLLM (the bf16 parameters themselves).

`torch._scaled_mm` with rowwise scales needs an NVIDIA Hopper GPU (compute capability 9.x) on CUDA; torch's CPU
build runs the same op (the CPU tests check the math against a dequantize-then-matmul reference). `problems` refuses
model.fp8 elsewhere, and where the layer would not run (TP > 1, LoRA), in one line each before the model loads.
"""

from __future__ import annotations

import functools

import torch

from .. import compat

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
ALIGN = 16  # cuBLASLt's fp8 GEMMs take dimensions that are multiples of 16: the token count is padded to it
_TINY = 1e-12  # an all-zero row keeps a finite scale


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale in e4m3, scale in fp32) with one scale per slice along `dim` (keepdim): amax / 448."""
    scale = x.detach().abs().amax(dim=dim, keepdim=True).float().clamp_min(_TINY) / E4M3_MAX
    return (x.float() / scale).to(E4M3), scale


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (the layout `_scaled_mm` takes for its second operand)."""
    return t.t().contiguous().t()


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] @ b [K, N] with both operands in e4m3, a scaled per row and b per column (over K)."""
    aq, sa = quantize(a, dim=1)  # [M, 1]
    bq, sb = quantize(b, dim=0)  # [1, N]
    return torch._scaled_mm(aq.contiguous(), _column_major(bq), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def reference_matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """What `scaled_matmul` computes, written out: dequantized operands multiplied in fp32 (the CPU tests' answer)."""
    aq, sa = quantize(a, dim=1)
    bq, sb = quantize(b, dim=0)
    return ((aq.float() * sa) @ (bq.float() * sb)).to(out_dtype)


class _FP8Linear(torch.autograd.Function):
    """y = x W^T with all three matmuls in FP8; saves x and W as they are (bf16), like megatron's linear."""

    @staticmethod
    def forward(ctx, x2d, weight):
        ctx.save_for_backward(x2d, weight)
        return scaled_matmul(x2d, weight.t(), x2d.dtype)

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = scaled_matmul(grad, weight, x2d.dtype) if ctx.needs_input_grad[0] else None
        grad_w = scaled_matmul(grad.t(), x2d, weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) with FP8 matmuls; the token count padded to a multiple of 16 with zero
    rows (a zero row changes no column's scale and no other row's result)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2d = x.reshape(-1, k)
    rows = x2d.size(0)
    pad = -rows % ALIGN
    if pad:
        x2d = torch.cat([x2d, x2d.new_zeros(pad, k)])
    y = _FP8Linear.apply(x2d, weight)[:rows]
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.size(0))


class _FP8Forward:
    """`_forward_impl` of megatron's Column/RowParallelLinear (the one call both make for their matmul) in FP8. Only
    what model.fp8 allows reaches it (TP 1, trainable weights, no gradient-accumulation fusion): anything else is a
    configuration `problems` should have refused, and is said here rather than computed otherwise."""

    def _forward_impl(self, input, weight, bias=None, *args, **kwargs):
        unsupported = [k for k in ("allreduce_dgrad", "sequence_parallel", "gradient_accumulation_fusion")
                       if kwargs.get(k)]
        if unsupported or not weight.requires_grad:
            raise RuntimeError(f"model.fp8: the FP8 linear runs at parallel.tensor=1 with trainable weights "
                               f"(got {unsupported or 'a frozen weight'})")
        return fp8_linear(input, weight, bias)


@functools.lru_cache(maxsize=None)
def fp8_linear_classes():
    """(column-parallel, row-parallel) linear classes whose matmuls run in FP8 (megatron's, same parameters)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    class FP8ColumnParallelLinear(_FP8Forward, ColumnParallelLinear):
        pass

    class FP8RowParallelLinear(_FP8Forward, RowParallelLinear):
        pass

    return FP8ColumnParallelLinear, FP8RowParallelLinear


def hopper_problem() -> str | None:
    """None on a Hopper GPU (compute capability 9.x) under CUDA, else why model.fp8 cannot run here."""
    if not compat.cuda_available():
        return ("model.fp8=true needs an NVIDIA Hopper GPU (FP8 rowwise matmuls); none here (no CUDA): set "
                "model.fp8=false")
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        name = torch.cuda.get_device_name()
        return (f"model.fp8=true needs an NVIDIA Hopper GPU (compute capability 9.x); {name} is {major}.{minor}: "
                f"set model.fp8=false")
    return None


def problems(cfg, shape=None) -> list[str]:
    """model.fp8's refusals, one line each, before the model loads."""
    if not getattr(cfg.model, "fp8", False):
        return []
    out = []  # (with TransformerEngine's spec: spec.transformer_engine_problems)
    why = hopper_problem()
    if why:
        out.append(why)
    if cfg.parallel.tensor > 1:
        out.append("model.fp8=true runs at parallel.tensor=1 (its linear does no tensor-parallel communication); "
                   "set parallel.tensor=1 or model.fp8=false")
    if cfg.model.lora.enabled:
        out.append("model.fp8=true does not work with model.lora (the frozen base weights take the bf16 path); "
                   "set one of them off")
    if cfg.model.dtype == "fp32":
        out.append("model.fp8=true trains bf16 weights (FP8 matmuls, bf16 outputs); set model.dtype=bf16 or auto")
    return out
