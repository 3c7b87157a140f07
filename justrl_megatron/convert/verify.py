"""Numerical check of a conversion: Megatron logits vs transformers logits on the same random tokens."""

from __future__ import annotations

import os

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections before megatron loads)

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func


def random_tokens(vocab_size: int, batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=g)


def megatron_logits(chunks, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Full-vocab fp32 logits [batch, seq, vocab_size] (padding stripped) on the last pipeline stage, None elsewhere.

    Runs megatron's own schedule (forward only), one sample per micro-batch, so any TP / PP / VPP layout works.
    """
    batch, seq = tokens.shape
    device = next(chunks[0].parameters()).device
    samples = [tokens[i: i + 1].to(device) for i in range(batch)]
    gathered: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        sample = next(data_iterator)
        pos = torch.arange(seq, device=device).unsqueeze(0)
        out = model(sample, pos, attention_mask=None)

        def keep(output):
            full = tensor_parallel.gather_from_tensor_model_parallel_region(output)
            gathered.append(full[..., :vocab_size].float().detach().clone())
            return output.sum() * 0.0, {}

        return out, keep

    for c in chunks:
        c.eval()
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(samples) for _ in chunks] if len(chunks) > 1 else iter(samples),
            model=chunks, num_microbatches=batch, seq_length=seq, micro_batch_size=1, forward_only=True,
        )
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.cat(gathered).cpu()


def hf_logits(hf_dir: str | os.PathLike, tokens: torch.Tensor,
              weight_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp32 logits of the transformers model (eager attention, CPU), its weights first rounded to `weight_dtype`
    (a bf16 checkpoint is compared with the HF model's bf16-rounded weights, both computed in fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=weight_dtype, attn_implementation="eager")
    model.float().eval()
    with torch.no_grad():
        return model(tokens).logits.float()
