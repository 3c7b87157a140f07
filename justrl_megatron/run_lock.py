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

A multi-rank launch decides the lock once, for all its ranks, before any of them writes:
- under justrl's launcher (launch.py) the launcher takes it before it starts a rank and hands the locked descriptor to
  every rank (JUSTRL_RUN_LOCK_FD): the lock lives until the last process of the launch has exited, and rank 0 holds it
  through that descriptor;
- under a bare `torchrun`, rank 0 takes it and writes the launch's identity (torchrun's run id, rendezvous address) in
  the lock file; the other ranks wait for a holder and go on only when it names their own launch (`join_launch`), so
  a refused launch writes nothing on any rank.
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
LOCK_FD_ENV = "JUSTRL_RUN_LOCK_FD"  # the launcher's locked descriptor, inherited by its ranks
JOIN_TIMEOUT_S = 300.0  # how long a rank > 0 waits for its rank 0 to take the lock (rank 0 may still be importing)

_held: dict[Path, int] = {}  # resolved run dir -> the descriptor holding its lock (this process)
_staging: set[Path] = set()  # staging folders this process is writing now
_inherited: int | None = None  # the launcher's locked descriptor in a rank (adopt_inherited), else None


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
    if _launch_holds(key):  # the launcher locked it for this launch: hold it through the inherited descriptor
        _held[key] = os.dup(_inherited)  # (a dup shares the lock; close-on-exec like every other)
        return
    key.mkdir(parents=True, exist_ok=True)
    fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + 1.0  # a rank of this launch probing the lock (join_launch) holds it for microseconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.02)
                continue
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
    launch = launch_id()
    return (f"host {socket.gethostname()}, pid {os.getpid()}{f', slurm job {job}' if job else ''}, started {started}"
            f"{f', launch {launch}' if launch else ''}")


def launch_id() -> str | None:
    """What the ranks of one multi-process launch share and no other launch has: torchrun's run id and attempt plus
    the rendezvous address (None outside a multi-rank launch)."""
    env = os.environ
    if int(env.get("WORLD_SIZE", "1")) <= 1 or not env.get("MASTER_PORT"):
        return None
    return (f"{env.get('TORCHELASTIC_RUN_ID', 'none')}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            f"@{env.get('MASTER_ADDR', '')}:{env['MASTER_PORT']}")


def adopt_inherited() -> None:
    """In a rank started by justrl's launcher: take over the locked descriptor it passed (close-on-exec from now on,
    closed in forked children like the others). A no-op elsewhere."""
    global _inherited
    text = os.environ.pop(LOCK_FD_ENV, "")
    if not text.isdigit():
        return
    fd = int(text)
    try:
        os.set_inheritable(fd, False)
    except OSError:  # not open here (the variable leaked from elsewhere)
        return
    _inherited = fd


def _launch_holds(key: Path) -> bool:
    """Whether the descriptor the launcher passed is the lock file of run dir `key`."""
    if _inherited is None:
        return False
    try:
        mine, theirs = os.fstat(_inherited), os.stat(key / LOCK_FILE)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def join_launch(run_dir, timeout: float = JOIN_TIMEOUT_S) -> None:
    """In a rank > 0, before it writes anything: return once the run dir's lock is held by this launch (its launcher,
    or its rank 0 under a bare torchrun); raise RunDirBusy when another launch holds it (rank 0 says so in one line),
    TimeoutError when nobody takes it in `timeout` seconds. Never creates anything."""
    key = _key(run_dir)
    if _launch_holds(key):
        return
    mine = launch_id()
    deadline = time.monotonic() + timeout
    seen_other_since = None
    while time.monotonic() < deadline:
        try:
            fd = os.open(key / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            time.sleep(0.1)
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)  # nobody holds it yet: rank 0 has not got there
                held = False
            except BlockingIOError:
                held = True
            text = os.pread(fd, 4096, 0).decode(errors="replace") if held else ""
        finally:
            os.close(fd)
        if held and mine and f", launch {mine}" in text:
            return
        if held:  # another launch's line, or ours not yet written over the last holder's: give rank 0 a moment
            seen_other_since = seen_other_since or time.monotonic()
            if time.monotonic() - seen_other_since > 3.0:
                raise RunDirBusy(f"{key} is in use by another trainer")
        else:
            seen_other_since = None
        time.sleep(0.1)
    raise TimeoutError(f"rank 0 did not take the lock of {key} within {timeout:.0f} s")


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
    global _inherited
    for fd in [*_held.values(), *([_inherited] if _inherited is not None else [])]:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()
    _staging.clear()
    _inherited = None


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
