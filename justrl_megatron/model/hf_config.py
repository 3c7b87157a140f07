"""Translate a Hugging Face causal-LM config (Qwen2, Llama) into megatron-core's TransformerConfig.

Supported: Qwen2 (DeepSeek-R1-Distill-Qwen-1.5B, OpenMath-Nemotron-1.5B, Qwen2.5) and Llama (SmolLM2). Both are
pre-norm RMSNorm decoders with SwiGLU MLPs, RoPE and grouped-query attention; they differ in the QKV bias and in
whether the embeddings are tied.
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

SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
# non-weight files of an HF folder that travel with the weights (config, generation config, tokenizer)
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                 "chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class ModelShape:
    """What the rest of the code needs to know about an HF model, independent of parallelism."""

    family: str  # "qwen2" | "llama"
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


def model_shape(hf_config) -> ModelShape:
    archs = getattr(hf_config, "architectures", None) or []
    family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if family is None:
        family = {"qwen2": "qwen2", "llama": "llama"}.get(getattr(hf_config, "model_type", ""))
    if family is None:
        raise ValueError(
            f"unsupported model architecture {archs or hf_config.model_type!r}: "
            f"justrl-megatron supports {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    rope_theta = getattr(hf_config, "rope_theta", None)
    if rope_theta is None:  # transformers >= 5 keeps it in rope_parameters
        rope_theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    qkv_bias = True if family == "qwen2" else bool(getattr(hf_config, "attention_bias", False))
    return ModelShape(
        family=family,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        rope_theta=float(rope_theta),
        rms_norm_eps=hf_config.rms_norm_eps,
        qkv_bias=qkv_bias,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        init_std=getattr(hf_config, "initializer_range", 0.02),
    )


def num_parameters(shape: ModelShape) -> int:
    """Parameters of the whole model as HF counts them (tied embeddings once, no vocab padding).
    DeepSeek-R1-Distill-Qwen-1.5B: 1,777,088,000."""
    s = shape
    attn = s.hidden_size * s.head_dim * (2 * s.num_attention_heads + 2 * s.num_query_groups)
    if s.qkv_bias:
        attn += s.head_dim * (s.num_attention_heads + 2 * s.num_query_groups)
    per_layer = attn + 3 * s.hidden_size * s.ffn_hidden_size + 2 * s.hidden_size
    embeddings = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    return s.num_layers * per_layer + embeddings + s.hidden_size


def check_parallel_layout(shape: ModelShape, tp: int, pp: int = 1, vpp: int | None = None, *,
                          names: tuple[str, str, str] = ("parallel.tensor", "parallel.pipeline",
                                                         "parallel.virtual_pipeline")) -> list[str]:
    """What keeps `shape` from splitting at TP x PP (x VPP): megatron splits whole heads, query groups and the FFN over
    TP ranks, and whole layers into PP x VPP equal stages. Returns the problems (empty: it splits); `names` are the
    knobs' names in the messages (config keys, or CLI flags)."""
    tp_name, pp_name, vpp_name = names
    problems = []
    bad = [f"the {n} {what}" for what, n in (("attention heads", shape.num_attention_heads),
                                             ("query groups (KV heads)", shape.num_query_groups),
                                             ("FFN size (intermediate_size)", shape.ffn_hidden_size)) if n % tp]
    if bad:
        fits = math.gcd(shape.num_attention_heads, shape.num_query_groups, shape.ffn_hidden_size)
        problems.append(f"{tp_name}={tp} must divide the model's attention heads, query groups and FFN size, but does "
                        f"not divide {' and '.join(bad)}; use {tp_name} in "
                        f"{[d for d in range(1, fits + 1) if fits % d == 0]}")
    if shape.num_layers % (pp * (vpp or 1)):
        problems.append(f"the model's {shape.num_layers} layers are not divisible by {pp_name} x {vpp_name} = "
                        f"{pp}x{vpp or 1} equal pipeline stages")
    return problems


def require_parallel_layout(shape: ModelShape, tp: int, pp: int = 1, vpp: int | None = None, **kwargs) -> None:
    """`check_parallel_layout`, raising ValueError with its problems."""
    problems = check_parallel_layout(shape, tp, pp, vpp, **kwargs)
    if problems:
        raise ValueError("; ".join(problems))


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
        moe_token_dispatcher_type="alltoall",  # dense model; megatron rejects the default with variable lengths
    )
    if recompute in ("full", "selective"):
        kwargs["recompute_granularity"] = recompute
        if recompute == "full":
            kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


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
