"""Helper processes die with the trainer, even when it is killed with SIGKILL (OOM killer, `kill -9`, a lost node).

A killed trainer cannot clean up, so the kernel has to: Linux's PR_SET_PDEATHSIG makes it send a signal to a
process when the thread that created it exits. It is set in the child (it does not survive fork), as early as
possible, and re-checked against the parent's pid because the parent may already have died before the call.

- `die_with_parent()`: call it first thing in a child whose kernel parent is the trainer (vLLM's engine process
  under split placement: forked on CPU, spawned on GPU).
- `forked_children_die_with_us()`: every later `os.fork()` child of this process calls `die_with_parent()` right
  after the fork (a spawned vLLM engine imports rollout/weight_transfer.py, which calls it there).
- `exit_with_starter()`: for forkserver children (the reward pool workers). Their kernel parent is multiprocessing's
  forkserver, which stays up as long as any of its children does, so the kernel cannot help; a daemon thread waits
  on the pipe that only the starting process holds open and SIGKILLs the worker when it closes. (A verifier stuck
  in C code that holds the GIL delays this until it lets go.)
Both do nothing where prctl does not exist (macOS): there the old behaviour stays.
"""

from __future__ import annotations

import ctypes
import os
import multiprocessing
import signal
import sys
import threading
from multiprocessing.connection import wait

PR_SET_PDEATHSIG = 1
_forks_hooked = False
_pid_before_fork = None


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> bool:
    """Have the kernel send `sig` to this process when its parent exits; exits at once if the parent (`parent_pid`,
    default: the current parent) is already gone. Returns whether the request took effect."""
    if not sys.platform.startswith("linux"):
        return False
    expected = os.getppid() if parent_pid is None else parent_pid
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != expected:  # orphaned before the request: the signal will never come
        os.kill(os.getpid(), sig)
    return True


def _before_fork() -> None:
    global _pid_before_fork
    _pid_before_fork = os.getpid()


def _after_fork_in_child() -> None:
    die_with_parent(parent_pid=_pid_before_fork)


def forked_children_die_with_us() -> None:
    """From now on every `os.fork()` child of this process (multiprocessing's fork start method included) gets
    `die_with_parent()`. Idempotent."""
    global _forks_hooked
    if not _forks_hooked:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _forks_hooked = True


def exit_with_starter() -> bool:
    """In a multiprocessing child: SIGKILL this process when the process that started it exits. Returns whether a
    watch was started (False outside a multiprocessing child)."""
    starter = multiprocessing.parent_process()
    if starter is None or starter.sentinel is None:
        return False

    def watch():
        wait([starter.sentinel])  # readable (EOF) once the starter's end of the pipe is closed: it exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="justrl-starter-watch").start()
    return True
