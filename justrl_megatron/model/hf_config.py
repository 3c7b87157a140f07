"""Translate a Hugging Face causal-LM config (Qwen2/2.5, Qwen3, Llama 2/3.x, Mistral; MoE: Mixtral, Qwen3-MoE) into
megatron-core's TransformerConfig.

All are pre-norm RMSNorm decoders with SwiGLU MLPs, RoPE and grouped-query attention. They differ in the QKV bias
(Qwen2), a per-head RMSNorm on q and k before RoPE (Qwen3, whose head_dim is independent of hidden/heads), RoPE
scaling (Llama 3.x: `llama3`), and whether the embeddings are tied. Mixtral and Qwen3-MoE replace every MLP with
megatron's MoE layer (a router plus E SwiGLU experts, top-k): Mixtral is Mistral's attention with a softmax over the
top-k router logits; Qwen3-MoE is Qwen3's attention with a softmax over all experts, then top-k, renormalised only
with `norm_topk_prob`. What sets each family apart is its `Family` (model/families.py); this module reads it and
never branches on a family's name. A field that changes the math is never ignored:
`HF_FIELDS` lists every field these configs carry and how it is handled (mapped into `ModelShape`, refused with a
message naming it when its value asks for math we do not implement, or irrelevant to the forward pass); a field
that is not in the table is refused too, unless it has its config class's default value.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .families import FAMILIES, Family

SUPPORTED_ARCHITECTURES = {f.architecture: f.name for f in FAMILIES.values()}
# MoE architectures refused by name: each needs a piece of math beyond a router + routed SwiGLU experts
REFUSED_MOE = {
    "Qwen2MoeForCausalLM": "a sigmoid-gated shared expert beside the routed ones",
    "DeepseekV2ForCausalLM": "multi-head latent attention, shared experts and group-limited routing",
    "DeepseekV3ForCausalLM": "multi-head latent attention, shared experts and sigmoid routing with an expert bias",
    "OlmoeForCausalLM": "q/k norms over the whole projection and its own router",
    "GraniteMoeForCausalLM": "its own multipliers on embeddings, attention and logits",
}
# non-weight files of an HF folder that travel with the weights (config, generation config, tokenizer)
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                 "chat_template.jinja", "chat_template.json")

# Every field of a Qwen2 / Qwen3 / Llama / Mistral config.json (as transformers 4 and 5 write them) -> how it is
# handled. "mapped": read into ModelShape. "refused if": a clear error naming the field when the condition holds.
# "irrelevant": does not change the forward math (generation, bookkeeping, token ids, dtype of the files).
HF_FIELDS: dict[str, str] = {
    "architectures": "mapped: family (Qwen2/Qwen3/Llama/Mistral ForCausalLM; others refused)",
    "model_type": "mapped: family when architectures is missing",
    "num_hidden_layers": "mapped: num_layers",
    "hidden_size": "mapped: hidden_size",
    "intermediate_size": "mapped: ffn_hidden_size (SwiGLU); Mixtral: each expert's; Qwen3-MoE: dense layers' only "
                         "(mlp_only_layers, refused), unused",
    "num_local_experts": "mapped: num_experts (Mixtral; Qwen3-MoE writes it too, an alias of num_experts)",
    "num_experts": "mapped: num_experts (Qwen3-MoE)",
    "num_experts_per_tok": "mapped: moe_top_k",
    "moe_intermediate_size": "mapped: moe_ffn_hidden_size (Qwen3-MoE: each expert's SwiGLU size)",
    "norm_topk_prob": "mapped: moe_norm_topk_prob (Qwen3-MoE; Mixtral always renormalises)",
    "router_aux_loss_coef": "mapped: moe_aux_loss_coef (the load-balancing loss's weight in training)",
    "output_router_logits": "irrelevant (extra outputs; the trainer adds the aux loss itself)",
    "router_jitter_noise": "refused if != 0 (Mixtral's training-time multiplicative noise on the router input)",
    "decoder_sparse_step": "refused if != 1 (Qwen3-MoE with dense layers between MoE layers)",
    "mlp_only_layers": "refused if not empty (Qwen3-MoE with dense layers)",
    "num_attention_heads": "mapped: num_attention_heads",
    "num_key_value_heads": "mapped: num_query_groups (GQA)",
    "head_dim": "mapped: kv_channels (Qwen3/Llama/Mistral may decouple it from hidden/heads)",
    "vocab_size": "mapped: vocab_size (padded for TP, stripped on export)",
    "max_position_embeddings": "mapped: max_sequence_length",
    "rms_norm_eps": "mapped: layernorm_epsilon (also of Qwen3's q/k norms)",
    "tie_word_embeddings": "mapped: share_embeddings_and_output_weights",
    "initializer_range": "mapped: init_method_std (init only; loaded weights replace it)",
    "rope_theta": "mapped: RoPE base (transformers 4 spelling)",
    "rope_parameters": "mapped: RoPE base and scaling (transformers 5 spelling); type default/linear/llama3, "
                       "refused for any other type or key",
    "rope_scaling": "mapped: as rope_parameters (transformers 4 spelling, published Llama-3.x files)",
    "partial_rotary_factor": "refused if != 1 (RoPE on part of each head)",
    "hidden_act": "refused if not silu (SwiGLU only)",
    "attention_bias": "refused if true on Llama/Mistral/Qwen3 (it also biases o_proj); Qwen2 always has q/k/v bias",
    "mlp_bias": "refused if true (bias in the MLP linears)",
    "attention_dropout": "refused if != 0 (training-time dropout)",
    "use_sliding_window": "refused if true with a sliding_window (Qwen2/Qwen3 windowed layers)",
    "sliding_window": "refused if set below max_position_embeddings on Mistral, or on Qwen with use_sliding_window",
    "max_window_layers": "irrelevant without use_sliding_window (which layers would use the window)",
    "layer_types": "refused if any layer is not full_attention",
    "use_mrope": "refused if true (multimodal RoPE)",
    "quantization_config": "refused (quantized weights)",
    "pretraining_tp": "irrelevant (old transformers split the matmuls in slices; same math)",
    "use_cache": "irrelevant (generation)",
    "bos_token_id": "irrelevant (token ids)",
    "eos_token_id": "irrelevant (token ids)",
    "pad_token_id": "irrelevant (token ids)",
    "unk_token_id": "irrelevant (token ids)",
    "_model_name_or_path": "irrelevant (bookkeeping; GGUF conversions write it)",
    "keys_to_ignore_at_inference": "irrelevant (output filtering)",
    "dtype": "irrelevant here (the weights' dtype; the converter reads it for its output)",
    "torch_dtype": "irrelevant here (transformers 4 spelling of dtype)",
    "transformers_version": "irrelevant (bookkeeping)",
    "_name_or_path": "irrelevant (bookkeeping)",
    "chunk_size_feed_forward": "irrelevant (memory chunking, same math)",
    "is_encoder_decoder": "refused if true",
    "output_attentions": "irrelevant (extra outputs)",
    "output_hidden_states": "irrelevant (extra outputs)",
    "return_dict": "irrelevant (output container)",
    "problem_type": "irrelevant (classification heads)",
    "id2label": "irrelevant (classification heads)",
    "label2id": "irrelevant (classification heads)",
    "tokenizer_class": "irrelevant (tokenizer)",
    "_attn_implementation_autoset": "irrelevant (kernel choice)",
    "_attn_implementation": "irrelevant (kernel choice)",
}
# generation defaults some older config.json files still carry (they steer sampling, not the forward pass)
_GENERATION_FIELDS = frozenset({
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "prefix", "finetuning_task", "torchscript", "use_bfloat16",
    "tf_legacy_loss", "pruned_heads", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "tie_encoder_decoder"})
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


@dataclass(frozen=True)
class ModelShape:
    """What the rest of the code needs to know about an HF model, independent of parallelism."""

    family: str  # a key of model/families.FAMILIES: "qwen2" | "qwen3" | "llama" | "mistral" | "mixtral" | "qwen3_moe"
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    init_std: float
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    num_experts: int = 0  # MoE (Mixtral, Qwen3-MoE): routed experts per layer; 0: a dense model
    moe_top_k: int = 0  # experts per token
    moe_ffn_hidden_size: int = 0  # each expert's SwiGLU size
    moe_norm_topk_prob: bool = True  # the top-k probabilities renormalised to sum to 1 (Mixtral: always)
    moe_aux_loss_coef: float = 0.0  # the HF config's router_aux_loss_coef
    rope_type: str = "default"  # default | linear | llama3 (model/rope.py)
    rope_factor: float | None = None  # linear, llama3
    rope_low_freq_factor: float | None = None  # llama3
    rope_high_freq_factor: float | None = None  # llama3
    rope_original_max_positions: int | None = None  # llama3: the context length before scaling


class UnsupportedConfig(ValueError):
    """An HF config field asks for math this trainer does not implement; the message names the field."""


def _refuse(field: str, value, why: str) -> None:
    raise UnsupportedConfig(f"config.json field {field}={value!r} is not supported: {why}")


def _family(hf_config) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    refused = next((a for a in archs if a in REFUSED_MOE), None)
    if refused:
        raise UnsupportedConfig(
            f"MoE architecture {refused} is not supported: it needs {REFUSED_MOE[refused]}; justrl-megatron's MoE "
            f"families are MixtralForCausalLM and Qwen3MoeForCausalLM")
    family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if family is None and not archs:
        family = getattr(hf_config, "model_type", "") if getattr(hf_config, "model_type", "") in \
            SUPPORTED_ARCHITECTURES.values() else None
    if family is None:
        raise UnsupportedConfig(
            f"unsupported model architecture {archs or getattr(hf_config, 'model_type', None)!r}: "
            f"justrl-megatron supports {sorted(SUPPORTED_ARCHITECTURES)}")
    return family


def _rope(fields: dict) -> dict:
    """RoPE base and scaling from either spelling: transformers 5's `rope_parameters` (theta inside) or
    transformers 4's `rope_theta` + `rope_scaling` (key `type` or `rope_type`)."""
    params = dict(fields.get("rope_parameters") or fields.get("rope_scaling") or {})
    name = "rope_scaling/rope_parameters"  # transformers 5 reads a file's rope_scaling into rope_parameters
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = fields.get("rope_theta", 10000.0)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind not in ROPE_TYPES:
        _refuse(f"{name}.rope_type", kind, f"RoPE scaling types implemented: {sorted(ROPE_TYPES)} (Megatron would "
                                           f"compute different positions than transformers and vLLM)")
    partial = params.pop("partial_rotary_factor", fields.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        _refuse("partial_rotary_factor", partial, "RoPE on every head dimension only")
    missing = [k for k in ROPE_TYPES[kind] if params.get(k) is None]
    if missing:
        _refuse(name, dict(params, rope_type=kind), f"{kind} RoPE scaling needs {missing}")
    extra = sorted(set(params) - set(ROPE_TYPES[kind]))
    if extra:
        _refuse(f"{name}.{extra[0]}", params[extra[0]], f"not used by {kind} RoPE as implemented here")
    if kind == "llama3" and params["low_freq_factor"] >= params["high_freq_factor"]:
        _refuse(f"{name}.low_freq_factor", params["low_freq_factor"], "must be below high_freq_factor")
    return dict(rope_theta=float(theta), rope_type=kind,
                rope_factor=None if kind == "default" else float(params["factor"]),
                rope_low_freq_factor=float(params["low_freq_factor"]) if kind == "llama3" else None,
                rope_high_freq_factor=float(params["high_freq_factor"]) if kind == "llama3" else None,
                rope_original_max_positions=int(params["original_max_position_embeddings"])
                if kind == "llama3" else None)


def _check_fields(fields: dict, family: Family, class_defaults: dict) -> None:
    """Refuse the fields (and values) whose math is not implemented; see HF_FIELDS. A field the table lacks passes
    only at its config class's default (a newer transformers may add fields whose default is today's architecture)."""
    unknown = sorted(k for k in fields if k not in HF_FIELDS and k not in _GENERATION_FIELDS
                     and not (k in class_defaults and class_defaults[k] == fields[k]))
    if unknown:
        raise UnsupportedConfig(
            f"config.json field {unknown[0]}={fields[unknown[0]]!r} is unknown to justrl-megatron's {family.name} "
            f"mapping (HF_FIELDS in model/hf_config.py) and may change the model's math; remove it if it does not"
            + (f" (also unknown: {unknown[1:]})" if len(unknown) > 1 else ""))
    act = fields.get("hidden_act", "silu")
    if act != "silu":
        _refuse("hidden_act", act, "the MLP is SwiGLU (silu)")
    if fields.get("attention_bias") and not family.qkv_bias:
        _refuse("attention_bias", True, f"{family.name} with attention_bias also has an o_proj bias, which this "
                                        f"trainer does not implement")
    if fields.get("mlp_bias"):
        _refuse("mlp_bias", True, "the MLP linears have no bias here")
    if fields.get("attention_dropout"):
        _refuse("attention_dropout", fields["attention_dropout"], "attention dropout is off here")
    for field in ("use_mrope", "is_encoder_decoder"):
        if fields.get(field):
            _refuse(field, fields[field], "decoder-only text models with 1-D RoPE only")
    if fields.get("quantization_config"):
        _refuse("quantization_config", "...", "load dequantized weights (drop the field after dequantizing)")
    window, max_pos = fields.get("sliding_window"), fields.get("max_position_embeddings")
    if fields.get("router_jitter_noise"):
        _refuse("router_jitter_noise", fields["router_jitter_noise"], "no noise on the router input here")
    if fields.get("decoder_sparse_step", 1) != 1:
        _refuse("decoder_sparse_step", fields["decoder_sparse_step"], "every layer must be an MoE layer")
    if fields.get("mlp_only_layers"):
        _refuse("mlp_only_layers", fields["mlp_only_layers"], "every layer must be an MoE layer")
    if family.moe:
        norm = family.always_renormalised or bool(fields.get("norm_topk_prob"))
        if fields.get("num_experts_per_tok") == 1 and norm:
            _refuse("num_experts_per_tok", 1, "top-1 routing renormalised to 1 (megatron refuses a softmax over one "
                                              "logit: its gradient is zero)")
    if family.window_switch:
        if fields.get("use_sliding_window") and window:
            _refuse("use_sliding_window", True, f"sliding-window attention (sliding_window={window}) is not "
                                                f"implemented; set use_sliding_window=false only if the model was "
                                                f"trained without it")
    elif window is not None and max_pos is not None and window < max_pos:
        _refuse("sliding_window", window, f"sliding-window attention below max_position_embeddings={max_pos} is not "
                                          f"implemented (Mistral v0.3-style configs have sliding_window=null)")
    layer_types = fields.get("layer_types") or []
    odd = sorted({t for t in layer_types if t != "full_attention"})
    if odd:
        _refuse("layer_types", odd, "every layer must be full_attention (no sliding-window layers)")


def model_shape(hf_config) -> ModelShape:
    """The ModelShape of an HF config object (transformers 4 or 5); UnsupportedConfig (a ValueError) names the field
    when the config asks for math that is not implemented."""
    family = FAMILIES[_family(hf_config)]
    fields = hf_config.to_dict()
    try:
        class_defaults = type(hf_config)().to_dict()
    except Exception:  # noqa: BLE001  (a config class that needs arguments: every unknown field is refused)
        class_defaults = {}
    _check_fields(fields, family, class_defaults)
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    qkv_bias = True if family.qkv_bias else bool(getattr(hf_config, "attention_bias", False))
    return ModelShape(
        family=family.name,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        rms_norm_eps=hf_config.rms_norm_eps,
        qkv_bias=qkv_bias,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        init_std=getattr(hf_config, "initializer_range", 0.02),
        qk_norm=family.qk_norm,
        **_moe(hf_config, family),
        **_rope(fields),
    )


def _moe(hf_config, family: Family) -> dict:
    if not family.moe:
        return {}
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)
    return dict(num_experts=int(experts), moe_top_k=int(hf_config.num_experts_per_tok),
                moe_ffn_hidden_size=int(getattr(hf_config, family.expert_size)),
                moe_norm_topk_prob=family.always_renormalised or bool(hf_config.norm_topk_prob),
                moe_aux_loss_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0))


