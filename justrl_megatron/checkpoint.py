"""Checkpoints: megatron dist checkpoints of a model (converter output) and complete training checkpoints.

Below both convert/ and train/ (it imports neither): `justrl-convert` writes and reads model checkpoints, the training
loop saves and resumes training checkpoints, and `justrl-convert mcore-to-hf` reads either.

Model checkpoints. megatron's `dist_checkpointing` stores global tensors (layers stacked along a global layer axis,
the padded vocab allowed to change shape), so a checkpoint written at one TP x PP (x VPP) layout loads at any other.
Next to the weights a checkpoint folder holds:
  justrl_megatron.json   what wrote it (HF model shape, dtype, layout, padded vocab, step for training checkpoints)
  hf/                    the HF config, generation config and tokenizer files, so that export needs nothing else

Training checkpoints: model, optimizer, LR schedule, RNG states, data position and step; atomic; exact resume.
Layout (all under `run_dir/checkpoints/`):
  step_00000020/           one complete checkpoint: a megatron dist checkpoint (model + optimizer, global tensors, so
                           it reloads at another TP / PP), justrl_megatron.json (layout, shape), hf/ (HF config and
                           tokenizer, so `justrl-convert mcore-to-hf` needs nothing else), trainer_state.pt (step,
                           scheduler, caller's extra state), rng/rank00000.pt ... (every rank's RNG states)
  latest                   "step_00000020": written last, by atomic replace
  .tmp_step_00000030.<pid>/  a save in progress (or one that died): never read; named by its writer, removed by the
                           next start or save of the run dir's lock holder (run_lock.py), or at once when the save
                           fails

Atomicity: every rank writes into the temp folder and fsyncs; after a barrier rank 0 writes manifest.json (every file
with its size, and a CRC32 of the small ones), renames the folder to step_N, fsyncs, then replaces `latest`. A crash
at any point leaves `latest` on the previous complete checkpoint.
Damage after the fact (a truncated or deleted file, a bad disk, a copy cut short): on resume every candidate is first
checked against its manifest (cheap: sizes, and checksums of the small files), then loaded; a problem on any rank
counts for all (a collective), so every rank resumes the same step. `load_latest_checkpoint` names the damaged
checkpoint (step, file, what is wrong) and falls back to the newest intact one, or stops (strict). Checkpoints from
before manifests are checked for their required files, against their own shard index (.metadata), and by loading.
Retention: after each save only the newest `keep_last` step folders are kept.
One writer: rank 0 takes the run dir's lock (run_lock.py) before its first save (justrl-train already holds it).
A full disk: the free space is checked before a save against the last checkpoint's size; a save that still fails
for lack of space (or fails in any way) removes its staging folder, leaves `latest` alone and raises
CheckpointWriteError, whose one-line message names the folder and the space needed.

Sharded optimizer state: the distributed optimizer's state is saved in megatron's `dp_reshardable` format: each rank
writes its own buckets (no gather onto DP rank 0, no communication, no copy beyond megatron's per-bucket views).
Plain optimizers keep their per-parameter format.

Async saves (`Checkpointer(async_save=True)`, trainer.async_save): the small files (common state, RNG, trainer state,
metadata) are written at once, the tensors by megatron's background writer while training goes on; `latest` moves
only at the commit (the writes finished on every rank, manifest written and verified). A save killed meanwhile leaves
only its staging folder, removed when the next run starts (`load_latest_checkpoint`, `remove_stale_staging`).

What a resume may change (run_config.py refuses the rest before any heavy work):
  * the data-parallel size: weights, optimizer state (both formats) and LR schedule reshard; RNG states are per rank,
    restored only at the same layout (a resharded run gets a warning);
  * TP / PP / VPP / EP / CP: model weights and plain-optimizer state reshard; the distributed optimizer's dp_reshardable
    state does not: refused in one line (`layout_refusal`) naming the way out (resume at the saved layout, or export
    the weights with `justrl-convert mcore-to-hf` and start afresh). Checkpoints from before dp_reshardable (the
    optimizer gathered, `fully_reshardable`) still load, at any layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import random
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Callable

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections before megatron loads)

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from . import compat, run_lock
from .dtypes import torch_name
from .model import lora
from .model.build import nonfinite_parameters, unwrap
from .model.hf_config import ModelShape, copy_side_files, model_shape

META_FILE = "justrl_megatron.json"
HF_SUBDIR = "hf"


# --- model checkpoints (weights + metadata) -------------------------------------------------------------------------

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


# --- training checkpoints -------------------------------------------------------------------------------------------

LATEST = "latest"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_"
TRAINER_STATE = "trainer_state.pt"
MANIFEST = "manifest.json"  # written last into a complete checkpoint: its files, sizes and small files' CRC32
CRC_MAX_BYTES = 16 << 20  # checksum files up to this size (metadata, common state, RNG); the big shards: size only
# The optimizer state's format; the same metadata must be used to save and to load, so a checkpoint records its own
# (megatron's content metadata; checkpoints without one used OPTIM_METADATA).
# Plain optimizers: per-parameter state, reshardable at any layout (the "fully_reshardable" name only keeps
# megatron's ChainedOptimizer from prefixing its keys: the format of every plain-optimizer checkpoint so far).
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
# The distributed optimizer: each rank writes its own buckets' state as it lies in memory (no gather onto DP rank 0,
# no communication, no extra copy), which reloads at another DP size but not at another TP / PP / EP / CP
# (`layout_refusal`). Checkpoints written before this format (OPTIM_METADATA: gathered, reshardable anywhere) load.
DISTOPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return checkpoint_root(run_dir) / f"{STEP_PREFIX}{step:08d}"


def latest_step(run_dir: str | os.PathLike) -> int | None:
    """The step of the last complete checkpoint (what `latest` points to), or None when there is none."""
    root = checkpoint_root(run_dir)
    pointer = root / LATEST
    if pointer.exists():
        name = pointer.read_text().strip()
        if name.startswith(STEP_PREFIX) and (root / name).is_dir():
            return int(name[len(STEP_PREFIX):])
    # no (readable) pointer: a crash between the rename and the pointer update; renamed folders are complete
    steps = sorted(int(p.name[len(STEP_PREFIX):]) for p in root.glob(f"{STEP_PREFIX}*") if p.is_dir())
    return steps[-1] if steps else None


class CheckpointError(Exception):
    """No checkpoint can be resumed (damaged, with trainer.resume=strict, or all of them), or one cannot be written
    (non-finite weights): the message says which file and what to do."""


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (a full disk): one line saying where, how much space is needed, and that
    `latest` is unchanged. Its staging folder is already removed."""


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: str | os.PathLike) -> None:
    """Rank 0, after every rank's files are written: manifest.json lists them (durably; call it last)."""
    folder = Path(folder)
    files = {}
    for rel in _files(folder):
        size = (folder / rel).stat().st_size
        files[rel] = {"bytes": size, **({"crc32": _crc32(folder / rel)} if size <= CRC_MAX_BYTES else {})}
    with open(folder / MANIFEST, "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def checkpoint_problem(folder: str | os.PathLike, *, training: bool = True) -> str | None:
    """What is wrong with a checkpoint folder ("<file>: <what>"), or None when it looks intact. Cheap: the manifest's
    sizes and checksums; without a manifest (written before manifests existed), the files a load needs and the shard
    sizes the checkpoint's own index implies.
    `training=False` for model checkpoints (converter outputs: no trainer state)."""
    folder = Path(folder)
    if not folder.is_dir():
        return "the folder is missing"
    manifest = folder / MANIFEST
    if not manifest.exists():
        needed = ["metadata.json", ".metadata", *([TRAINER_STATE] if training else [])]
        missing = [n for n in needed if not (folder / n).is_file()]
        if missing:
            return f"{', '.join(missing)} missing"
        empty = [rel for rel in _files(folder) if (folder / rel).stat().st_size == 0]
        return f"{empty[0]}: empty file" if empty else _shard_problem(folder)
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST}: unreadable ({exc})"
    for rel, want in files.items():
        path = folder / rel
        if not path.is_file():
            return f"{rel}: missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{rel}: {size} bytes, the manifest says {want['bytes']} (truncated or overwritten)"
        if "crc32" in want and _crc32(path) != want["crc32"]:
            return f"{rel}: contents differ from the manifest's checksum (corrupted)"
    return None


