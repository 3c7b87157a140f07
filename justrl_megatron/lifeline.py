"""Helper processes die with the trainer, even when it is killed with SIGKILL (OOM killer, `kill -9`, a lost node).

A killed trainer cannot clean up, so the helpers must notice by themselves:

- reward pool workers (`exit_with_starter`): multiprocessing's forkserver is their kernel parent and stays up as long
  as any of its children does, so PR_SET_PDEATHSIG would not fire; a daemon thread waits on the pipe that only the
  starting process holds open and SIGKILLs the worker when it closes.
- vLLM's engine processes under split placement (`mark_trainer` in the trainer, `exit_with_trainer` in the helper):
  vLLM spawns an engine-core process, which spawns a worker; only the worker runs our code (it imports
  rollout/weight_transfer.py, vLLM's `worker_extension_cls`). The trainer's pid travels in the environment; a daemon
  thread in the worker waits for that process to exit (a pidfd), then SIGKILLs the engine-core process between them
  and itself.
A helper stuck in C code that holds the GIL is killed when it lets go of it.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import threading
import time
from multiprocessing.connection import wait

TRAINER_PID_ENV = "JUSTRL_TRAINER_PID"


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


def mark_trainer() -> None:
    """In the trainer, before it starts helpers that call `exit_with_trainer`: they inherit its pid."""
    os.environ[TRAINER_PID_ENV] = str(os.getpid())


def _wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3, macOS): poll
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                pass
            time.sleep(1.0)
    select.select([fd], [], [])  # a pidfd turns readable when its process exits


def exit_with_trainer() -> bool:
    """In a multiprocessing descendant of a `mark_trainer` process: when the trainer exits, SIGKILL this process'
    parent unless that is the trainer (vLLM's engine-core process), then this process. Returns whether a watch was
    started."""
    trainer = int(os.environ.get(TRAINER_PID_ENV, "0") or 0)
    if trainer in (0, os.getpid()) or multiprocessing.parent_process() is None:  # only in multiprocessing helpers
        return False
    parent = os.getppid()

    def watch():
        _wait_for_exit(trainer)
        if parent not in (trainer, 1):
            try:
                os.kill(parent, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="justrl-trainer-watch").start()
    return True
