"""One writer per run dir: an exclusive lock held for the run's life, and the staging folders that writer owns.

Two trainers on one run dir would stage into the same folders, delete each other's saves and interleave
metrics.jsonl. So rank 0 holds `run_dir/.justrl.lock` with `fcntl.flock` from before anything is written until the
process ends. The kernel drops a flock when the last descriptor of it closes, which a killed process does too: a lock
file left by a dead job never blocks its requeue (its contents are just overwritten). A second launch gets
`RunDirBusy`, whose one-line message names the holder (host, pid, Slurm job, start time). flock works across nodes on
NFS (Linux emulates it with fcntl locks there) and on Lustre mounted with `-o flock`.

Staging folders (a checkpoint or HF snapshot being written) carry the writer's pid in their name and are registered
here while they are written, so that an abort (train/interrupt.py) can remove them; only the lock holder removes
stale ones that earlier, dead writers left.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import time
from pathlib import Path

LOCK_FILE = ".justrl.lock"

_held: dict[Path, int] = {}  # resolved run dir -> the descriptor holding its lock (this process)
_staging: set[Path] = set()  # staging folders this process is writing now


class RunDirBusy(RuntimeError):
    """Another live process holds the run dir's lock (the message is one line naming it)."""


def _key(run_dir) -> Path:
    return Path(run_dir).resolve()


def holds(run_dir) -> bool:
    """Whether this process holds the lock of `run_dir`."""
    return _key(run_dir) in _held


def hold(run_dir) -> None:
    """Take the run dir's lock for the rest of this process' life (idempotent). Creates the run dir. Raises
    RunDirBusy when another process holds it, OSError when the lock file cannot be created."""
    key = _key(run_dir)
    if key in _held:
        return
    key.mkdir(parents=True, exist_ok=True)
    fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise RunDirBusy(f"{key} is in use by another trainer ({holder}); wait for it to end, stop it, or choose "
                         f"another trainer.run_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, (describe_self() + "\n").encode(), 0)
    _held[key] = fd


def release(run_dir) -> None:
    """Give the lock back (a process that ends releases it anyway)."""
    fd = _held.pop(_key(run_dir), None)
    if fd is not None:
        os.close(fd)


def describe_self() -> str:
    job = os.environ.get("SLURM_JOB_ID")
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
    return f"host {socket.gethostname()}, pid {os.getpid()}{f', slurm job {job}' if job else ''}, started {started}"


def _read_holder(fd: int) -> str:
    for _ in range(20):  # the holder writes its line right after taking the lock: give it a moment
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if text:
            return text.splitlines()[0]
        time.sleep(0.05)
    return "holder not yet recorded"


def _close_in_child() -> None:
    """A forked child must not keep the lock alive after the holder dies (a flock lives while any copy of its
    descriptor is open). Closing the child's copy leaves the parent's lock in place."""
    for fd in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()
    _staging.clear()


os.register_at_fork(after_in_child=_close_in_child)


# --- staging folders -------------------------------------------------------------------------------------------------

def staging_name(prefix: str) -> str:
    """A staging folder name unique to this writer: `<prefix>.<pid>`."""
    return f"{prefix}.{os.getpid()}"


@contextlib.contextmanager
def staging(path: Path):
    """Register `path` as being written by this process while the block runs (an abort removes it)."""
    _staging.add(Path(path))
    try:
        yield Path(path)
    finally:
        _staging.discard(Path(path))


def remove_staging() -> list[Path]:
    """Remove every staging folder this process is writing now (an abort: nothing half-written stays)."""
    removed = sorted(_staging)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    _staging.clear()
    return removed


def remove_stale(folder: Path, pattern: str, run_dir) -> None:
    """Remove leftovers of dead writers (`folder/pattern`), only when this process holds the run dir's lock: another
    live writer's staging folder is never touched."""
    if not holds(run_dir):
        return
    for stale in Path(folder).glob(pattern):
        if stale not in _staging:
            shutil.rmtree(stale, ignore_errors=True)