def _shard_problem(folder: Path) -> str | None:
    """Without a manifest: the dist checkpoint's own index (.metadata) says where each tensor lies in which shard
    file; a shard shorter than that was cut short."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(folder)).read_metadata().storage_data or {}
    except Exception as exc:  # noqa: BLE001 - whatever makes the index unreadable
        return f".metadata: unreadable ({_error_text(exc)})"
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(ends.items()):
        if not (folder / rel).is_file():
            return f"{rel}: missing"
        size = (folder / rel).stat().st_size
        if size < end:
            return f"{rel}: {size} bytes, the checkpoint's index needs {end} (truncated)"
    return None


def resume_candidates(run_dir: str | os.PathLike) -> list[int]:
    """The steps to try on resume, best first: what `latest` points to, then the older step folders, newest first."""
    latest = latest_step(run_dir)
    if latest is None:
        return []
    older = [int(p.name[len(STEP_PREFIX):]) for p in checkpoint_root(run_dir).glob(f"{STEP_PREFIX}*") if p.is_dir()]
    return [latest, *sorted((s for s in older if s < latest), reverse=True)]


def newest_intact_step(run_dir: str | os.PathLike, below: int | None = None) -> int | None:
    """The newest step (below `below`) whose folder passes `checkpoint_problem` (not loaded: a hint, not a promise)."""
    for step in resume_candidates(run_dir):
        if (below is None or step < below) and checkpoint_problem(step_dir(run_dir, step)) is None:
            return step
    return None


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """A dist checkpoint folder: the path itself, or the latest complete step of a training run folder (or of its
    checkpoints/ folder); None when it is neither."""
    path = Path(path)
    if is_dist_checkpoint(path):
        return path
    run_dir = path.parent if path.name == checkpoint_root(path.parent).name else path
    step = latest_step(run_dir) if checkpoint_root(run_dir).is_dir() else None
    return None if step is None else step_dir(run_dir, step)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def fsync_path(path: Path) -> None:
    """Flush a file or a folder (its entries: a rename into it survives a crash) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_durably(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_text_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def _layout() -> dict:
    layout = {"world": dist.get_world_size() if dist.is_initialized() else 1,
              "tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
              "vpp": getattr(ps, "get_virtual_pipeline_model_parallel_world_size", lambda: None)()}
    ep, cp = ps.get_expert_model_parallel_world_size(), ps.get_context_parallel_world_size()
    # EP1 / CP1 as before: older checkpoints keep matching
    return {**layout, **({"ep": ep} if ep != 1 else {}), **({"cp": cp} if cp != 1 else {})}


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if compat.cuda_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and compat.cuda_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _prime_empty_adam_state(optimizer) -> None:
    """Give a never-stepped torch Adam its state tensors (step 0, zero moments) before loading into it.

    Without apex / TE (the CPU build), megatron's DistributedOptimizer reads the common `step` out of the torch
    optimizer's per-parameter state when it builds its (loading) state dict, and a fresh Adam has none yet. The values
    are placeholders: the checkpoint overwrites them.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or len(inner.state) > 0:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p.data),
                                  "exp_avg_sq": torch.zeros_like(p.data)}


def _distopt_subs_without_apex(optimizer) -> list:
    """The DistributedOptimizers of `optimizer` that run megatron-core's torch-Adam fallback (no apex / TE: the CPU
    build), whose per-parameter "step" the two workarounds below handle; none where megatron is missing."""
    try:
        from megatron.core.optimizer import distrib_optimizer as dopt
    except ImportError:
        return []
    return [s for s in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(s, dopt.DistributedOptimizer) and not getattr(dopt, "HAVE_APEX_OR_TE", True)
            and not getattr(s.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)]


@contextlib.contextmanager
def _distopt_load_without_apex(optimizer):
    """Work around two bugs of megatron-core 0.16's DistributedOptimizer load without apex / TE (CPU builds).

    There the torch Adam state carries a per-parameter "step", which `load_state_dict` restores from the param groups:
      1. it puts ONE step tensor into every parameter's state; torch Adam increments it in place per parameter, so
         after the first step it reads 2 + n_params instead of 3 (bias corrections go wrong: resume is not exact);
      2. the per-parameter loaders then copy every key of that state from the checkpoint tensors, which (by design)
         hold no "step" -> KeyError.
    Handing each copy its own current step back makes (2) a no-op; after the load each parameter gets its own step
    tensor (1). Instance-level, only for the duration of the load; nothing happens where apex or TE is present.
    """
    subs = _distopt_subs_without_apex(optimizer)
    originals = {}
    for sub in subs:
        original = sub._set_main_param_and_optimizer_states

        def with_step(model_param, tensors, sub=sub, original=original):
            group, order = sub.model_param_group_index_map[model_param]
            state = sub.optimizer.state.get(sub.optimizer.param_groups[group]["params"][order], {})
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
            return original(model_param, tensors)

        originals[sub] = original
        sub._set_main_param_and_optimizer_states = with_step
    try:
        yield
    finally:
        for sub in originals:
            del sub._set_main_param_and_optimizer_states  # back to the class method
    for sub in subs:
        for state in sub.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(s, DistributedOptimizer) for s in getattr(optimizer, "chained_optimizers", [optimizer]))


def _model_layout() -> dict:
    """The model-parallel layout (not DP): what the distributed optimizer's buckets, and so its saved state, depend on."""
    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "vpp": getattr(ps, "get_virtual_pipeline_model_parallel_world_size", lambda: None)(),
            "ep": ps.get_expert_model_parallel_world_size(), "cp": ps.get_context_parallel_world_size()}


