"""Training checkpoint folders: where they live, which one is `latest`, and whether one is intact.

Layout (all under `run_dir/checkpoints/`):
  step_00000020/           one complete checkpoint: a megatron dist checkpoint (model + optimizer, global tensors, so
                           it reloads at another TP / PP), justrl_megatron.json (layout, shape), hf/ (HF config and
                           tokenizer, so `justrl-convert mcore-to-hf` needs nothing else), trainer_state.pt (step,
                           scheduler, caller's extra state), rng/rank00000.pt ... (every rank's RNG states),
                           manifest.json (written last: every file with its size, and a CRC32 of the small ones)
                           at_stop.pt (a stop only, after the commit: the work in flight then, for the resume)
  latest                   "step_00000020": written last, by atomic replace
  .tmp_step_00000030.<pid>/  a save in progress (or one that died): never read; named by its writer, removed by the
                           next start or save of the run dir's lock holder (run_lock.py), or at once when the save
                           fails

Damage after the fact (a truncated or deleted file, a bad disk, a copy cut short) is found by `checkpoint_problem`:
cheap (sizes, and checksums of the small files); checkpoints from before manifests are checked for their required
files and against their own shard index (.metadata). `_agreed` makes one rank's verdict every rank's.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from .weights import is_dist_checkpoint


LATEST = "latest"


STEP_PREFIX = "step_"


TMP_PREFIX = ".tmp_"


TRAINER_STATE = "trainer_state.pt"


MANIFEST = "manifest.json"  # written last into a complete checkpoint: its files, sizes and small files' CRC32


# a stop's work in flight, written into the committed checkpoint of the step the run stopped at (save_stop_state);
# outside the manifest: a resume reads it when it is there and intact, and resumes without it when not
STOP_STATE = "at_stop.pt"


CRC_MAX_BYTES = 16 << 20  # checksum files up to this size (metadata, common state, RNG); the big shards: size only


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


def _from_rank0(value):
    """Rank 0's `value` on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
