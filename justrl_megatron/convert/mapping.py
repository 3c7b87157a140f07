"""HF <-> Megatron weight mapping for Qwen2/2.5, Qwen3, Llama, Mistral, Mixtral and Qwen3-MoE, and how each weight is
split over TP (and, for experts, EP) ranks.

All families share HF names (`model.layers.{i}.self_attn.q_proj.weight`, ...); they differ in the QKV bias, Qwen3's
q/k norms (`self_attn.q_norm.weight`, one [head_dim] weight shared by all heads) and tied embeddings, which the
`ModelShape` says; head_dim comes from the shape, never from hidden/heads. One `Entry` is one Megatron weight (global
layer index) and the HF tensors it is made of. Its `kind` says how it is laid out and split over TP:

  replicated  RMSNorm weights (also the q/k norms): the same on every TP rank.
  row         linear_proj / linear_fc2 (RowParallelLinear): split along the input dim (1).
  vocab       word embeddings / output layer: split along the vocab dim (0); the vocab is padded to a multiple of
              (make_vocab_size_divisible_by x TP) with zero rows on import and stripped on export.
  qkv         linear_qkv weight/bias: q, k, v interleaved per query group, [g0: q heads of g0, k0, v0 | g1: ...];
              TP rank r holds a contiguous run of whole query groups.
  fc1         linear_fc1 (SwiGLU): each TP rank holds [gate slice r ; up slice r] (megatron chunks the output in two).
  expert_fc1  one MoE expert's linear_fc1, [gate ; up], whole (expert TP is 1) on the EP rank that holds the expert.
  expert_fc2  one MoE expert's linear_fc2 (down_proj), whole, likewise.
MoE layers (Mixtral, Qwen3-MoE) have a router (`mlp.router.weight`, HF `...gate.weight`, replicated) and E experts;
their Megatron names here carry the GLOBAL expert index (`mlp.experts.local_experts.{e}`): EP rank r holds experts
r*E/EP .. (r+1)*E/EP - 1 as its local experts 0 .. E/EP - 1 (`live_parameters` renames them). The HF names are the
per-expert ones transformers saves and vLLM loads (Mixtral: `block_sparse_moe.experts.{e}.w1/w3/w2` = gate/up/down;
Qwen3-MoE: `mlp.experts.{e}.gate_proj/up_proj/down_proj`: each family's `moe_module` and `expert_projections`,
model/families.py), not transformers 5's fused in-memory `gate_up_proj`.

`hf_to_shard` builds one TP rank's shard from HF tensors, reading only the rows/columns that rank needs (via `read`);
`shards_to_hf` turns the full list of TP shards back into the HF tensors, bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import re

import torch

from ..model.build import unwrap
from ..model.families import FAMILIES
from ..model.hf_config import ModelShape

# read(hf_name, dim, start, stop) -> tensor; dim=None means the whole tensor
Reader = Callable[[str, "int | None", int, int], torch.Tensor]


@dataclass(frozen=True)
class Entry:
    mcore: str  # global Megatron name (local-spec keys), e.g. "decoder.layers.3.mlp.linear_fc1.weight"
    hf: tuple[str, ...]  # the HF tensors it is made of, in order
    kind: str  # replicated | row | vocab | qkv | fc1 | expert_fc1 | expert_fc2
    expert: int | None = None  # the global expert index of an expert weight


# kinds whose tensor is whole on every TP rank (experts: expert TP is 1)
TP_WHOLE_KINDS = ("replicated", "expert_fc1", "expert_fc2")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")


def _hf_expert_names(shape: ModelShape, i: int, e: int) -> tuple[str, str, str]:
    """(gate, up, down) of expert e in layer i, as the hub's files name them."""
    family = FAMILIES[shape.family]
    p = f"model.layers.{i}.{family.moe_module}.experts.{e}."
    gate, up, down = family.expert_projections
    return p + f"{gate}.weight", p + f"{up}.weight", p + f"{down}.weight"


def _hf_router_name(shape: ModelShape, i: int) -> str:
    return f"model.layers.{i}.{FAMILIES[shape.family].moe_module}.gate.weight"