def _content_metadata(optimizer) -> dict:
    """What a checkpoint says about its own contents (megatron's content metadata, in common.pt)."""
    metadata = DISTOPT_METADATA if optimizer is not None and _is_distributed(optimizer) else OPTIM_METADATA
    return {"justrl_optimizer": dict(metadata), "justrl_model_layout": _model_layout()}


def _saved_content(path: Path) -> dict:
    """A checkpoint's content metadata ({} for checkpoints from before it was written)."""
    load = getattr(dist_checkpointing, "load_content_metadata", None)
    if load is None:
        from megatron.core.dist_checkpointing.serialization import load_content_metadata as load
    return load(str(path)) or {}


def layout_refusal(path: str | os.PathLike, optimizer) -> str | None:
    """One line when the distributed optimizer's state in `path` cannot load at this layout (its dp_reshardable
    format reshards over data parallelism only), naming what to do; None when it can."""
    saved = _saved_content(Path(path))
    if optimizer is None or saved.get("justrl_optimizer", OPTIM_METADATA) != DISTOPT_METADATA:
        return None
    before, now = saved["justrl_model_layout"], _model_layout()
    names = {"tp": "tensor", "pp": "pipeline", "vpp": "virtual_pipeline", "ep": "expert", "cp": "context"}
    changed = [k for k in names if before.get(k) != now[k]]
    if not changed:
        return None
    keep = " ".join(f"parallel.{names[k]}={before.get(k)}" for k in changed)
    changed = [f"{k} {before.get(k)} -> {now[k]}" for k in changed]
    return (f"{path} holds the distributed optimizer's state sharded for its model-parallel layout, which only the "
            f"data-parallel size may change ({', '.join(changed)}): resume with {keep} (any number of data-parallel "
            f"ranks), or export the weights (`justrl-convert mcore-to-hf --ckpt {path} --out DIR`) and start a new "
            f"run from DIR (the optimizer state starts afresh)")


