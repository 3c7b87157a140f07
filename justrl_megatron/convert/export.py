"""Streaming HF export from a LIVE sharded Megatron model: the weight stream the rollout engines receive every step.

Every rank runs the same plan: for each weight (in HF order) the pipeline stage that owns it all-gathers the TP shards,
turns them into HF tensors (`mapping.shards_to_hf`: QKV split, gate/up split, vocab padding stripped), and broadcasts
them over the pipeline group; tensors are grouped into buckets of about `bucket_bytes`, so no rank ever holds more than
one bucket of full tensors. One broadcast per (bucket, owning stage, dtype), not per tensor.

MoE experts live whole on one EP rank each (expert TP is 1): the owning stage's EP ranks receive each expert from its
EP rank by a broadcast over the EP group, one expert tensor at a time, so no rank holds more than one bucket of
experts either.

With LoRA the stream carries merged weights, W + scale * B A, computed per shard (model/lora.py).

Every rank of the job must iterate the stream to the end, in step (it runs collectives); every rank receives every
bucket. Tensors from the rank's own stage may alias live parameters: copy them if you keep them across an update.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections before megatron loads)

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ..model.hf_config import ModelShape, copy_side_files
from ..model.lora import merged_weight
from .mapping import TP_WHOLE_KINDS, Entry, hf_shapes, live_parameters, model_entries, router_name

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass
class _Planned:
    entry: Entry
    owner: int  # pipeline-parallel rank (group rank) that holds this weight
    dtype: torch.dtype
    nbytes: int


def _groups():
    """(tp size, tp group, pp size, pp group) of megatron's parallel state; size 1 groups are not used."""
    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group(),
            ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_group())


def _plan(chunks, shape: ModelShape, dtype: torch.dtype | None, bucket_bytes: int):
    """Who owns what, and the buckets: the same on every rank."""
    tp, _, pp, pp_group = _groups()
    params = live_parameters(chunks)
    entries = model_entries(shape)
    # an expert counts as this stage's when its layer is (another EP rank of the stage may hold it)
    owned = {e.mcore: str(params[e.mcore if e.mcore in params else router_name(e)].dtype).removeprefix("torch.")
             for e in entries if e.mcore in params or (e.expert is not None and router_name(e) in params)}
    if pp > 1:
        per_stage: list[dict] = [None] * pp  # type: ignore[list-item]
        dist.all_gather_object(per_stage, owned, group=pp_group)
    else:
        per_stage = [owned]
    sizes = hf_shapes(shape)
    planned = []
    for e in entries:
        owner = next((s for s, names in enumerate(per_stage) if e.mcore in names), None)
        if owner is None:
            raise RuntimeError(f"no pipeline stage holds {e.mcore}: the model does not match {shape.family} {shape}")
        dt = dtype or getattr(torch, per_stage[owner][e.mcore])
        numel = sum(_numel(sizes[n]) for n in e.hf)
        if e.mcore == "embedding.word_embeddings.weight" and shape.tie_word_embeddings:
            numel *= 2  # room for the lm_head copy, if asked for
        planned.append(_Planned(e, owner, dt, numel * dt.itemsize))
    buckets: list[list[_Planned]] = [[]]
    size = 0
    for p in planned:
        if buckets[-1] and size + p.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.nbytes
    return params, buckets


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _expert_from_its_ep_rank(p: _Planned, params: dict, shape: ModelShape) -> torch.Tensor:
    """Expert p.entry.expert's Megatron tensor on every EP rank of the stage: broadcast from the EP rank holding it."""
    ep = ps.get_expert_model_parallel_world_size()
    param = params.get(p.entry.mcore)
    if ep == 1:
        return merged_weight(param)
    holder = p.entry.expert // (shape.num_experts // ep)
    if param is not None:
        data = merged_weight(param).contiguous()
    else:
        f, h = shape.moe_ffn_hidden_size, shape.hidden_size
        like = params[router_name(p.entry)]
        data = torch.empty((2 * f, h) if p.entry.kind == "expert_fc1" else (h, f), dtype=like.dtype, device=like.device)
    group = ps.get_expert_model_parallel_group()
    dist.broadcast(data, dist.get_global_rank(group, holder), group=group)
    return data


def _full_hf_tensors(p: _Planned, params: dict, shape: ModelShape, tp: int, tp_group) -> list[torch.Tensor]:
    from .mapping import shards_to_hf

    if p.entry.expert is not None:
        data = _expert_from_its_ep_rank(p, params, shape)
    else:
        data = merged_weight(params[p.entry.mcore])  # with LoRA: W + scale * B A (the engines need no LoRA support)
    if tp > 1 and p.entry.kind not in TP_WHOLE_KINDS:
        shards = [torch.empty_like(data) for _ in range(tp)]
        dist.all_gather(shards, data.contiguous(), group=tp_group)
    else:
        shards = [data]
    return [t.to(p.dtype).contiguous() for t in shards_to_hf(p.entry, shards, shape)]


