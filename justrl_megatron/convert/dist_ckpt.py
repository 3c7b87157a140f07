"""Megatron dist checkpoints of a model: save / load the weights, plus what is needed to rebuild it anywhere.

megatron's `dist_checkpointing` stores global tensors (layers stacked along a global layer axis, the padded vocab
allowed to change shape), so a checkpoint written at one TP x PP (x VPP) layout loads at any other. Next to the
weights a checkpoint folder holds:
  justrl_megatron.json   what wrote it (HF model shape, dtype, layout, padded vocab, step for training checkpoints)
  hf/                    the HF config, generation config and tokenizer files, so that export needs nothing else
The same layout is used by the converter (`justrl-convert hf-to-mcore`) and by training checkpoints
(`train/checkpoint.py`, which adds optimizer, scheduler, RNG and data position).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from ..model.hf_config import ModelShape
from .export import HF_SIDE_FILES
from .mapping import unwrap

META_FILE = "justrl_megatron.json"
HF_SUBDIR = "hf"


def model_sharded_state_dict(chunks) -> dict:
    """{"model": ...} (or "model0", "model1", ... with virtual pipeline stages), as Megatron-LM names them."""
    if len(chunks) == 1:
        return {"model": unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def load_model_state(chunks, loaded: dict) -> None:
    """Copy the model part of a loaded (plain) state dict into the chunks."""
    if len(chunks) == 1:
        unwrap(chunks[0]).load_state_dict(loaded["model"])
    else:
        for i, c in enumerate(chunks):
            unwrap(c).load_state_dict(loaded[f"model{i}"])


def is_dist_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / "metadata.json").exists()


def layout_meta(chunks, shape: ModelShape, **extra) -> dict:
    from megatron.core import parallel_state as ps

    model = unwrap(chunks[0])
    config = model.config
    vocab = model.embedding.word_embeddings.weight if model.pre_process else None
    return {
        "format": 1,
        "family": shape.family,
        "shape": dataclasses.asdict(shape),
        "dtype": str(config.params_dtype).removeprefix("torch."),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": config.virtual_pipeline_model_parallel_size,
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
        import shutil

        for name in HF_SIDE_FILES:
            if (Path(hf_source) / name).exists():
                shutil.copyfile(Path(hf_source) / name, hf / name)


def read_meta(ckpt_dir: str | os.PathLike) -> dict:
    path = Path(ckpt_dir) / META_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def save_model(chunks, ckpt_dir: str | os.PathLike) -> None:
    """All ranks: write the model weights of `chunks` as a dist checkpoint into the (existing, empty) folder."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(model_sharded_state_dict(chunks), str(ckpt_dir))


def load_model(chunks, ckpt_dir: str | os.PathLike) -> None:
    """All ranks: load model weights from a dist checkpoint (a converter output or a training checkpoint)."""
    from megatron.core import dist_checkpointing

    if not is_dist_checkpoint(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir} is not a megatron dist checkpoint (no metadata.json)")
    loaded = dist_checkpointing.load(model_sharded_state_dict(chunks), str(ckpt_dir))
    with torch.no_grad():
        load_model_state(chunks, loaded)