def num_parameters(shape: ModelShape) -> int:
    """Parameters of the whole model as HF counts them (tied embeddings once, no vocab padding).
    DeepSeek-R1-Distill-Qwen-1.5B: 1,777,088,000."""
    s = shape
    attn = s.hidden_size * s.head_dim * (2 * s.num_attention_heads + 2 * s.num_query_groups)
    if s.qkv_bias:
        attn += s.head_dim * (s.num_attention_heads + 2 * s.num_query_groups)
    if s.qk_norm:
        attn += 2 * s.head_dim
    mlp = (s.num_experts * (3 * s.hidden_size * s.moe_ffn_hidden_size + s.hidden_size) if s.num_experts
           else 3 * s.hidden_size * s.ffn_hidden_size)  # MoE: E experts and the router's [E, h]
    per_layer = attn + mlp + 2 * s.hidden_size
    embeddings = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    return s.num_layers * per_layer + embeddings + s.hidden_size


def check_parallel_layout(shape: ModelShape, tp: int, pp: int = 1, vpp: int | None = None, ep: int = 1, *,
                          names: tuple[str, str, str] = ("parallel.tensor", "parallel.pipeline",
                                                         "parallel.virtual_pipeline"),
                          ep_name: str = "parallel.expert") -> list[str]:
    """What keeps `shape` from splitting at TP x PP (x VPP) x EP: megatron splits whole heads, query groups and the FFN over
    TP ranks, whole layers into PP x VPP equal stages, and whole experts over EP ranks (expert TP is 1: an expert is
    never split, so an MoE model's FFN size need not divide by TP). Returns the problems (empty: it splits); `names`
    are the knobs' names in the messages (config keys, or CLI flags)."""
    tp_name, pp_name, vpp_name = names
    problems = []
    ffn = 0 if shape.num_experts else shape.ffn_hidden_size  # 0 divides by any TP and leaves the gcd alone
    bad = [f"the {n} {what}" for what, n in (("attention heads", shape.num_attention_heads),
                                             ("query groups (KV heads)", shape.num_query_groups),
                                             ("FFN size (intermediate_size)", ffn)) if n % tp]
    if bad:
        fits = math.gcd(shape.num_attention_heads, shape.num_query_groups, ffn)
        problems.append(f"{tp_name}={tp} must divide the model's attention heads, query groups and FFN size, but does "
                        f"not divide {' and '.join(bad)}; use {tp_name} in "
                        f"{[d for d in range(1, fits + 1) if fits % d == 0]}")
    if shape.num_layers % (pp * (vpp or 1)):
        problems.append(f"the model's {shape.num_layers} layers are not divisible by {pp_name} x {vpp_name} = "
                        f"{pp}x{vpp or 1} equal pipeline stages")
    if ep < 1:
        problems.append(f"{ep_name} must be >= 1, got {ep}")
    elif ep > 1 and not shape.num_experts:
        problems.append(f"{ep_name}={ep} needs an MoE model (Mixtral, Qwen3-MoE); {shape.family} is dense")
    elif shape.num_experts % ep:
        problems.append(f"{ep_name}={ep} must divide the model's {shape.num_experts} experts; use {ep_name} in "
                        f"{[d for d in range(1, shape.num_experts + 1) if shape.num_experts % d == 0]}")
    return problems


