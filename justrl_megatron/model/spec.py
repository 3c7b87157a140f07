"""The layer spec: TransformerEngine modules on GPU when TE is importable, megatron's local modules otherwise.

This is the one place that chooses (`model.transformer_impl: auto|te|local`). The local spec swaps in two modules:
an RMSNorm that works with sequence parallelism (`norm.py`; also Qwen3's q/k norms when `config.qk_layernorm`) and
a torch-SDPA core attention that never materialises the S x S scores and understands packed (THD) rows
(`attention.py`). Both pick their fused CUDA kernels themselves
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


def block_spec(config, transformer_impl: str = "auto", vp_stage: int | None = None):
    """The decoder block spec for this pipeline stage (and virtual stage)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    impl = resolve_impl(transformer_impl)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    if impl == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        from megatron.core.extensions.transformer_engine import TENorm

        layer = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=bool(config.qk_layernorm))
        final_norm = TENorm
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        layer = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
        layer.submodules.input_layernorm = RMSNorm
        layer.submodules.pre_mlp_layernorm = RMSNorm
        layer.submodules.self_attention.submodules.core_attention = SDPAttention
        if config.qk_layernorm:  # Qwen3: RMSNorm over head_dim on q and k (megatron sums its grads over TP)
            layer.submodules.self_attention.submodules.q_layernorm = RMSNorm
            layer.submodules.self_attention.submodules.k_layernorm = RMSNorm
        final_norm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=final_norm)