def export_hf_stream(
    chunks,
    shape: ModelShape,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    include_tied_lm_head: bool = False,
    dtype: torch.dtype | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets of `(hf_name, full_tensor)` from the live sharded `chunks`, on every rank.

    `dtype` casts the exported tensors (default: the parameters' dtype). With tied embeddings, HF has no
    `lm_head.weight`; `include_tied_lm_head=True` emits it too (a copy of the embeddings), as vLLM on CPU needs it.
    """
    tp, tp_group, pp, pp_group = _groups()
    my_stage = ps.get_pipeline_model_parallel_rank()
    sizes = hf_shapes(shape)
    params, buckets = _plan(chunks, shape, dtype, bucket_bytes)
    with torch.no_grad():
        for bucket in buckets:
            out: list[tuple[str, torch.Tensor]] = []
            # segments: consecutive weights with the same owner and dtype travel in one broadcast
            segments: list[list[_Planned]] = []
            for p in bucket:
                if segments and (segments[-1][-1].owner, segments[-1][-1].dtype) == (p.owner, p.dtype):
                    segments[-1].append(p)
                else:
                    segments.append([p])
            for seg in segments:
                names = [n for p in seg for n in p.entry.hf]
                if seg[0].owner == my_stage:
                    tensors = [t for p in seg for t in _full_hf_tensors(p, params, shape, tp, tp_group)]
                    if pp > 1:
                        flat = torch.cat([t.reshape(-1) for t in tensors])
                        dist.broadcast(flat, dist.get_global_rank(pp_group, seg[0].owner), group=pp_group)
                else:
                    numels = [_numel(sizes[n]) for n in names]
                    flat = torch.empty(sum(numels), dtype=seg[0].dtype, device=_device(params))
                    dist.broadcast(flat, dist.get_global_rank(pp_group, seg[0].owner), group=pp_group)
                    tensors = [t.view(sizes[n]) for t, n in zip(flat.split(numels), names)]
                for n, t in zip(names, tensors):
                    out.append((n, t))
                    if n == "model.embed_tokens.weight" and shape.tie_word_embeddings and include_tied_lm_head:
                        out.append(("lm_head.weight", t.clone()))
            yield out


def _device(params: dict[str, torch.Tensor]) -> torch.device:
    return next(iter(params.values())).device if params else torch.device("cpu")


def save_hf(
    chunks,
    shape: ModelShape,
    out_dir: str | os.PathLike,
    source_dir: str | os.PathLike | None,
    *,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = 2 << 30,
    progress: bool = True,
) -> Path | None:
    """Write the live model as an HF folder (safetensors, one file per bucket + index) on global rank 0.

    Every rank must call it (it runs the export collectives). `source_dir` holds the HF config, generation config and
    tokenizer files copied along (config `torch_dtype` is set to the exported dtype). Returns out_dir on rank 0.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    out_dir = Path(out_dir)
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
        stale = sorted(out_dir.glob("*.safetensors")) + sorted(out_dir.glob("*.safetensors.index.json"))
        for f in stale:  # a previous export's shards would mix with ours
            f.unlink()
    buckets = _plan(chunks, shape, dtype, bucket_bytes)[1]
    n_files = len(buckets)
    weight_map: dict[str, str] = {}
    total = 0
    export_dtype = None
    stream = export_hf_stream(chunks, shape, bucket_bytes=bucket_bytes, dtype=dtype)
    for i, bucket in enumerate(tqdm(stream, total=n_files, desc=f"writing {out_dir.name}", unit="file",
                                    disable=not (progress and rank0))):
        if not rank0:
            continue
        fname = "model.safetensors" if n_files == 1 else f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        # a CPU copy: tensors may live on the GPU, or alias live parameters / one shared buffer (safetensors refuses)
        save_file({n: t.detach().to("cpu", copy=True) for n, t in bucket}, str(out_dir / fname),
                  metadata={"format": "pt"})
        os.chmod(out_dir / fname, 0o644)
        for n, t in bucket:
            weight_map[n] = fname
            total += t.numel() * t.element_size()
            export_dtype = t.dtype
    if not rank0:
        return None
    if n_files > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if source_dir is not None:
        copy_side_files(source_dir, out_dir, export_dtype)
    return out_dir
