"""MoE experts as grouped GEMMs (`model.moe_grouped_gemm=true`): every local expert's matmul in one kernel call.

megatron's local spec runs the experts one after another (SequentialMLP: a host sync for the token counts, then per
expert fc1, SwiGLU, fc2; Qwen3-30B-A3B: 128 small matmuls per layer and direction). Its grouped alternatives need
TransformerEngine (TEGroupedMLP) or the `grouped_gemm` CUDA extension (the legacy GroupedMLP), neither on the box.
`GroupedExperts` is megatron's SequentialMLP with the same parameters, names and checkpoint layout (one
linear_fc1 / linear_fc2 per expert, so converters, checkpoints and the vLLM export are untouched) and another
forward: the experts' weights stacked into [E, out, in] and multiplied with torch's grouped GEMM
(`torch._grouped_mm`: CUTLASS grouped kernels on Hopper, a per-group loop elsewhere, CPU included) over the tokens
the dispatcher already sorted by expert, with the group offsets made on the device (SequentialMLP's own
`tokens_per_expert.tolist()` sync is gone; the dispatcher's all-to-all still needs its counts on the host).
The stacked weights are not kept for backward: a saved-tensor hook stacks them again there, so the extra memory is
one layer's stacked experts while that layer runs, never one copy per layer until its backward.
Same arithmetic as the sequential experts: fp32 bit for bit on the CPU, bf16 within one rounding of each matmul's
output (the grouped kernel may sum in another order; tests/test_grouped_experts.py states the bounds). On CUDA the
grouped kernels take bf16 only: an fp32 model there keeps the sequential forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def problems(cfg, shape=None) -> list[str]:
    """model.moe_grouped_gemm's refusals, one line each."""
    if not getattr(cfg.model, "moe_grouped_gemm", False):
        return []
    out = []  # (with TransformerEngine's spec: spec.transformer_engine_problems)
    if shape is not None and not shape.num_experts:
        out.append("model.moe_grouped_gemm=true needs an MoE model (this one has no experts); set it to false")
    if not hasattr(torch, "_grouped_mm"):
        out.append(f"model.moe_grouped_gemm=true needs torch._grouped_mm (torch {torch.__version__} lacks it); set "
                   f"it to false")
    if cfg.model.lora.enabled and any(t in ("fc1", "fc2") for t in cfg.model.lora.targets):
        out.append("model.moe_grouped_gemm=true does not run LoRA adapters on the experts; drop fc1/fc2 from "
                   "model.lora.targets or set model.moe_grouped_gemm=false")
    return out


class _Restacked:
    """Saved-tensor hooks that keep, instead of a stacked weight, the list it was stacked from (`torch.stack` again
    in backward: the parameters do not change between a forward and its backward)."""

    def __init__(self):
        # id(stack) -> (the stack, kept alive so that its id is not reused while the hooks are on; its sources)
        self.sources: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def stack(self, weights: list[torch.Tensor]) -> torch.Tensor:
        stacked = torch.stack(weights)
        self.sources[id(stacked)] = (stacked, weights)
        return stacked

    def pack(self, t: torch.Tensor):
        # the matmul saves a view of the stack (its transpose): recognised by the view's base
        entry = self.sources.get(id(t)) or (self.sources.get(id(t._base)) if t._base is not None else None)
        if entry is None:
            return t
        return ("restack", entry[1], t.size(), t.stride(), t.storage_offset())

    @staticmethod
    def unpack(saved):
        if isinstance(saved, tuple) and saved and saved[0] == "restack":
            _, weights, size, stride, offset = saved
            with torch.no_grad():
                return torch.stack([w.detach() for w in weights]).as_strided(size, stride, offset)
        return saved


# CUDA's grouped kernels read each group through TMA, which wants every group to start 16 bytes in: the weight
# gradient's grouped GEMM splits the token dimension, so each expert's tokens are padded to a multiple of 16 rows
CUDA_GROUP_ALIGN = 16