def _sharded_state_dict(chunks, optimizer, is_loading: bool, metadata: dict | None = None) -> dict:
    """`metadata`: the optimizer format (loading: the checkpoint's; saving: this optimizer's, `_content_metadata`)."""
    sd = model_sharded_state_dict(chunks)
    if optimizer is not None:
        if is_loading:
            _prime_empty_adam_state(optimizer)
        metadata = metadata or _content_metadata(optimizer)["justrl_optimizer"]
        with _distopt_buckets_without_step(optimizer):
            sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=dict(metadata))
    return sd


@contextlib.contextmanager
def _distopt_buckets_without_step(optimizer):
    """Keep torch Adam's per-parameter "step" out of the dp_reshardable buckets (megatron-core 0.16 without apex / TE,
    the CPU build). That format saves every per-parameter state tensor as a slice of its bucket; a 1-element "step"
    does not fit that mapping and reads back as 0 (Adam's bias corrections then restart: measured, the second step
    after a resume differed). The step is saved once in the param groups anyway, and the load restores it from there
    (`_distopt_load_without_apex`). Instance-level, only while the sharded state dict is built."""
    subs = _distopt_subs_without_apex(optimizer)
    for sub in subs:
        original = sub._get_main_param_and_optimizer_states

        def without_step(model_param, original=original):
            return {k: v for k, v in original(model_param).items() if k != "step"}

        sub._get_main_param_and_optimizer_states = without_step
    try:
        yield
    finally:
        for sub in subs:
            del sub._get_main_param_and_optimizer_states  # back to the class method


