"""The Megatron policy: HF config -> TransformerConfig + layer spec -> GPTModel chunks."""