def padded_layout(tokens_per_expert: torch.Tensor, tokens: int, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row -> padded position [tokens], padded group ends [E] int32, padded rows) with every expert's group rounded
    up to a multiple of `align`, made on the device without a host sync (the padded size is the bound
    tokens + E x (align - 1), whatever the counts)."""
    counts = tokens_per_expert.to(torch.int64)
    experts = counts.numel()
    padded = (counts + align - 1) // align * align
    starts, padded_starts = torch.cumsum(counts, 0) - counts, torch.cumsum(padded, 0) - padded
    expert = torch.repeat_interleave(torch.arange(experts, device=counts.device), counts, output_size=tokens)
    rows = torch.arange(tokens, device=counts.device)
    return padded_starts[expert] + rows - starts[expert], torch.cumsum(padded, 0).to(torch.int32), \
        tokens + experts * (align - 1)


def grouped_swiglu_experts(hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
                           fc1_weights: list[torch.Tensor], fc2_weights: list[torch.Tensor], activation,
                           align: int = 1) -> torch.Tensor:
    """The experts' output for `hidden` [T, h] sorted by expert (`tokens_per_expert` [E] rows each): fc1 (grouped),
    `activation(fc1 output, probs)` (SwiGLU with the routing weight), fc2 (grouped). Weights as megatron holds them:
    fc1 [2 f, h], fc2 [h, f] per expert. `align` > 1: each group padded with zero rows to a multiple of it (zero
    rows with zero weight add nothing to any output or gradient)."""
    counts = tokens_per_expert.to(device=hidden.device)
    position = None
    if align > 1:
        position, offsets, rows = padded_layout(counts, hidden.size(0), align)
        hidden = hidden.new_zeros(rows, hidden.size(1)).index_copy(0, position, hidden)
        probs = probs.new_zeros(rows).index_copy(0, position, probs)
    else:
        offsets = torch.cumsum(counts.to(torch.int64), 0).to(torch.int32)
    hooks = _Restacked()
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        w1 = hooks.stack(fc1_weights).transpose(1, 2)  # [E, h, 2f]
        inter = torch._grouped_mm(hidden, w1, offs=offsets)
        inter = activation(inter, probs)
        w2 = hooks.stack(fc2_weights).transpose(1, 2)  # [E, f, h]
        out = torch._grouped_mm(inter, w2, offs=offsets)
    return out if position is None else out.index_select(0, position)


def _grouped_experts_class():
    from megatron.core.transformer.moe.experts import SequentialMLP

    class GroupedExperts(SequentialMLP):
        """SequentialMLP's parameters with a grouped-GEMM forward (see the module docstring)."""

        def __init__(self, num_local_experts, config, submodules, pg_collection=None, **kwargs):
            super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, **kwargs)
            cfg = self.config
            if cfg.add_bias_linear or not cfg.gated_linear_unit or cfg.activation_func is not F.silu:
                raise ValueError("model.moe_grouped_gemm: grouped experts are SwiGLU experts without biases")
            if cfg.moe_apply_probs_on_input or cfg.fp8 or getattr(cfg, "activation_func_clamp_value", None) \
                    or getattr(cfg, "glu_linear_offset", 0.0):
                raise ValueError("model.moe_grouped_gemm: grouped experts take plain SwiGLU experts (no "
                                 "moe_apply_probs_on_input, clamp, GLU offset or TransformerEngine FP8)")

        def _activation(self, inter: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
            """What megatron's MLP does between fc1 and fc2 for a SwiGLU expert with routing weights: the fused
            weighted SwiGLU where the config fuses it, else SiLU(gate) * up times the weight, in the input's dtype."""
            if self.config.bias_activation_fusion:
                from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

                return weighted_bias_swiglu_impl(inter, None, probs.unsqueeze(-1),
                                                 self.config.activation_func_fp8_input_store)
            gate, up = torch.chunk(inter, 2, dim=-1)
            out = F.silu(gate) * up
            return (out * probs.unsqueeze(-1)).to(out.dtype)

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
            x = permuted_local_hidden_states
            if x.numel() == 0 or (x.is_cuda and x.dtype != torch.bfloat16):
                # nothing routed here; or fp32/fp16 on CUDA, where torch's grouped kernels are bf16 only
                return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
            experts = self.local_experts
            out = grouped_swiglu_experts(
                permuted_local_hidden_states, tokens_per_expert, permuted_probs,
                [e.linear_fc1.weight for e in experts], [e.linear_fc2.weight for e in experts], self._activation,
                align=CUDA_GROUP_ALIGN if x.is_cuda else 1)
            return out, None

    return GroupedExperts


GROUPED_EXPERTS = None


def grouped_experts_module():
    """The GroupedExperts class (built on first use: megatron loads only when a model is built)."""
    global GROUPED_EXPERTS
    if GROUPED_EXPERTS is None:
        GROUPED_EXPERTS = _grouped_experts_class()
    return GROUPED_EXPERTS
