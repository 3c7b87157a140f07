"""Training: packing samples into micro-batches (batching), one GRPO update (step), the loop, checkpoints."""
