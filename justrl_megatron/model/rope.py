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

from .exact import engine_pass, engine_rope, packed_positions, piece_on
from .hf_config import ModelShape

PER_TOKEN_ROWS = "_justrl_rope_rows_per_token"  # set on a freqs tensor that holds one rotation row per packed token
ROW_POSITIONS = "_justrl_rope_row_positions"  # beside it: the positions those rows rotate by (the engine's RoPE)


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
        rows = output.index_select(0, positions)
        setattr(rows, PER_TOKEN_ROWS, True)  # apply_packed_rope applies them as they are: no boundaries read
        setattr(rows, ROW_POSITIONS, positions)
        return rows

    handle = rotary.register_forward_hook(per_token)
    try:
        yield
    finally:
        handle.remove()


def _apply_packed_rope(megatron_apply):
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None, **kwargs):
        cache = getattr(config, "justrl_rope_cache", None)  # the engine's kernel (model/exact.py)
        if (cache is not None and cu_seqlens is not None and engine_pass(config, t) and piece_on("rope")
                and mscale == 1.0 and not kwargs and not config.rotary_interleaved
                and (cp_group is None or cp_group.size() == 1)):
            positions = getattr(freqs, ROW_POSITIONS, None) if getattr(freqs, PER_TOKEN_ROWS, False) else \
                packed_positions(cu_seqlens, t.size(0))
            if positions is not None and positions.numel() == t.size(0):
                return engine_rope(t, positions, cache)
        if (cu_seqlens is not None and getattr(freqs, PER_TOKEN_ROWS, False) and freqs.size(0) == t.size(0)
                and not config.apply_rope_fusion and not kwargs and (cp_group is None or cp_group.size() == 1)):
            from megatron.core.models.common.embeddings import rope_utils

            # what megatron's packed "CASE 1" computes once it has cut the rows out per sequence (with one
            # .item() per sequence and a .tolist(), in every layer): here the rows are already per token
            return rope_utils._apply_rotary_pos_emb_bshd(
                t.unsqueeze(1), freqs, rotary_interleaved=config.rotary_interleaved, mscale=mscale).squeeze(1)
        return megatron_apply(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group, **kwargs)

    apply_rotary_pos_emb.justrl_wraps = megatron_apply
    return apply_rotary_pos_emb


def install_packed_rope() -> None:
    """Let megatron's attention apply per-token rotation rows (`rope_at_positions`) without reading the packed
    sequence boundaries on the host. megatron (0.16 and 0.19) applies packed RoPE through
    `_apply_rotary_pos_emb_thd`, which calls `.tolist()` and one `.item()` per sequence in every layer, for q and k:
    ~170 device-to-host syncs per forward of a 28-layer model. Rows that are already one per token need none of
    that; anything else (bshd, TE's fused RoPE, context parallelism) goes to megatron's function unchanged.
    Idempotent; the wrapper replaces the name megatron's attention module calls."""
    from megatron.core.transformer import attention

    if not hasattr(attention.apply_rotary_pos_emb, "justrl_wraps"):
        attention.apply_rotary_pos_emb = _apply_packed_rope(attention.apply_rotary_pos_emb)
