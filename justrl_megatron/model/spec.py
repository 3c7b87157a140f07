"""The layer spec: TransformerEngine modules on GPU when TE is importable, megatron's local modules otherwise.

This is the one place that chooses (`model.transformer_impl: auto|te|local`). The local spec swaps in two modules:
an RMSNorm that works with sequence parallelism (`norm.py`; also Qwen3's q/k norms when `config.qk_layernorm`) and
a torch-SDPA core attention that never materialises the S x S scores and understands packed (THD) rows
(`attention.py`). MoE models (Mixtral, Qwen3-MoE) get megatron's MoE layer in place of the MLP, on both specs. Both
pick their fused CUDA kernels themselves
(varlen flash attention, fused rms_norm); the fusions that are TransformerConfig flags are set in `gpu_fusions`.
What needs TransformerEngine where it is missing is refused here too (`transformer_engine_problems`).
"""

from __future__ import annotations

import copy
import functools
import logging

from .. import compat
from .attention import SDPAttention
from .norm import RMSNorm

logger = logging.getLogger(__name__)


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


def _runs_te(transformer_impl: str) -> bool:
    if transformer_impl in ("te", "auto"):
        return transformer_impl == "te" or te_available()
    return False


def transformer_engine_problems(cfg, shape=None) -> list[str]:
    """TE-only settings where TransformerEngine or a GPU is missing, and what the TE spec cannot run: one line each,
    before any model is built."""
    problems = []
    if cfg.parallel.context > 1 and cfg.model.dtype == "fp32" and _runs_te(cfg.model.transformer_impl):
        problems.append("parallel.context > 1 with the TE spec has no fp32 attention (TE's fused and flash attention "
                        "take bf16/fp16, its unfused one has no context parallelism); set model.dtype=bf16, or "
                        "model.transformer_impl=local")
    if _runs_te(cfg.model.transformer_impl):  # the local spec's own modules (block_spec)
        for key, what in (("moe_grouped_gemm", "grouped experts (TransformerEngine has its own)"),
                          ("fp8", "FP8 linears (TransformerEngine has its own recipes)")):
            if getattr(cfg.model, key, False):
                problems.append(f"model.{key}=true is the local spec's {what}; set model.transformer_impl=local")
    fixes = {}  # the setting asked for -> what to use instead
    if cfg.model.transformer_impl == "te":
        fixes["model.transformer_impl=te"] = "model.transformer_impl=auto or local"
    if cfg.model.moe_permute_fusion:
        fixes["model.moe_permute_fusion=true"] = "model.moe_permute_fusion=null or false"
    if fixes and not te_available():
        problems += [f"{asked} needs transformer-engine and a CUDA device (none here); use {fix}"
                     for asked, fix in fixes.items()]
    return problems


@functools.lru_cache(maxsize=None)
def fused_swiglu_check(device: str) -> str | None:
    """None when megatron's fused SwiGLU runs and is right on `device`, else why not. It needs neither TE nor apex
    (megatron.core.fusions.fused_bias_swiglu: a torch.compile'd forward, a hand-written backward that keeps only the
    fc1 output for backward), but torch.compile needs triton and a C compiler, which a bare GPU image may lack: one
    tiny compiled forward/backward here, compared with the plain op, decides before any model is built."""
    try:
        import torch
        import torch.nn.functional as F
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

        g = torch.Generator().manual_seed(0)
        y, w = (torch.randn(6, 1, 64, generator=g).to(device) for _ in range(2))
        fused_in, plain_in = y.clone().requires_grad_(), y.clone().requires_grad_()
        fused = bias_swiglu_impl(fused_in, None)
        gate, up = plain_in.chunk(2, -1)
        plain = F.silu(gate) * up
        (fused * w[..., :32]).sum().backward()
        (plain * w[..., :32]).sum().backward()
        err = max(float((fused - plain).detach().abs().max()), float((fused_in.grad - plain_in.grad).abs().max()))
        if str(device).startswith("cuda"):
            # forget the probe's graph: the model's first shape then compiles static; after two shapes torch
            # compiles a dynamic-shape kernel, and the probe's tiny shape would have been the first
            torch._dynamo.reset()
    except Exception as exc:  # noqa: BLE001  (any failure keeps the plain op)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return None if err <= 1e-4 else f"fused SwiGLU differs from F.silu(gate) * up by {err:.3g}"


