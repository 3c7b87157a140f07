"""trainer.hf_every=K: an HF folder of the live weights every K steps and at the last step, the form users evaluate.

    run_dir/hf/step_00000020/   config.json, generation config, tokenizer files, model*.safetensors (+ index)

Written from the weight stream the rollout engines receive (convert/export.py: full tensors in HF names, TP gathered,
PP broadcast, vocabulary padding stripped), so no conversion step is needed. Atomic: staged in
`hf/.tmp_step_N.<pid>` and renamed into place; the newest `trainer.keep_last` folders are kept. Every rank calls
`save` (the stream runs collectives); rank 0 writes.

The rules of training checkpoints hold here too: a snapshot is never seen half-written (staging, then rename); a
process killed while writing one leaves its staging folder, which the next start removes (also when hf_every is now
0); a full disk is one line (CheckpointWriteError, the line of every writer: checkpoint/save.full_disk_error) with
the staging folder removed, and a checkpoint still being written in the background abandoned. Snapshots are
written in the step, not in the background: the export gathers full tensors over TP / PP / EP (collectives), and a
background writer would have to hold a host copy of the whole model; a stop signal takes effect after a snapshot in
progress.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist

from .. import run_lock
from ..checkpoint import fsync_path
from ..checkpoint.save import full_disk_error
from ..convert.export import save_hf

HF_DIR = "hf"
PREFIX = "step_"


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class HFSnapshots:
    def __init__(self, run_dir, every: int, keep_last: int, total_steps: int, chunks, shape, model_dir):
        self.root = Path(run_dir) / HF_DIR
        self.run_dir, self.every, self.keep_last, self.total_steps = run_dir, every, keep_last, total_steps
        self.chunks, self.shape, self.model_dir = chunks, shape, model_dir
        if _rank0() and self.root.is_dir():  # snapshots killed while being written (never read): at every start
            run_lock.remove_stale(self.root, f".tmp_{PREFIX}*", run_dir)

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == self.total_steps)

    def maybe_save(self, step: int) -> Path | None:
        """Write the snapshot of `step` when it is due (all ranks). Returns its folder (rank 0)."""
        return self.save(step) if self.due(step) else None

    def save(self, step: int) -> Path | None:
        final = self.root / f"{PREFIX}{step:08d}"
        tmp = self.root / run_lock.staging_name(f".tmp_{PREFIX}{step:08d}")  # rank 0 names it; only rank 0 writes
        with run_lock.staging(tmp):
            try:
                if _rank0():
                    self.root.mkdir(parents=True, exist_ok=True)
                    run_lock.remove_stale(self.root, f".tmp_{PREFIX}*", self.run_dir)
                # the tied lm_head is not in HF files (the rollout stream adds it for vLLM on CPU; this one does not)
                save_hf(self.chunks, self.shape, tmp, self.model_dir, progress=False)
                if _rank0():
                    _fsync_tree(tmp)
                    if final.exists():  # the same step again (after a resume): the new one replaces it
                        shutil.rmtree(final)
                    os.replace(tmp, final)
                    fsync_path(self.root)
                    self._retain(final)
            except BaseException as exc:
                if _rank0():
                    full = full_disk_error(exc, tmp, f"HF snapshot step {step}")  # (also ends a pending save)
                    shutil.rmtree(tmp, ignore_errors=True)
                    if full is not None:
                        raise full from None
                raise
        return final if _rank0() else None

    def _retain(self, final: Path) -> None:
        kept = sorted(p for p in self.root.glob(f"{PREFIX}*") if p.is_dir())
        for p in kept[:-self.keep_last]:
            if p != final:
                shutil.rmtree(p, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, files in os.walk(folder):
        for name in files:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))