def _stage(run_dir, step: int, tmp: Path, chunks, optimizer, scheduler, extra: dict, shape: ModelShape | None,
           hf_source, *, async_save: bool = False):
    """Phase 1 (all ranks): write everything into the temp folder `tmp`, durably. With `async_save` the tensors are
    not written yet: the returned megatron AsyncRequest writes them (everything else is written here)."""
    if _rank() == 0:
        tmp.mkdir(parents=True)  # empty: dist_checkpointing warns "Overwriting old incomplete" into a non-empty one
    _barrier()
    # torch_dist writes (and fsyncs) one file per rank plus metadata; common (non-tensor) state on rank 0
    with _writer_errors_raised_only(), _writers_ignore_stop_signals():
        request = dist_checkpointing.save(_sharded_state_dict(chunks, optimizer, is_loading=False), str(tmp),
                                          content_metadata=_content_metadata(optimizer),
                                          **({"async_sharded_save": True} if async_save else {}))
    (tmp / "rng").mkdir(exist_ok=True)
    _save_durably({"layout": _layout(), "rng": rng_state()}, tmp / "rng" / f"rank{_rank():05d}.pt")
    if _rank() == 0:
        _save_durably({"step": step, "scheduler": scheduler.state_dict() if scheduler is not None else None,
                       "extra": dict(extra)}, tmp / TRAINER_STATE)
        if shape is None and hf_source is not None:
            from transformers import AutoConfig  # only here: importing transformers takes seconds

            shape = model_shape(AutoConfig.from_pretrained(hf_source))
        if shape is not None:
            adapters = lora.settings(chunks)  # a LoRA checkpoint names its base model: it holds the adapters only
            extra_meta = {} if adapters is None else {"lora": adapters, "base_model": str(hf_source)}
            write_meta(tmp, layout_meta(chunks, shape, kind="train", step=step, **extra_meta), hf_source)
    return request


def _commit(run_dir, step: int, tmp: Path, keep_last: int | None) -> Path:
    """Phase 2 (all ranks; rank 0 acts): write and verify the manifest, rename into place, point `latest` at it,
    apply retention. A manifest that does not verify (a file changed under it) raises: `latest` stays."""
    root = checkpoint_root(run_dir)
    final = step_dir(run_dir, step)
    _barrier()  # every rank's files are written and fsynced
    problem = None
    if _rank() == 0:
        write_manifest(tmp)
        problem = checkpoint_problem(tmp)
    problem = _agreed(problem)
    if problem is not None:
        raise CheckpointError(f"checkpoint step {step} ({tmp}) does not match its own manifest: {problem}; `latest` "
                              f"is unchanged")
    if _rank() == 0:
        for dirpath, _, _ in os.walk(tmp):
            fsync_path(Path(dirpath))
        old = None
        if final.exists():  # re-saving a step (after a resume): keep the old one until the new one is in place
            old = root / f"{TMP_PREFIX}old_{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_path(root)
        _write_text_atomically(root / LATEST, final.name + "\n")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if keep_last:
            steps = sorted(p for p in root.glob(f"{STEP_PREFIX}*") if p.is_dir())
            for p in steps[:-keep_last]:
                if p != final:
                    shutil.rmtree(p, ignore_errors=True)
    _barrier()
    return final


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    chunks,
    optimizer,
    scheduler,
    extra: dict,
    *,
    keep_last: int | None = 3,
    shape: ModelShape | None = None,
    hf_source: str | os.PathLike | None = None,
) -> Path:
    """Save a complete training checkpoint for `step` (all ranks call it). Returns the step folder.

    `extra` is the caller's picklable state (data position, metrics, ...), saved from rank 0. `shape` and `hf_source`
    (the HF model folder) make the checkpoint self-describing for `justrl-convert mcore-to-hf`. Weights holding a NaN or
    inf on any rank are refused (CheckpointError) before anything is written.
    """
    saver = Checkpointer(run_dir, async_save=False, keep_last=keep_last, shape=shape, hf_source=hf_source)
    return saver.save(step, chunks, optimizer, scheduler, extra)


class Checkpointer:
    """Training checkpoints of one run dir. With `async_save` a save writes the small files at once and hands the
    tensors to megatron's background writer (a forked process: on CPU it writes the fork's copy-on-write view of the
    state at the save; on GPU megatron first copies this rank's tensors to host memory); the training goes on, and
    `poll` (every step, all ranks: a collective) commits the checkpoint once every rank's write has finished:
    manifest written and verified, folder renamed, then `latest`. At most one save is pending: the next `save`, and
    `wait`, block until it is committed. A save that fails (a full disk: CheckpointWriteError, one line) removes its
    staging folder and leaves `latest` alone; a process killed meanwhile leaves a staging folder that the next start
    removes (`remove_stale_staging`), never read."""

    def __init__(self, run_dir, *, async_save: bool, keep_last: int | None = 3, shape: ModelShape | None = None,
                 hf_source=None):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
        self.run_dir, self.async_save, self.keep_last = run_dir, async_save, keep_last
        self.shape, self.hf_source = shape, hf_source
        self._pending: _Pending | None = None

    @property
    def pending_step(self) -> int | None:
        return None if self._pending is None else self._pending.step

    def save(self, step: int, chunks, optimizer, scheduler, extra: dict) -> Path | None:
        """All ranks. Sync: the committed step folder. Async: None (`poll` / `wait` commit it)."""
        self.wait()
        self._pending = _start(self.run_dir, step, chunks, optimizer, scheduler, extra, self.keep_last, self.shape,
                               self.hf_source, async_save=self.async_save)
        return None if self.async_save else self.wait()

    def poll(self) -> Path | None:
        """Commit the pending save if every rank's write has finished (all ranks; never blocks on the write)."""
        return self._finish(blocking=False)

    def wait(self) -> Path | None:
        """Block until the pending save (if any) is written and committed; returns its folder."""
        return self._finish(blocking=True)

    def _finish(self, blocking: bool) -> Path | None:
        pending = self._pending
        if pending is None:
            return None
        try:
            if pending.queue is not None:
                if not pending.queue.maybe_finalize_async_calls(blocking=blocking):
                    return None  # still writing on some rank
            self._pending = None
            return _commit(self.run_dir, pending.step, pending.tmp, self.keep_last)
        except BaseException as exc:
            self._pending = None
            _failed(exc, self.run_dir, pending)
            raise
        finally:
            if self._pending is None:
                pending.staging.close()


