"""The Megatron policy: HF config -> TransformerConfig + layer spec -> GPTModel chunks -> trainable Policy.

hf_config.py  HF config -> ModelShape -> TransformerConfig (+ parameter count)
spec.py       the one switch model.transformer_impl: TransformerEngine spec on GPU, local spec otherwise
attention.py  torch-SDPA core attention for the local spec (no S x S scores; packed THD rows)
norm.py       RMSNorm for the local spec that works with sequence parallelism
build.py      GPTModel chunks per (virtual) pipeline stage; hidden-state output for fused logprobs
logprobs.py   chunked vocab-parallel logprobs + entropy (from logits, or fused with the output projection)
policy.py     Policy: chunks in megatron DDP + (distributed) Adam + warmup/constant LR schedule
moe.py        MoE training glue: router losses' weights per mini-batch and logged values, router load, routing replay
lora.py       LoRA adapters on the TP-parallel linears (frozen base), adapters on/off, merged weights
reference.py  reference-policy logprobs for the KL penalty: adapters off (LoRA) or a frozen copy of the weights
"""