def _mlp_entries(shape: ModelShape, i: int) -> list[Entry]:
    m, h = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
    if not shape.num_experts:
        return [Entry(m + "linear_fc1.weight", (h + "gate_proj.weight", h + "up_proj.weight"), "fc1"),
                Entry(m + "linear_fc2.weight", (h + "down_proj.weight",), "row")]
    out = [Entry(m + "router.weight", (_hf_router_name(shape, i),), "replicated")]
    for e in range(shape.num_experts):
        gate, up, down = _hf_expert_names(shape, i, e)
        x = f"{m}experts.local_experts.{e}."
        out += [Entry(x + "linear_fc1.weight", (gate, up), "expert_fc1", e),
                Entry(x + "linear_fc2.weight", (down,), "expert_fc2", e)]
    return out


def router_name(entry: Entry) -> str:
    """The Megatron router of an expert entry's layer: present on every rank of the stage that holds the layer."""
    return entry.mcore.split("experts.local_experts.")[0] + "router.weight"


def layer_entries(shape: ModelShape, i: int) -> list[Entry]:
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    attn = h + "self_attn."
    out = [
        Entry(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "replicated"),
        Entry(m + "self_attention.linear_qkv.weight",
              (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), "qkv"),
    ]
    if shape.qkv_bias:
        out.append(Entry(m + "self_attention.linear_qkv.bias",
                         (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"), "qkv"))
    if shape.qk_norm:
        out += [Entry(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "replicated"),
                Entry(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "replicated")]
    out += [
        Entry(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"),
        Entry(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated"),
    ]
    return out + _mlp_entries(shape, i)


def model_entries(shape: ModelShape) -> list[Entry]:
    """Every weight of the model, in HF order (embeddings, layers 0..L-1, final norm, lm_head unless tied)."""
    out = [Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for i in range(shape.num_layers):
        out += layer_entries(shape, i)
    out.append(Entry("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not shape.tie_word_embeddings:
        out.append(Entry("output_layer.weight", ("lm_head.weight",), "vocab"))
    return out


def hf_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """The full HF shape of every HF tensor (also of `lm_head.weight` when tied, as vLLM may want it)."""
    h, d, f, v = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size, shape.vocab_size
    q, kv = shape.num_attention_heads * d, shape.num_query_groups * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                       "lm_head.weight": (v, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
        })
        if shape.num_experts:
            fe = shape.moe_ffn_hidden_size
            out[_hf_router_name(shape, i)] = (shape.num_experts, h)
            for e in range(shape.num_experts):
                gate, up, down = _hf_expert_names(shape, i, e)
                out.update({gate: (fe, h), up: (fe, h), down: (h, fe)})
        else:
            out.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                        p + "mlp.down_proj.weight": (h, f)})
        if shape.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
        if shape.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return out


# TE fuses the norms into the following linear; its parameter names differ from the local spec's.
_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def live_parameters(chunks) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters under global Megatron names (local-spec keys, global layer indices).

    Layer indices come from each layer's `layer_number` (1-based, global), so any PP / VPP layout works; expert
    indices from the MoE layer's `local_expert_indices` (global), so any EP layout works. On the last
    pipeline stage of a tied model, `output_layer.weight` is megatron's copy of the embeddings (kept in sync by its
    embedding group); it keeps its name here and maps to the embedding entry (see `entry_for`).
    """
    out: dict[str, torch.nn.Parameter] = {}
    for chunk in chunks:
        model = unwrap(chunk)
        if model.pre_process:
            out["embedding.word_embeddings.weight"] = model.embedding.word_embeddings.weight
        for layer in model.decoder.layers:
            prefix = f"decoder.layers.{layer.layer_number - 1}."
            experts = getattr(layer.mlp, "local_expert_indices", None)
            for name, param in layer.named_parameters():
                name = _TE_TO_LOCAL.get(name, name)
                if experts is not None:  # local expert j -> its global index
                    name = _LOCAL_EXPERT.sub(lambda m: f"mlp.experts.local_experts.{experts[int(m.group(1))]}.", name)
                out[prefix + name] = param
        if model.post_process:
            norm = getattr(model.decoder, "final_layernorm", None)
            if norm is not None:
                out["decoder.final_layernorm.weight"] = norm.weight
            weight = getattr(model.output_layer, "weight", None)
            if weight is not None:  # None when tied on a single stage (the head uses the embedding weight)
                out["output_layer.weight"] = weight
    return out


def entry_for(name: str, by_mcore: dict[str, Entry], shape: ModelShape) -> Entry:
    if name == "output_layer.weight" and shape.tie_word_embeddings:
        return by_mcore["embedding.word_embeddings.weight"]  # last stage's copy of the tied embeddings
    if name not in by_mcore:
        raise KeyError(f"Megatron parameter {name!r} has no HF counterpart for {shape.family} "
                       f"(qkv_bias={shape.qkv_bias}, qk_norm={shape.qk_norm}); is the model built with a different "
                       f"config than the HF one?")
    return by_mcore[name]


# --- HF -> one TP shard -----------------------------------------------------------------------------------------------

def hf_to_shard(entry: Entry, read: Reader, shape: ModelShape, tp: int, rank: int, local_rows: int) -> torch.Tensor:
    """TP rank `rank`'s shard of `entry`, reading only the slices it needs. `local_rows` is the shard's dim-0 size
    (used for the padded vocab)."""
    kind = entry.kind
    if kind in ("replicated", "expert_fc2"):
        return read(entry.hf[0], None, 0, 0)
    if kind == "expert_fc1":
        return torch.cat([read(n, None, 0, 0) for n in entry.hf])
    if kind == "row":  # linear_proj takes the attention output, linear_fc2 the FFN activations
        inputs = shape.num_attention_heads * shape.head_dim if "linear_proj" in entry.mcore else shape.ffn_hidden_size
        cols = inputs // tp
        return read(entry.hf[0], 1, rank * cols, (rank + 1) * cols)
    if kind == "vocab":
        start, stop = rank * local_rows, (rank + 1) * local_rows
        real = read(entry.hf[0], 0, min(start, shape.vocab_size), min(stop, shape.vocab_size))
        if real.shape[0] == local_rows:
            return real
        pad = torch.zeros((local_rows - real.shape[0],) + tuple(real.shape[1:]), dtype=real.dtype)
        return torch.cat([real, pad])  # padded vocab rows: zeros (never real tokens; stripped on export)
    if kind == "fc1":
        rows = shape.ffn_hidden_size // tp
        return torch.cat([read(n, 0, rank * rows, (rank + 1) * rows) for n in entry.hf])
    if kind == "qkv":
        groups = shape.num_query_groups // tp
        d, per_group_q = shape.head_dim, shape.num_attention_heads // shape.num_query_groups
        g0, g1 = rank * groups, (rank + 1) * groups
        q = read(entry.hf[0], 0, g0 * per_group_q * d, g1 * per_group_q * d)
        k = read(entry.hf[1], 0, g0 * d, g1 * d)
        v = read(entry.hf[2], 0, g0 * d, g1 * d)
        rest = tuple(q.shape[1:])
        parts = [q.reshape((groups, per_group_q * d) + rest), k.reshape((groups, d) + rest),
                 v.reshape((groups, d) + rest)]
        return torch.cat(parts, dim=1).reshape((-1,) + rest)
    raise ValueError(f"unknown weight kind {kind!r}")


# --- all TP shards -> HF ----------------------------------------------------------------------------------------------

def shards_to_hf(entry: Entry, shards: list[torch.Tensor], shape: ModelShape) -> list[torch.Tensor]:
    """The HF tensors of `entry` from all TP shards (in TP-rank order); vocab padding stripped."""
    kind = entry.kind
    if kind in ("replicated", "expert_fc2"):
        return [shards[0]]
    if kind == "expert_fc1":
        return list(shards[0].chunk(2, dim=0))
    if kind == "row":
        return [torch.cat(shards, dim=1) if len(shards) > 1 else shards[0]]
    if kind == "vocab":
        full = torch.cat(shards) if len(shards) > 1 else shards[0]
        return [full[: shape.vocab_size]]
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if kind == "qkv":
        d, per_group_q = shape.head_dim, shape.num_attention_heads // shape.num_query_groups
        q, k, v = [], [], []
        for s in shards:
            rest = tuple(s.shape[1:])
            g = s.reshape((-1, (per_group_q + 2) * d) + rest)
            q.append(g[:, : per_group_q * d].reshape((-1,) + rest))
            k.append(g[:, per_group_q * d: (per_group_q + 1) * d].reshape((-1,) + rest))
            v.append(g[:, (per_group_q + 1) * d:].reshape((-1,) + rest))
        return [torch.cat(q), torch.cat(k), torch.cat(v)]
    raise ValueError(f"unknown weight kind {kind!r}")
