"""Saving training checkpoints: atomic, optionally asynchronous, and safe on a full disk.

Atomicity: every rank writes into the temp folder and fsyncs (`_stage`); after a barrier rank 0 writes manifest.json,
verifies it, renames the folder to step_N, fsyncs, then replaces `latest` (`_commit`). A crash at any point leaves
`latest` on the previous complete checkpoint. Retention: after each save only the newest `keep_last` step folders
are kept. One writer: rank 0 takes the run dir's lock (run_lock.py) before its first save (justrl-train already
holds it).

Async saves (`Checkpointer(async_save=True)`, trainer.async_save): the small files (common state, RNG, trainer state,
metadata) are written at once, the tensors by megatron's background writer while training goes on; `latest` moves
only at the commit (the writes finished on every rank, manifest written and verified). A save killed meanwhile leaves
only its staging folder, removed when the next run starts (`remove_stale_staging`).

A full disk: the free space is checked before a save against the last checkpoint's size; a save that still fails
for lack of space (or fails in any way) removes its staging folder, leaves `latest` alone and raises
CheckpointWriteError, whose one-line message names the folder and the space needed. Every other writer of the run
dir (metrics.jsonl, wandb, HF snapshots) ends on a full disk with the same line (`full_disk_error`), and a save
still being written then is abandoned (`Checkpointer.abandon`: its writer stopped, its staging folder removed).

A dying writer: an async save whose background writer process dies (killed: the out-of-memory killer picks it, it
has the trainer's footprint) is skipped: its staging folder is removed, `latest` stays, one warning line, and the
training goes on (the writer is a fork: the trainer's state is untouched; the next save writes a complete
checkpoint). So is a save one of whose write workers (forked by the writer) is killed: megatron's writer would wait
for it forever, so it is stopped (`_watch_workers`). At a stop or the last step, where no next save comes, a skipped
save is written again at once, synchronously.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import signal
import sys
import time
import weakref
from pathlib import Path

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections before megatron loads)

from megatron.core import dist_checkpointing

from .. import lifeline, run_lock
from ..model import lora
from ..model.build import nonfinite_parameters
from ..model.hf_config import ModelShape, model_shape
from .folders import (CheckpointError, CheckpointWriteError, LATEST, STEP_PREFIX, STOP_STATE, TMP_PREFIX, TRAINER_STATE,
    _agreed, _barrier, _from_rank0, _rank, _save_durably, _write_text_atomically, checkpoint_problem, checkpoint_root,
    fsync_path, latest_step, step_dir, write_manifest)
from .state import _content_metadata, _layout, _sharded_state_dict, rng_state
from .weights import layout_meta, write_meta


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
        self.skipped: int | None = None  # the step of the last save skipped because its writer died
        _CHECKPOINTERS.add(self)  # (a full disk on another writer abandons the save in progress: full_disk_error)

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

    def wait(self, *, rewrite_skipped: bool = False) -> Path | None:
        """Block until the pending save (if any) is written and committed; returns its folder. A save skipped because
        its writer died is written again at once (synchronously) with `rewrite_skipped`: the caller says the state
        is still the one it saved (a stop, the last step)."""
        pending = self._pending
        done = self._finish(blocking=True)
        if done is None and pending is not None and self.skipped == pending.step and rewrite_skipped:
            chunks, optimizer, scheduler, extra = pending.state
            self._pending = _start(self.run_dir, pending.step, chunks, optimizer, scheduler, extra, self.keep_last,
                                   self.shape, self.hf_source, async_save=False)
            done = self._finish(blocking=True)
            if _rank() == 0:
                print(f"justrl-train: checkpoint step {pending.step} written again (synchronously)", file=sys.stderr,
                      flush=True)
        return done

    def abandon(self) -> int | None:
        """This process only (no collective; for a run ending on an error, e.g. a full disk on another writer): stop
        the pending save's writer and remove its staging folder, so nothing half-written stays. `latest` stays.
        Returns the abandoned save's step (None: nothing was pending)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        _kill_writer(pending.writer)
        shutil.rmtree(pending.tmp, ignore_errors=True)
        pending.staging.close()
        return pending.step

    def _finish(self, blocking: bool) -> Path | None:
        pending = self._pending
        if pending is None:
            return None
        try:
            if pending.queue is not None:
                _watch_workers(pending, blocking)  # (local: a killed worker would keep the writer waiting forever)
                try:
                    if not pending.queue.maybe_finalize_async_calls(blocking=blocking):
                        return None  # still writing on some rank
                except BaseException as exc:  # (torch's CheckpointException is a BaseException)
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        raise
                    # megatron raises a failed write on every rank alike: a collective is safe here
                    dead = _agreed(pending.death or _writer_death(pending.writer))
                    if dead is None:
                        raise
                    self._pending = None
                    _failed(exc, self.run_dir, pending)  # (a full disk is still that one line)
                    self._skip(pending, dead)
                    return None
            self._pending = None
            return _commit(self.run_dir, pending.step, pending.tmp, self.keep_last)
        except BaseException as exc:
            self._pending = None
            if not isinstance(exc, CheckpointWriteError):  # (one is _failed's own line already)
                _failed(exc, self.run_dir, pending)
            raise
        finally:
            if self._pending is not pending:
                pending.staging.close()

    def _skip(self, pending: _Pending, dead: str) -> None:
        """A save whose writer died: skipped (staging already removed), said once, the training goes on."""
        self.skipped = pending.step
        if _rank() == 0:
            last = latest_step(self.run_dir)
            kept = f"`latest` still points to step {last}" if last is not None else "no checkpoint exists yet"
            print(f"justrl-train: warning: checkpoint step {pending.step} skipped: {dead}; its staging folder was "
                  f"removed and {kept}; training goes on (the next save writes a complete checkpoint)",
                  file=sys.stderr, flush=True)


