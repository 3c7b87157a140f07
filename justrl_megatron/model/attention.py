"""Core attention for the local (non-TransformerEngine) layer spec: torch SDPA, packed sequences included.

megatron's local `DotProductAttention` materialises the [b, h, s, s] score matrix (16K tokens: 1 GiB per head in fp32)
and rejects packed sequences. This module takes its place in the spec (same constructor and forward contract) and
calls `torch.nn.functional.scaled_dot_product_attention`, whose flash / memory-efficient kernels (CUDA, and the CPU
flash kernel) never build the score matrix.

What megatron's `Attention` hands the core-attention module (megatron-core 0.16 / 0.19):
  * padded batches ("sbhd"): query [s, b, np, hn], key/value [s, b, ng, hn]; returns [s, b, np * hn];
  * packed rows ("thd", `PackedSeqParams.qkv_format == "thd"`): query [t, np, hn], key/value [t, ng, hn] (the batch dim
    of 1 is squeezed by the caller, RoPE is already applied per sequence from `cu_seqlens`); returns [t, np * hn].
Attention stays inside each packed sequence. On CUDA with bf16/fp16 one varlen flash call covers the whole row
(`torch.nn.attention.varlen`, torch >= 2.10); elsewhere the sequences are right-padded into one batched causal SDPA
call when that wastes little (exact), else each sequence is one causal SDPA call (no S x S either).
"""

from __future__ import annotations

import inspect
import logging
import math

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def _varlen_fn():
    """torch's varlen flash attention with a causal mask, or None where this torch has no usable one."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        return lambda q, k, v, cu, mx, scale: varlen_attn(q, k, v, cu, cu, mx, mx, is_causal=True, scale=scale)
    if "window_size" in params and "enable_gqa" in params:
        return lambda q, k, v, cu, mx, scale: varlen_attn(
            q, k, v, cu, cu, mx, mx, window_size=(-1, 0), scale=scale, enable_gqa=q.size(1) != k.size(1))
    return None


_VARLEN = {"fn": None, "checked": False, "broken": False}


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q [b, np, s, hn] over k, v [b, ng, s, hn] (GQA when ng < np) -> [b, np, s, hn]."""
    if not q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        # the CPU flash kernel's half-precision backward is ~3x slower than its fp32 one: attention (a few % of the
        # FLOPs here) runs in fp32, the matmuls around it stay bf16
        return causal_sdpa(q.float(), k.float(), v.float(), scale).to(q.dtype)
    gqa = q.size(1) != k.size(1)
    if gqa and q.is_cuda and q.dtype == torch.float32:
        # fp32 on CUDA has no flash kernel and the efficient one lacks GQA: expand KV rather than fall back to math.
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence. q [t, np, hn], k/v [t, ng, hn], cu_seqlens [n+1] -> [t, np, hn]."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and not _VARLEN["broken"]:
        if not _VARLEN["checked"]:
            _VARLEN["fn"], _VARLEN["checked"] = _varlen_fn(), True
        if _VARLEN["fn"] is not None:
            try:
                return _VARLEN["fn"](q, k, v, cu_seqlens.to(torch.int32), int(max_seqlen), scale)
            except (RuntimeError, TypeError, NotImplementedError) as err:  # older/newer torch: keep the exact loop
                logger.warning("varlen flash attention unavailable (%s); using one SDPA call per sequence", err)
                _VARLEN["broken"] = True
    bounds = cu_seqlens.tolist()
    if bounds[-1] != q.size(0):
        raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the packed row holds {q.size(0)} tokens")
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    if len(lengths) > 1 and len(lengths) * max(lengths) <= PAD_BATCH_MAX_WASTE * q.size(0):
        return _right_padded_batch(q, k, v, lengths, scale)
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        # [L, h, d] -> [1, h, L, d]
        qi, ki, vi = (x[start:end].permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))
        outs.append(causal_sdpa(qi, ki, vi, scale).squeeze(0).permute(1, 0, 2))
    return torch.cat(outs, dim=0)


# One batched SDPA call over right-padded sequences instead of one call per sequence, when the padding costs at most
# this factor in tokens: the per-call overhead dominates for the many short sequences of a GRPO batch on a CPU.
PAD_BATCH_MAX_WASTE = 2.0


def _right_padded_batch(q, k, v, lengths: list[int], scale: float) -> torch.Tensor:
    """Causal attention of packed sequences as one [n, h, L, d] SDPA call. Exact: with the padding on the right, a real
    query's causal window holds only real keys of its own sequence; padded queries are computed and dropped."""
    n, longest = len(lengths), max(lengths)
    lens = torch.tensor(lengths, device=q.device)
    seq = torch.repeat_interleave(torch.arange(n, device=q.device), lens)
    starts = torch.cumsum(lens, 0) - lens
    slot = seq * longest + (torch.arange(q.size(0), device=q.device) - starts[seq])  # packed token -> padded slot

    def pad(x):  # [t, h, d] -> [n, h, L, d]
        flat = x.new_zeros(n * longest, x.size(1), x.size(2)).index_copy(0, slot, x)
        return flat.view(n, longest, x.size(1), x.size(2)).transpose(1, 2)

    out = causal_sdpa(pad(q), pad(k), pad(v), scale)  # [n, h, L, d]
    return out.transpose(1, 2).reshape(n * longest, q.size(1), q.size(2)).index_select(0, slot)


try:
    from megatron.core.transformer.module import MegatronModule as _Base
except Exception:  # pragma: no cover - megatron is a hard dependency; keeps the module importable for docs
    _Base = torch.nn.Module


class SDPAttention(_Base):
    """Drop-in core attention for megatron's local spec (same constructor/forward contract as DotProductAttention)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, **_unused):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs the TransformerEngine spec (model.transformer_impl=te)")
        if pg_collection is not None and hasattr(pg_collection, "tp"):
            tp = pg_collection.tp.size()
        else:
            from megatron.core import parallel_state as ps

            tp = ps.get_tensor_model_parallel_world_size()
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(f"tensor parallel size {tp} must divide {config.num_attention_heads} attention heads "
                             f"and {config.num_query_groups} query groups")
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.attn_mask_type = attn_mask_type
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("SDPAttention runs without attention dropout (RL fine-tuning); set attention_dropout=0")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_unused):
        if attention_bias is not None:
            raise ValueError("SDPAttention does not take an attention bias")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed sequences must use qkv_format='thd', got {packed_seq_params.qkv_format!r}")
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            out = packed_causal_attention(query, key, value, cu, packed_seq_params.max_seqlen_q, self.softmax_scale)
            return out.reshape(out.size(0), -1)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if attention_mask is None:
            out = causal_sdpa(q, k, v, self.softmax_scale)
        else:
            # megatron's mask marks positions to DROP (True = masked); SDPA's boolean mask marks positions to KEEP.
            keep = ~attention_mask.bool()
            if q.size(1) != k.size(1):
                rep = q.size(1) // k.size(1)
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=self.softmax_scale)
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
