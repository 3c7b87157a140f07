"""The model families, each one registered `Family`: what sets it apart in its HF config (read by
model/hf_config.py into a `ModelShape`), in its weight names (convert/mapping.py) and in the recipe of a tiny random
model of it (assets.tiny_model; justrl-bench's random-weight folders, bench/cli.model_folder).

All are pre-norm RMSNorm decoders with SwiGLU MLPs, RoPE and grouped-query attention; what they share is written
once in those modules, and nothing outside this file branches on a family's name. A new family of that kind: one
`Family(...)` in `FAMILIES`, and its tests (HF vs Megatron logits and the converter round trip,
tests/test_model_families.py).

Data only (no torch, no transformers): config validation and the asset builder read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    name: str  # ModelShape.family (also the HF model_type)
    architecture: str  # the HF config's `architectures` entry
    # --- the HF config -> ModelShape (model/hf_config.py)
    # q/k/v biases always (Qwen2); the others refuse attention_bias=true (it also biases o_proj)
    qkv_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over head_dim on q and k, before RoPE (Qwen3)
    # sliding-window attention is switched by use_sliding_window (Qwen); else by a sliding_window below
    # max_position_embeddings (Llama, Mistral)
    window_switch: bool = False
    moe: bool = False  # every MLP is a router + routed SwiGLU experts
    always_renormalised: bool = False  # MoE: top-k probabilities always sum to 1 (Mixtral); else norm_topk_prob
    expert_size: str = "moe_intermediate_size"  # MoE: the config key of each expert's FFN size
    experts_key: str = "num_experts"  # MoE: the config key of the expert count
    # --- HF weight names (convert/mapping.py)
    moe_module: str = "mlp"  # MoE: the module under model.layers.{i} holding `gate` (the router) and `experts`
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # MoE: an expert's gate, up, down
    # --- a tiny random model (assets.tiny_model, bench/cli.model_folder)
    config_class: str = ""  # transformers' config class
    tiny_rope_theta: float = 10000.0
    tiny_config: dict = field(default_factory=dict)  # config keys of its own (the window switched off, no bias)
    tiny_tied: bool = False  # embeddings tied by default
    qwen_tokenizer: bool = False  # the Qwen2 tokenizer (151,665 tokens) fits its vocabulary
    free_head_dim: bool = True  # head_dim may differ from hidden / heads (Qwen2's config cannot say so)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, window_switch=True, config_class="Qwen2Config",
           tiny_config=dict(use_sliding_window=False), qwen_tokenizer=True, free_head_dim=False),
    Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, window_switch=True, config_class="Qwen3Config",
           tiny_rope_theta=1000000.0, tiny_config=dict(use_sliding_window=False, attention_bias=False),
           qwen_tokenizer=True),
    Family("llama", "LlamaForCausalLM", config_class="LlamaConfig", tiny_rope_theta=100000.0,
           tiny_config=dict(attention_bias=False), tiny_tied=True),
    Family("mistral", "MistralForCausalLM", config_class="MistralConfig", tiny_config=dict(sliding_window=None)),
    Family("mixtral", "MixtralForCausalLM", moe=True, always_renormalised=True, expert_size="intermediate_size",
           experts_key="num_local_experts", moe_module="block_sparse_moe", expert_projections=("w1", "w3", "w2"),
           config_class="MixtralConfig", tiny_rope_theta=1000000.0, tiny_config=dict(sliding_window=None)),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, window_switch=True, moe=True,
           config_class="Qwen3MoeConfig", tiny_rope_theta=1000000.0,
           tiny_config=dict(use_sliding_window=False, attention_bias=False)),
)}
