"""The layer spec: TransformerEngine modules on GPU when TE is importable, megatron's local modules otherwise.

This is the one place that chooses (`model.transformer_impl: auto|te|local`). The local spec swaps in two modules:
an RMSNorm that works with sequence parallelism (`norm.py`; also Qwen3's q/k norms when `config.qk_layernorm`) and
a torch-SDPA core attention that never materialises the S x S scores and understands packed (THD) rows
(`attention.py`). MoE models (Mixtral, Qwen3-MoE) get megatron's MoE layer in place of the MLP, on both specs. Both
pick their fused CUDA kernels themselves
(varlen flash attention, fused rms_norm); the fusions that are TransformerConfig flags are set in `policy._gpu_fusions`.
"""

from __future__ import annotations

import copy

from .. import compat
from .attention import SDPAttention
from .norm import RMSNorm


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return compat.cuda_available()


def resolve_impl(transformer_impl: str = "auto") -> str:
    if transformer_impl not in ("auto", "te", "local"):
        raise ValueError(f"model.transformer_impl must be auto, te or local, got {transformer_impl!r}")
    if transformer_impl == "auto":
        return "te" if te_available() else "local"
    if transformer_impl == "te" and not te_available():
        raise RuntimeError("model.transformer_impl=te needs transformer-engine and a CUDA device; use auto or local")
    return transformer_impl


def _moe_router_without_te() -> None:
    """megatron-core 0.16.1's router matmul tests `te_general_gemm is not None`, but without TransformerEngine the
    name is never bound (NameError): bind it to None so the router takes its plain torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def block_spec(config, transformer_impl: str = "auto", vp_stage: int | None = None):
    """The decoder block spec for this pipeline stage (and virtual stage)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    impl = resolve_impl(transformer_impl)
    if config.num_moe_experts:
        _moe_router_without_te()
        compat.moe_dispatch_on_cpu()
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    if impl == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        from megatron.core.extensions.transformer_engine import TENorm

        layer = get_gpt_layer_with_transformer_engine_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                                           qk_layernorm=bool(config.qk_layernorm))
        final_norm = TENorm
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        # MoE (config.num_moe_experts): megatron's MoELayer with sequential local experts (no grouped GEMM on CPU)
        layer = copy.deepcopy(get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                                       normalization="RMSNorm"))
        layer.submodules.input_layernorm = RMSNorm
        layer.submodules.pre_mlp_layernorm = RMSNorm
        layer.submodules.self_attention.submodules.core_attention = SDPAttention
        if config.qk_layernorm:  # Qwen3: RMSNorm over head_dim on q and k (megatron sums its grads over TP)
            layer.submodules.self_attention.submodules.q_layernorm = RMSNorm
            layer.submodules.self_attention.submodules.k_layernorm = RMSNorm
        final_norm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=final_norm)
