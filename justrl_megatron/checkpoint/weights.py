"""Model checkpoints: a megatron dist checkpoint of a model's weights, with what wrote it (converter output).

megatron's `dist_checkpointing` stores global tensors (layers stacked along a global layer axis, the padded vocab
allowed to change shape), so a checkpoint written at one TP x PP (x VPP) layout loads at any other. Next to the
weights a checkpoint folder holds:
  justrl_megatron.json   what wrote it (HF model shape, dtype, layout, padded vocab, step for training checkpoints)
  hf/                    the HF config, generation config and tokenizer files, so that export needs nothing else
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections before megatron loads)

import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps

from ..dtypes import torch_name
from ..model import lora
from ..model.build import unwrap
from ..model.hf_config import ModelShape, copy_side_files


META_FILE = "justrl_megatron.json"


HF_SUBDIR = "hf"


def _model_keys(chunks) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def model_sharded_state_dict(chunks) -> dict:
    """{"model": ...} (or "model0", "model1", ... with virtual pipeline stages), as Megatron-LM names them. With LoRA
    only the adapters: the frozen base weights are the HF model's (model/lora.py)."""
    if lora.has_lora(chunks):
        return {k: lora.sharded_state_dict(c) for k, c in zip(_model_keys(chunks), chunks)}
    return {k: unwrap(c).sharded_state_dict() for k, c in zip(_model_keys(chunks), chunks)}


def load_model_state(chunks, loaded: dict) -> None:
    """Copy the model part of a loaded (plain) state dict into the chunks."""
    for k, c in zip(_model_keys(chunks), chunks):
        if lora.has_lora(chunks):
            lora.load_state(c, loaded[k])
        else:
            unwrap(c).load_state_dict(loaded[k])


def is_dist_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / "metadata.json").exists()


def layout_meta(chunks, shape: ModelShape, **extra) -> dict:
    model = unwrap(chunks[0])
    config = model.config
    vocab = model.embedding.word_embeddings.weight if model.pre_process else None
    return {
        "format": 1,
        "family": shape.family,
        "shape": dataclasses.asdict(shape),
        "dtype": torch_name(config.params_dtype),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": config.virtual_pipeline_model_parallel_size,
        "ep": config.expert_model_parallel_size,
        "padded_vocab_size_per_tp_rank": None if vocab is None else int(vocab.shape[0]),
        **extra,
    }


def write_meta(ckpt_dir: str | os.PathLike, meta: dict, hf_source: str | os.PathLike | None) -> None:
    """Rank 0 only: the metadata file and a copy of the HF side files (config, tokenizer)."""
    ckpt_dir = Path(ckpt_dir)
    (ckpt_dir / META_FILE).write_text(json.dumps(meta, indent=2))
    if hf_source is not None:
        hf = ckpt_dir / HF_SUBDIR
        hf.mkdir(exist_ok=True)
        copy_side_files(hf_source, hf)


def read_meta(ckpt_dir: str | os.PathLike) -> dict:
    path = Path(ckpt_dir) / META_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def save_model(chunks, ckpt_dir: str | os.PathLike) -> None:
    """All ranks: write the model weights of `chunks` as a dist checkpoint into the (existing, empty) folder."""
    dist_checkpointing.save(model_sharded_state_dict(chunks), str(ckpt_dir))


def load_model(chunks, ckpt_dir: str | os.PathLike) -> None:
    """All ranks: load model weights from a dist checkpoint (a converter output or a training checkpoint)."""
    if not is_dist_checkpoint(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir} is not a megatron dist checkpoint (no metadata.json)")
    loaded = dist_checkpointing.load(model_sharded_state_dict(chunks), str(ckpt_dir))
    with torch.no_grad():
        load_model_state(chunks, loaded)
