"""justrl-megatron."""
