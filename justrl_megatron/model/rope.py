"""RoPE inverse frequencies as transformers computes them, for the rope types `hf_config` maps (default, linear,
llama3), set on megatron's RotaryEmbedding after it is built.

megatron-core (0.16 and 0.19) takes only a llama3 `rope_scaling_factor` and hard-codes low_freq_factor=1,
high_freq_factor=4 and an original context of 8192, and rounds the base to an int; computing inv_freq here keeps
every field of the HF config in force, so the trainer, transformers and vLLM rotate positions alike.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .hf_config import ModelShape


def inv_freq(shape: ModelShape, device=None) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies for `shape` (transformers' formulas, same op order)."""
    dim = shape.head_dim
    base = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device,
                                                                                      dtype=torch.float) / dim))
    if shape.rope_type == "default":
        return base
    factor = shape.rope_factor
    if shape.rope_type == "linear":
        return base / factor
    if shape.rope_type == "llama3":
        low, high = shape.rope_low_freq_factor, shape.rope_high_freq_factor
        old_context = shape.rope_original_max_positions
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / base
        # long wavelengths (low frequencies) are divided by the factor, short ones kept, the band between blended
        scaled = torch.where(wavelen > low_wavelen, base / factor, base)
        smooth = (old_context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"unknown rope_type {shape.rope_type!r}")


def set_rotary(model, shape: ModelShape) -> None:
    """Replace the inverse frequencies of a GPTModel's RotaryEmbedding (before its first forward: megatron caches
    the embedding per sequence length)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        return
    rotary.inv_freq = inv_freq(shape, device=rotary.inv_freq.device)


@contextlib.contextmanager
def rope_at_positions(model, positions):
    """Within the block, the GPTModel `model` rotates packed token t by `positions[t]` (the micro-batch's own position
    ids, on the model's device) instead of by its offset from the start of its cu_seqlens segment; None: no change.

    Shared-prompt units need it: a unit is one segment, but each response's positions restart at the prompt's end.
    megatron (0.16 and 0.19, rope_utils._apply_rotary_pos_emb_thd, "CASE 1") applies a freqs tensor that has one row
    per packed token as it is; the hook turns RotaryEmbedding's [max_seqlen, 1, 1, d] table into those rows."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if positions is None or rotary is None:
        yield
        return

    def per_token(module, args, output):
        return output.index_select(0, positions)

    handle = rotary.register_forward_hook(per_token)
    try:
        yield
    finally:
        handle.remove()
