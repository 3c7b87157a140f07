"""The Megatron policy: HF config -> TransformerConfig + layer spec -> GPTModel chunks -> trainable Policy.

families.py   the model families: each one registered Family (HF config traits, MoE weight names, tiny-model recipe)
hf_config.py  HF config -> ModelShape -> TransformerConfig (+ parameter count)
spec.py       the one switch model.transformer_impl: TransformerEngine spec on GPU, local spec otherwise
attention.py  torch-SDPA core attention for the local spec (no S x S scores; packed THD rows)
norm.py       RMSNorm for the local spec that works with sequence parallelism
build.py      GPTModel chunks per (virtual) pipeline stage; hidden-state output for fused logprobs
logprobs.py   chunked vocab-parallel logprobs + entropy (from logits, or fused with the output projection)
policy.py     Policy: chunks in megatron DDP + (distributed) Adam + warmup/constant LR schedule
grouped_experts.py  MoE experts as grouped GEMMs (model.moe_grouped_gemm)
fp8.py        FP8 linear layers with rowwise scaling (model.fp8, Hopper)
fast_paths.py the GPU fast-path switches and attention backend, decided once per launch and recorded
moe.py        MoE training glue: router losses' weights per mini-batch and logged values, router load, routing replay
lora.py       LoRA adapters on the TP-parallel linears (frozen base), adapters on/off, merged weights
exact.py      rollout.exact: the log-prob passes with the engine's own kernels and op order (CPU), batch-invariant;
              model.engine_numerics: every pass (the update's forward too) with them, the trainer's own backward
reference.py  reference-policy logprobs for the KL penalty: adapters off (LoRA) or a frozen copy of the weights

`problems(cfg, ...)` collects every model feature's config refusals (each feature module owns its own).
"""

def problems(cfg, *, shape=None) -> list[str]:
    """What the model settings of `cfg` cannot run with, one line each, before any model is built. `shape` (a
    hf_config.ModelShape) enables the checks that need the model. Each feature's check (cfg, shape) -> lines lives in
    its module, imported only when asked, so `import justrl_megatron.model` stays cheap."""
    from . import attention, exact, fast_paths, fp8, grouped_experts, hf_config, lora, moe, spec

    checks = (attention.context_parallel_problems, moe.problems, spec.transformer_engine_problems,
              attention.shared_prompt_config_problems, lora.problems, hf_config.shape_problems, fast_paths.problems,
              grouped_experts.problems, fp8.problems, exact.problems)
    return [line for check in checks for line in check(cfg, shape)]