@dataclasses.dataclass
class _Pending:
    step: int
    tmp: Path
    needed: int | None  # the last checkpoint's size (None: a first save)
    staging: contextlib.ExitStack  # keeps `tmp` registered as this process' staging folder (an abort removes it)
    queue: object | None  # megatron's AsyncCallsQueue writing the tensors (None: written already)


def _start(run_dir, step, chunks, optimizer, scheduler, extra, keep_last, shape, hf_source, *,
           async_save: bool) -> _Pending:
    bad = nonfinite_parameters(chunks)
    problem = _agreed(f"{len(bad)} weight tensors hold NaN or inf ({', '.join(bad[:3])}"
                      f"{', ...' if len(bad) > 3 else ''})" if bad else None)
    if problem is not None:  # a checkpoint is never written with non-finite weights
        raise CheckpointError(f"refusing to save step {step} in {checkpoint_root(run_dir)}: {problem}; the "
                              f"checkpoints already there are kept")
    root = checkpoint_root(run_dir)
    problem, needed = None, None
    if _rank() == 0:
        try:
            run_lock.hold(run_dir)  # one writer per run dir (justrl-train already holds it: a no-op then)
            root.mkdir(parents=True, exist_ok=True)
            run_lock.remove_stale(root, f"{TMP_PREFIX}{STEP_PREFIX}*", run_dir)  # saves that died before (never read)
            problem, needed = _space_problem(run_dir, step)
        except (run_lock.RunDirBusy, OSError) as exc:
            problem = str(exc)
    problem = _agreed(problem)
    if problem is not None:
        raise CheckpointWriteError(problem)
    # unique per writer; rank 0's name for every rank
    tmp = root / _from_rank0(run_lock.staging_name(f"{TMP_PREFIX}{STEP_PREFIX}{step:08d}"))
    staging = contextlib.ExitStack()
    staging.enter_context(run_lock.staging(tmp))
    pending = _Pending(step, tmp, needed, staging, None)
    try:
        request = _stage(run_dir, step, tmp, chunks, optimizer, scheduler, extra, shape, hf_source,
                         async_save=async_save)
        if request is not None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            pending.queue = AsyncCallsQueue(persistent=False)
            with _writer_errors_raised_only(), _writers_ignore_stop_signals():
                pending.queue.schedule_async_request(request)
    except BaseException as exc:
        _failed(exc, run_dir, pending)
        staging.close()
        raise
    return pending


def _failed(exc: BaseException, run_dir, pending: _Pending) -> None:
    """A save failed: remove its staging folder (nothing half-written stays: it would keep the disk full); a full disk
    becomes a one-line CheckpointWriteError (raised from here)."""
    root = checkpoint_root(run_dir)
    full = _disk_full(exc, root)
    if full:  # measured before the staging folder goes: what the save had, and how far it got
        free = shutil.disk_usage(root).free
        written = _folder_bytes(pending.tmp) if pending.tmp.is_dir() else 0
    shutil.rmtree(pending.tmp, ignore_errors=True)
    if full:
        raise CheckpointWriteError(_full_message(run_dir, pending.step, pending.needed, free=free,
                                                 written=written)) from None


_STOP_SIGNALS_IGNORED = False  # set while megatron forks its checkpoint writers


def _ignore_stop_signals_in_child() -> None:
    if _STOP_SIGNALS_IGNORED:
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)


os.register_at_fork(after_in_child=_ignore_stop_signals_in_child)


