"""Load an HF checkpoint into a live (sharded) Megatron model: how training starts from HF weights.

Each rank reads only what its own shards need, slice by slice, straight from the safetensors files (no rank ever
materialises the whole model), converts it with `mapping.hf_to_shard` and copies it into its parameters.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections before megatron loads)

import torch
from megatron.core import parallel_state as ps

from ..model.build import unwrap
from ..model.hf_config import ModelShape, model_shape
from .mapping import Entry, entry_for, hf_shapes, hf_to_shard, live_parameters, model_entries


class SafetensorsFolder:
    """Lazy, sliced access to the tensors of an HF folder (single file or sharded with an index). Opening it reads
    every file's header: a shard the index lists but the folder lacks, or a damaged header, fails here
    (FileNotFoundError / ValueError), before any work."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                self.file_of = dict(json.loads(index.read_text())["weight_map"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
            missing = sorted({f for f in self.file_of.values() if not (self.dir / f).exists()})
            if missing:
                raise FileNotFoundError(f"{self.dir}: {', '.join(missing)} listed in {index.name} but missing")
            for f in sorted(set(self.file_of.values())):
                self._open(f)
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                found = sorted(p.name for p in self.dir.iterdir()) if self.dir.is_dir() else "no such folder"
                raise FileNotFoundError(
                    f"{self.dir}: no *.safetensors weights (found: {found}). Re-save the model with "
                    f"save_pretrained(..., safe_serialization=True)")
            self.file_of = {}
            for f in files:
                self.file_of.update({k: f.name for k in self._open(f.name).keys()})
        self._handles: dict[str, object] = {}

    def _open(self, file: str):
        from safetensors import SafetensorError, safe_open

        try:
            return safe_open(str(self.dir / file), "pt")
        except SafetensorError as exc:
            raise ValueError(f"{self.dir / file}: not a readable safetensors file ({exc})") from None

    def names(self) -> set[str]:
        return set(self.file_of)

    def _slice(self, name: str):
        from safetensors import safe_open

        file = self.file_of[name]
        if file not in self._handles:
            path = self.dir / file
            if not path.exists():
                raise FileNotFoundError(f"{path} is listed in the index but missing")
            self._handles[file] = self._open(file)
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        sl = self._slice(name)
        if dim is None:
            return sl[:]
        if dim == 0:
            return sl[start:stop]
        return sl[:, start:stop]


def weights_problem(files: SafetensorsFolder, shape: ModelShape) -> str | None:
    """What in the weights does not fit the config (a tensor missing, or of another shape), from the headers only."""
    expected = hf_shapes(shape)
    if shape.tie_word_embeddings:
        expected.pop("lm_head.weight")
    names = files.names()
    missing = sorted(set(expected) - names)
    wrong = [f"{n} is {files.shape(n)}, the config says {s}" for n, s in expected.items()
             if n in names and files.shape(n) != s]
    if not missing and not wrong:
        return None
    what = [f"lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"] if missing else []
    what += [f"{wrong[0]}{f' (and {len(wrong) - 1} more)' if len(wrong) > 1 else ''}"] if wrong else []
    return "the weights do not match config.json: " + "; ".join(what)


def check_model_matches(shape: ModelShape, config) -> None:
    """The HF config and the built Megatron model must describe the same network."""
    pairs = [("num_hidden_layers", shape.num_layers, config.num_layers),
             ("hidden_size", shape.hidden_size, config.hidden_size),
             ("intermediate_size", shape.ffn_hidden_size, config.ffn_hidden_size),
             ("num_attention_heads", shape.num_attention_heads, config.num_attention_heads),
             ("num_key_value_heads", shape.num_query_groups, config.num_query_groups or config.num_attention_heads),
             ("head_dim", shape.head_dim, config.kv_channels),
             ("q/k norm (Qwen3)", shape.qk_norm, bool(config.qk_layernorm))]
    bad = [f"{name}: HF {a} vs Megatron {b}" for name, a, b in pairs if a != b]
    if bad:
        raise ValueError("the HF checkpoint does not match the Megatron model: " + "; ".join(bad))


def load_hf_weights(chunks, hf_dir: str | os.PathLike, *, progress: bool = True) -> int:
    """Copy the HF weights of `hf_dir` into this rank's shards of `chunks`. Returns the number of parameters set.

    Call it before building the optimizer, or call `optimizer.reload_model_params()` afterwards (mixed-precision
    optimizers keep their own fp32 copies).
    """
    from transformers import AutoConfig  # lazy: importing transformers takes seconds

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").exists():
        raise FileNotFoundError(f"{hf_dir}: no config.json (expected a Hugging Face model folder)")
    shape = model_shape(AutoConfig.from_pretrained(hf_dir))
    check_model_matches(shape, unwrap(chunks[0]).config)
    files = SafetensorsFolder(hf_dir)
    params = live_parameters(chunks)
    by_mcore = {e.mcore: e for e in model_entries(shape)}
    plan: list[tuple[str, Entry]] = [(name, entry_for(name, by_mcore, shape)) for name in params]

    missing = sorted({n for _, e in plan for n in e.hf} - files.names())
    if missing:
        raise KeyError(f"{hf_dir} lacks tensors the model needs: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    show = progress and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0)
    from tqdm import tqdm

    with torch.no_grad():
        for name, entry in tqdm(plan, desc=f"loading {hf_dir.name} into Megatron", disable=not show, unit="tensor"):
            param = params[name]
            shard = hf_to_shard(entry, files.read, shape, tp, rank, local_rows=param.shape[0])
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(f"{name}: HF {entry.hf} give a shard of shape {tuple(shard.shape)} but the model "
                                 f"parameter is {tuple(param.shape)} (TP rank {rank} of {tp})")
            param.data.copy_(shard)
    return len(plan)