@dataclasses.dataclass
class _Pending:
    step: int
    tmp: Path
    needed: int | None  # the last checkpoint's size (None: a first save)
    staging: contextlib.ExitStack  # keeps `tmp` registered as this process' staging folder (an abort removes it)
    queue: object | None  # megatron's AsyncCallsQueue writing the tensors (None: written already)
    writer: object | None = None  # its writer process (multiprocessing.Process), to tell a dead one
    state: tuple = ()  # (chunks, optimizer, scheduler, extra): what a skipped save writes again (Checkpointer.wait)
    death: str | None = None  # how one of the writer's own workers died (the writer was stopped for it)


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
    pending = _Pending(step, tmp, needed, staging, None, state=(chunks, optimizer, scheduler, extra))
    try:
        request = _stage(run_dir, step, tmp, chunks, optimizer, scheduler, extra, shape, hf_source,
                         async_save=async_save)
        if request is not None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            pending.queue = AsyncCallsQueue(persistent=False)
            with _writer_errors_raised_only(), _writers_ignore_stop_signals():
                pending.queue.schedule_async_request(request)
            calls = getattr(pending.queue, "async_calls", None)
            pending.writer = getattr(calls[-1].async_caller, "process", None) if calls else None
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


def _writer_death(writer) -> str | None:
    """How this rank's async writer process died (killed by a signal, or exited non-zero), or None: it lives, or
    ended normally (a write that failed in it is reported through megatron's queue, exit code 0)."""
    code = None if writer is None else writer.exitcode
    if code is None or code == 0:
        return None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = " (the out-of-memory killer's usual choice: it has the trainer's footprint)" if name == "SIGKILL" else ""
        return f"its writer process (pid {writer.pid}) was killed by {name}{why}"
    return f"its writer process (pid {writer.pid}) exited with code {code}"


def _watch_workers(pending: _Pending, blocking: bool) -> None:
    """megatron's writer forks one worker per write bucket and waits for each to say it is done: a worker killed
    (the out-of-memory killer may pick it as well) would keep it waiting forever, and the trainer with it. Such a
    death stops the writer (this rank only, no collective); the save is then skipped as for a dead writer. With
    `blocking`, watched until the writer ends."""
    writer = pending.writer
    while writer is not None and pending.death is None and writer.is_alive():
        pending.death = _killed_worker(writer)
        if pending.death is not None:
            _kill_writer(writer)
        elif not blocking:
            return
        else:
            time.sleep(0.2)


