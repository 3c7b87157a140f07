"""Resuming: the latest intact training checkpoint, restored on every rank.

Every candidate is first checked against its manifest (folders.checkpoint_problem), then loaded; a problem on any rank
counts for all (a collective), so every rank resumes the same step. A damaged latest checkpoint is named (step, file,
what is wrong) and skipped for the newest intact one, or the resume stops (strict). A layout the saved optimizer
state cannot follow is refused (state.layout_refusal), not taken for damage.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Callable

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections before megatron loads)

import torch
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core import dist_checkpointing

from .folders import (CheckpointError, STOP_STATE, TRAINER_STATE, _agreed, _barrier, _error_text, _rank,
    checkpoint_problem, checkpoint_root, newest_intact_step, resume_candidates, step_dir)
from .save import remove_stale_staging
from .state import (OPTIM_METADATA, _distopt_load_without_apex, _layout, _saved_content, _sharded_state_dict,
    layout_refusal, set_rng_state)
from .weights import load_model_state


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
    return {**trainer["extra"], "step": trainer["step"], "at_stop": _stop_state(path)}


def _stop_state(path: Path) -> dict | None:
    """What a stop left beside the checkpoint (save.save_stop_state), or None: none, or unreadable (said; the resume
    then regenerates that work, as after a crash)."""
    if not (path / STOP_STATE).is_file():
        return None
    try:
        return torch.load(path / STOP_STATE, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any damage: the checkpoint itself is intact
        if _rank() == 0:
            warnings.warn(f"{path / STOP_STATE}: unreadable ({_error_text(exc)}); the work in flight at the stop is "
                          f"generated anew", stacklevel=3)
        return None