def require_parallel_layout(shape: ModelShape, tp: int, pp: int = 1, vpp: int | None = None, ep: int = 1,
                            **kwargs) -> None:
    """`check_parallel_layout`, raising ValueError with its problems."""
    problems = check_parallel_layout(shape, tp, pp, vpp, ep, **kwargs)
    if problems:
        raise ValueError("; ".join(problems))


def shape_problems(cfg, shape: ModelShape | None = None) -> list[str]:
    """What the config asks of this model that its shape cannot give: the parallel layout (`check_parallel_layout`)
    and the context (model.max_context, the longest sample). Nothing without a shape."""
    if shape is None:
        return []
    par = cfg.parallel
    problems = check_parallel_layout(shape, par.tensor, par.pipeline, par.virtual_pipeline, max(par.expert, 1))
    total_len = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    context = cfg.model.max_context or shape.max_position_embeddings
    if cfg.model.max_context and cfg.model.max_context > shape.max_position_embeddings:
        problems.append(f"model.max_context={cfg.model.max_context} exceeds the model's positions "
                        f"(max_position_embeddings {shape.max_position_embeddings}); lower it or leave it null")
    if total_len > context:
        problems.append(
            f"data.max_prompt_length + rollout.max_response_length = {total_len} exceeds the model context "
            f"{context}; shorten them (or raise model.max_context if the model supports it)"
        )
    return problems


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary so that each TP rank holds an equal, aligned slice."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config(
    shape: ModelShape,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    sequence_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
    recompute: str | None = None,
    use_cpu_initialization: bool | None = None,
    **overrides,
):
    # lazy: config validation imports this module, and importing megatron (and compat, which patches it) takes seconds
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .. import compat

    if use_cpu_initialization is None:
        use_cpu_initialization = not compat.cuda_available()
    kwargs = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,  # the spec puts model/norm.py's RMSNorm there (spec.py)
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=shape.init_std,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        # fusions that need apex/TE/CUDA kernels
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        variable_seq_lengths=True,  # packed micro-batches differ in length (PP p2p shapes are exchanged)
        moe_token_dispatcher_type="alltoall",  # megatron rejects the allgather default with variable lengths
        expert_model_parallel_size=ep,
        **_moe_kwargs(shape),
    )
    if recompute in ("full", "selective"):
        kwargs["recompute_granularity"] = recompute
        if recompute == "full":
            kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _moe_kwargs(shape: ModelShape) -> dict:
    """megatron's MoE layer computing the HF model's routing: router logits in fp32; Mixtral (and Qwen3-MoE with
    norm_topk_prob) = top-k of the logits, softmax over those k, which equals HF's softmax -> top-k -> renormalise;
    Qwen3-MoE without it = softmax over all experts, then top-k, not renormalised (megatron's pre-softmax). No
    capacity factor: no token is dropped. Experts are whole on each EP rank (expert TP 1); sequential experts (the
    grouped GEMM needs TE or CUDA kernels, and would rename the weights)."""
    if not shape.num_experts:
        return {}
    return dict(num_moe_experts=shape.num_experts, moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
                moe_router_topk=shape.moe_top_k, moe_router_pre_softmax=not shape.moe_norm_topk_prob,
                moe_router_score_function="softmax", moe_router_dtype="fp32", moe_expert_capacity_factor=None,
                moe_grouped_gemm=False, expert_tensor_parallel_size=1,
                moe_router_load_balancing_type="aux_loss" if shape.moe_aux_loss_coef else "none",
                moe_aux_loss_coeff=shape.moe_aux_loss_coef)


def copy_side_files(source_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Copy the HF side files (config / generation config / tokenizer) that exist; with `dtype`, set the config's
    dtype to it (the weights' dtype)."""
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    for name in HF_SIDE_FILES:
        if (source_dir / name).exists():
            shutil.copyfile(source_dir / name, out_dir / name)
    cfg_path = out_dir / "config.json"
    if dtype is not None and cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        name = str(dtype).removeprefix("torch.")
        cfg["torch_dtype"] = name
        if "dtype" in cfg:
            cfg["dtype"] = name
        cfg_path.write_text(json.dumps(cfg, indent=2))