def _killed_worker(writer) -> str | None:
    """A worker of `writer` that was killed by a signal: an unreaped child whose exit status (field 52 of
    /proc/<pid>/stat, Linux >= 3.5) says so; None otherwise (also where that cannot be read)."""
    try:
        import psutil

        children = psutil.Process(writer.pid).children()
    except Exception:  # noqa: BLE001 - gone meanwhile, or no psutil
        return None
    for child in children:
        try:
            fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" or len(fields) < 50 or not (status := int(fields[49])) & 0x7F:
            continue
        try:
            name = signal.Signals(status & 0x7F).name
        except ValueError:
            name = f"signal {status & 0x7F}"
        why = " (the out-of-memory killer's usual choice: it has the trainer's footprint)" if name == "SIGKILL" else ""
        return f"a worker of its writer process (pid {child.pid}) was killed by {name}{why}"
    return None


def _kill_writer(writer) -> None:
    """SIGKILL an async writer process and the workers it forked (it writes nothing more)."""
    if writer is None or writer.pid is None:
        return
    try:
        import psutil

        procs = psutil.Process(writer.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - gone already, or no psutil: the writer alone
        procs = []
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.kill()
    with contextlib.suppress(Exception):
        if writer.is_alive():
            writer.kill()
        writer.join(10)


_STOP_SIGNALS_IGNORED = False  # set while megatron forks its checkpoint writers


def _ignore_stop_signals_in_child() -> None:
    if _STOP_SIGNALS_IGNORED:
        lifeline.leave_stop_signals_to_the_trainer()


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


def disk_full_message(exc: BaseException, folder: Path, what: str, *,
                      left: str = "the partial folder was removed") -> str | None:
    """One line for a write into `folder` (a folder, or a file such as metrics.jsonl) that failed for lack of space
    (None: another failure): the line every writer of the run dir ends with on a full disk (HF snapshots, metrics,
    wandb; checkpoints say the same with the space a save needs). `left`: what was undone."""
    if not _disk_full(exc, folder.parent):
        return None
    written = _folder_bytes(folder) if folder.is_dir() else 0
    try:
        free = f"{_size(shutil.disk_usage(folder.parent).free)} free"
    except OSError:
        free = "free space unknown"
    need = f", more than the {_size(written)} written before it filled are needed" if written else ""
    return (f"{what} in {folder.parent}: stopped: the disk is full ({free}{need}); {left}: free some space "
            f"(or move trainer.run_dir) and rerun the same command to resume")


_CHECKPOINTERS: weakref.WeakSet = weakref.WeakSet()  # this process' Checkpointers


def full_disk_error(exc: BaseException, target: Path, what: str, *,
                    left: str = "the partial folder was removed") -> CheckpointWriteError | None:
    """The rule for every writer of the run dir but the checkpoint itself (HF snapshots, metrics.jsonl, wandb): a
    write that failed for lack of space ends the run with one line (`disk_full_message`: raise what this returns),
    and a checkpoint still being written in this process is abandoned (its staging folder would keep the disk
    full; `latest` stays). None: another failure (the caller re-raises it)."""
    message = disk_full_message(exc, target, what, left=left)
    if message is None:
        return None
    steps = [step for saver in list(_CHECKPOINTERS) if (step := saver.abandon()) is not None]
    if steps:
        message = message.replace(f"; {left}:", f"; {left}, and so was the unfinished save of checkpoint step "
                                  f"{steps[0]} (`latest` is unchanged):", 1)
    return CheckpointWriteError(message)


def commit_pending() -> list[int]:
    """Every trainer rank, when a run ends on an error that leaves the ranks in step (a rollout rank that stopped
    answering: every rank learns it at the same point): the save each Checkpointer of this process has in progress
    is written to the end and committed, so the run keeps every checkpoint it wrote. Returns the steps committed."""
    committed = []
    for saver in list(_CHECKPOINTERS):
        step = saver.pending_step
        if step is not None and saver.wait(rewrite_skipped=True) is not None:
            committed.append(step)
    return committed


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


def save_stop_state(run_dir, step: int, state: dict) -> None:
    """Rank 0, at a stop, once checkpoint `step` is committed: the work in flight then (`state`: the sampler's
    position and the batch source's stop_state) beside it, atomically (a half-written file is never read). It goes
    with its checkpoint (retention removes both); a resume from that checkpoint continues the work."""
    if _rank() != 0:
        return
    folder = step_dir(run_dir, step)
    tmp = folder / f"{TMP_PREFIX}{STOP_STATE}"
    _save_durably(state, tmp)
    os.replace(tmp, folder / STOP_STATE)
    fsync_path(folder)