def gpu_fusions(impl: str) -> dict:
    """TransformerConfig fusion flags for this spec on this device (hf_config.transformer_config turns all off).

    TE spec: megatron's GPU recipe (TE's fused RoPE, also for packed THD rows, and the fused SwiGLU).
    Local spec on CUDA, only what megatron-core has without TE/apex (checked in 0.16.1 and 0.19.2):
      * bias_activation_fusion: the fused SwiGLU (see fused_swiglu_check), on when it compiles and checks out;
      * apply_rope_fusion stays off: megatron's fused RoPE (fused_apply_rotary_pos_emb[_thd]) comes only from
        megatron.core.extensions.transformer_engine; without TE TransformerConfig refuses the flag;
      * gradient_accumulation_fusion stays off: it needs apex's fused_weight_gradient_mlp_cuda;
      * bias_dropout_fusion stays off: with no linear bias and dropout 0 the op is one residual add (F.dropout with
        p=0 returns its input): nothing to fuse, only a torch.compile graph per shape to pay for;
      * masked_softmax_fusion / persist_layer_norm do not apply (SDPA attention, our RMSNorm).
    The local spec's other GPU kernels choose themselves: varlen flash attention (attention.py), fused rms_norm
    (norm.py). On the CPU nothing changes: the plain ops, bitwise as the CPU tests expect.
    """
    if impl == "te":
        return dict(apply_rope_fusion=True, bias_activation_fusion=True)
    if not compat.cuda_available():
        return {}
    why_not = fused_swiglu_check(str(compat.default_device()))
    if why_not is not None:
        logger.warning("fused SwiGLU unavailable (%s): the local spec keeps the plain activation", why_not)
        return {}
    return dict(bias_activation_fusion=True)


def _moe_router_without_te() -> None:
    """megatron-core 0.16.1's router matmul tests `te_general_gemm is not None`, but without TransformerEngine the
    name is never bound (NameError): bind it to None so the router takes its plain torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def block_spec(config, transformer_impl: str = "auto", vp_stage: int | None = None, *,
               moe_grouped_gemm: bool = False, fp8: bool = False, attention_backend: str = "auto"):
    """The decoder block spec for this pipeline stage (and virtual stage). Local spec only: `moe_grouped_gemm`
    puts grouped experts in place of the sequential ones (grouped_experts.py), `fp8` FP8 linears in place of the
    attention's and the dense MLP's (fp8.py); config validation refuses either with TE (`problems` of those);
    `attention_backend` (model.attention_backend, resolved: model/fast_paths) goes to SDPAttention through its
    `ModuleSpec.params`."""
    from megatron.core.transformer.spec_utils import ModuleSpec
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
        layer.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=SDPAttention, params={"backend": attention_backend})
        if config.qk_layernorm:  # Qwen3: RMSNorm over head_dim on q and k (megatron sums its grads over TP)
            layer.submodules.self_attention.submodules.q_layernorm = RMSNorm
            layer.submodules.self_attention.submodules.k_layernorm = RMSNorm
        final_norm = RMSNorm
        if moe_grouped_gemm and config.num_moe_experts:
            from .grouped_experts import grouped_experts_module

            layer.submodules.mlp.submodules.experts.module = grouped_experts_module()
        if fp8:
            from .fp8 import fp8_linear_classes

            column, row = fp8_linear_classes()
            attention = layer.submodules.self_attention.submodules
            attention.linear_qkv, attention.linear_proj = column, row
            if not config.num_moe_experts:  # MoE experts stay in model.dtype (grouped_experts.py)
                layer.submodules.mlp.submodules.linear_fc1 = column
                layer.submodules.mlp.submodules.linear_fc2 = row
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=final_norm)