@contextlib.contextmanager
def _writers_ignore_stop_signals():
    """Checkpoint writers forked meanwhile ignore Ctrl-C / SIGTERM / SIGUSR1 (a terminal sends Ctrl-C to the whole
    process group): the trainer decides, and waits for the write before it exits (train/interrupt.py); an abort
    SIGKILLs them."""
    global _STOP_SIGNALS_IGNORED
    _STOP_SIGNALS_IGNORED = True
    try:
        yield
    finally:
        _STOP_SIGNALS_IGNORED = False


def remove_stale_staging(run_dir: str | os.PathLike) -> None:
    """At a run's start (rank 0, holding the run dir's lock): remove the staging folders of saves that never
    finished (a process killed while writing). Never read either way; this frees their space."""
    root = checkpoint_root(run_dir)
    if _rank() == 0 and root.is_dir():
        run_lock.remove_stale(root, f"{TMP_PREFIX}{STEP_PREFIX}*", run_dir)


@contextlib.contextmanager
def _writer_errors_raised_only():
    """megatron's checkpoint-writer processes log each failed write at ERROR and then the save raises it again: keep
    the log line off the console, the exception (which save_checkpoint reports) says it once."""
    writer_log = logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async")

    def drop(record):
        return record.levelno < logging.ERROR

    writer_log.addFilter(drop)  # (forked writers inherit it)
    try:
        yield
    finally:
        writer_log.removeFilter(drop)


FULL_BYTES = 16 << 20  # a failed save with less free space than this (before its staging is removed) ran out of it
MARGIN = 0.05, 1 << 20  # a save needs the last checkpoint's size + 5% + 1 MiB (metadata, optimizer steps grow it)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _space_problem(run_dir, step: int) -> tuple[str | None, int | None]:
    """(a one-line problem when the free space is below the last checkpoint's size, that size)."""
    last = latest_step(run_dir)
    if last is None:
        return None, None  # the first save: its size is not known yet (a failure is still caught while writing)
    needed = _folder_bytes(step_dir(run_dir, last))
    free = shutil.disk_usage(checkpoint_root(run_dir)).free
    if free >= _with_margin(needed):
        return None, needed
    return _full_message(run_dir, step, needed, free=free, written=None), needed


def _with_margin(nbytes: int) -> float:
    return nbytes * (1 + MARGIN[0]) + MARGIN[1]


def _full_message(run_dir, step: int, needed: int | None, *, free: int, written: int | None) -> str:
    """`written`: the bytes staged when the disk filled (None: refused before writing)."""
    last = latest_step(run_dir)
    if needed:
        need = f"about {_size(_with_margin(needed))} needed: the step-{last} checkpoint's size and a margin"
    else:  # a first save: only a lower bound is known
        need = f"more than the {_size(written or 0)} written before it filled are needed"
    what, left = (("not started: too little free space", "nothing was written") if written is None else
                  ("stopped: the disk is full", "the partial checkpoint was removed"))
    kept = f"`latest` still points to step {last}" if last is not None else "no checkpoint exists yet"
    return (f"checkpoint step {step} in {checkpoint_root(run_dir)}: {what} ({_size(free)} free, {need}); {left} and "
            f"{kept}: free some space (or move trainer.run_dir) and rerun the same command to resume")


def disk_full_message(exc: BaseException, folder: Path, what: str) -> str | None:
    """One line for a write into `folder` that failed for lack of space (None: another failure). For writers
    without a previous size to go by (HF snapshots)."""
    if not _disk_full(exc, folder.parent):
        return None
    written = _folder_bytes(folder) if folder.is_dir() else 0
    free = shutil.disk_usage(folder.parent).free
    return (f"{what} in {folder.parent}: stopped: the disk is full ({_size(free)} free, more than the "
            f"{_size(written)} written before it filled are needed); the partial folder was removed: free some space "
            f"(or move trainer.run_dir) and rerun the same command to resume")


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def _disk_full(exc: BaseException, root: Path) -> bool:
    """Whether a failed save ran out of space: ENOSPC / EDQUOT anywhere in the exception's causes (torch's
    CheckpointException carries one per failed rank), or next to no space left (torch.save's zip writer reports a
    short write only as "unexpected pos")."""
    with contextlib.suppress(OSError):
        if shutil.disk_usage(root).free < FULL_BYTES:
            return True
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return False


def _from_rank0(value):
    """Rank 0's `value` on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load_latest_checkpoint(run_dir: str | os.PathLike, chunks, optimizer, scheduler, *, strict: bool = False,
                           warn: Callable[[str], None] | None = None) -> dict | None:
    """Restore the latest intact checkpoint into chunks / optimizer / scheduler and this rank's RNG states.

    Returns the caller's extra state with "step" added, or None when there is no checkpoint (a fresh start). The
    optimizer may be None (weights only). A damaged latest checkpoint (see `checkpoint_problem`, or one that fails to
    load on any rank) is skipped with a message through `warn` (rank 0; default: warnings.warn) naming it, and the
    next older one is tried; all ranks agree on each verdict, so they resume the same step. `strict`: raise
    CheckpointError at the first damaged one instead. CheckpointError too when none is intact.
    """
    remove_stale_staging(run_dir)
    steps = resume_candidates(run_dir)
    if not steps:
        return None
    damaged = []
    for step in steps:
        path = step_dir(run_dir, step)
        problem = _agreed(checkpoint_problem(path))
        if problem is None and (refusal := _agreed(layout_refusal(path, optimizer))) is not None:
            raise CheckpointError(refusal)  # not damage: an older checkpoint has the same layout
        if problem is None:
            try:
                extra = _load(path, chunks, optimizer, scheduler)
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any failure to read it: try the previous
                # (torch's CheckpointException, raised on every rank when any rank's read failed, is a BaseException)
                extra, problem = None, f"loading it failed: {_error_text(exc)}"
            problem = _agreed(problem)
        if problem is None:
            if damaged and _rank() == 0:
                (warn or (lambda m: warnings.warn(m, stacklevel=3)))(
                    "; ".join(damaged) + f"; resuming from step {step} ({path}), the newest intact checkpoint "
                    f"(trainer.resume=auto; `strict` stops instead)")
            return extra
        damaged.append(f"checkpoint step {step} ({path}) is damaged: {problem}")
        if strict:
            previous = newest_intact_step(run_dir, below=step)
            hint = (f"step {previous} ({step_dir(run_dir, previous)}) looks intact: set trainer.resume=auto to resume "
                    f"from it, or remove {path}" if previous is not None else
                    f"no older checkpoint is intact: remove {checkpoint_root(run_dir)} to start over")
            raise CheckpointError(f"{damaged[-1]}; {hint}")
    raise CheckpointError("; ".join(damaged) + f"; no intact checkpoint is left: remove {checkpoint_root(run_dir)} to "
                          f"start over from the model's weights")


def _load(path: Path, chunks, optimizer, scheduler) -> dict:
    metadata = _saved_content(path).get("justrl_optimizer", OPTIM_METADATA)  # the format it was saved in
    loaded = dist_checkpointing.load(_sharded_state_dict(chunks, optimizer, is_loading=True, metadata=metadata),
                                     str(path))
    with torch.no_grad():
        load_model_state(chunks, loaded)
    if optimizer is not None:
        # no_grad: with fp32 params dp_reshardable copies into views of the (grad-requiring) parameters
        with _distopt_load_without_apex(optimizer), torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
    trainer = torch.load(path / TRAINER_STATE, weights_only=False)
    if scheduler is not None and trainer["scheduler"] is not None:
        scheduler.load_state_dict(trainer["scheduler"])
    rng_file = path / "rng" / f"rank{_rank():05d}.pt"
    saved = torch.load(rng_file, weights_only=False) if rng_file.exists() else None
    if saved is not None and saved["layout"] == _layout():
        set_rng_state(saved["rng"])
    elif _rank() == 0:
        warnings.warn(f"{path}: saved at layout {saved['layout'] if saved else 'unknown'}, resumed at {_layout()}: "
                      f"weights and optimizer state are resharded, RNG states are not restored", stacklevel=3)
    _barrier()
    return {**trainer["extra"], "step": trainer["step"]}


def _agreed(problem: str | None) -> str | None:
    """The first rank's problem, on every rank (None when no rank has one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p + (f" (on rank {r})" if r else "") for r, p in enumerate(problems) if p), None)


def _error_text(exc: BaseException, limit: int = 400) -> str:
    """One line: the root cause (torch's CheckpointException carries one exception per failed rank)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        failure = next(iter(failures.values()))
        exc = failure[0] if isinstance(failure, tuple) else failure  # (exception, stack summary)
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc)
    if "WeightsUnpickler error:" in text:  # torch.load's advice about weights_only hides what is wrong: the bytes
        detail = text.split("WeightsUnpickler error:")[1].split("Check the")[0].strip()
        text = f"not a torch-saved tensor ({detail})"
    text = " ".join(f"{type(exc).__name__}: {text}".split())
    return text if len(text) <= limit else text[:limit] + " ..."
