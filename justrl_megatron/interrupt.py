"""Ctrl-C during training: the first one saves, the second one aborts cleanly.

- The first SIGINT does what SIGTERM / SIGUSR1 do (slurm.StopSignal): the current step finishes, a checkpoint is
  saved and the run exits 0. One line says so at once (a step can take minutes). A rollout in progress does not
  finish: the engines poll the flag between their steps (slurm.stop_requested, agreed by every rank:
  rollout/stopping.py), abort it within about a second keeping what each sample sampled so far, and the run saves
  the step before it with those groups beside it (rollout/stream_source.py), so that the resumed run continues them.
- A second SIGINT aborts at once: helper processes are killed, the staging folder of a save in progress is removed
  (run_lock.py; `latest` still points to the last complete checkpoint) and the process exits 130, without a traceback.
A SIGINT within REPEAT_S of the first counts as the same press: torchrun forwards the terminal's Ctrl-C to its
ranks, which the terminal already sent it to (torchrun then kills the ranks after its shutdown timeout, 30 s).
A checkpoint still being written in the background (trainer.async_save) is waited for before the exit: the stop
saves this step, which first commits the pending one, and waits for its own write. Every helper process (checkpoint
writers, reward workers, sandbox runners, vLLM's engine core and workers) leaves these signals to the ranks
(lifeline.leave_stop_signals_to_the_trainer), so a Ctrl-C to the terminal's whole process group, or Slurm's SIGTERM to
every process of the step, neither cuts a write short nor kills an engine under a rank that is finishing its step;
the second Ctrl-C kills them with the rest and removes the staging folder. It spares multiprocessing's resource
tracker: the tracker ignores SIGINT / SIGTERM, ends by itself once every process holding its pipe has, and unlinks the
shared memory and semaphores the killed helpers left. Killed, it leaked them, and a thread or helper that unregistered
one in the last moments relaunched it, whose `KeyError` traceback (a name it never saw) followed the one line. The
tracker a rank starts (at `install`) drops its shutdown warnings ("leaked shared_memory objects"): after an abort they
are expected, and it cleans them up all the same.
Both act when Python next runs the main thread (between bytecodes: a long C call finishes first); `kill -9` always works
and leaves no helpers behind either (lifeline.py).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from . import early_interrupt, run_lock
from .slurm import STOP_SIGNALS, StopSignal, requeue_message

INTERRUPTED = ("justrl-train: interrupted: finishing this step (a rollout stops at once), then saving a checkpoint "
               "and exiting (Ctrl-C again aborts without saving)")
ABORTED = "justrl-train: aborted by a second Ctrl-C: {what}; `latest` is unchanged"
NOTHING_SAVED = "stopped during the first step's rollout: nothing to save (a rerun starts over, as this run began)"
TRACKER_WARNINGS = "resource_tracker"  # how the tracker process's warnings begin (no colon: -W splits on it)
REPEAT_S = 1.0  # SIGINTs this close to the first are one press (a terminal's and torchrun's copy of it)


class Interruptible(StopSignal):
    """StopSignal (SIGTERM / SIGUSR1) plus SIGINT: first = stop after this step, second = abort now."""

    def __init__(self):
        super().__init__((*STOP_SIGNALS, signal.SIGINT))
        self.first_interrupt: float | None = None  # time.monotonic() of the first SIGINT

    def install(self) -> "Interruptible":
        super().install()
        early_interrupt.training_started()
        _start_quiet_resource_tracker()
        return self

    def _handle(self, signum, frame) -> None:
        if signum != signal.SIGINT:
            return super()._handle(signum, frame)
        now = time.monotonic()
        if self.first_interrupt is None:
            self.first_interrupt = now
            super()._handle(signum, frame)
            _say(INTERRUPTED)
        elif now - self.first_interrupt > REPEAT_S:
            abort()

    def message(self, step: int) -> str:
        """The last line of a stopped run (step 0: stopped during the first step's rollout, nothing to keep)."""
        if step == 0:
            if self.received == signal.SIGINT:
                return f"{NOTHING_SAVED}; exiting on Ctrl-C (rerun the same command to start over)"
            return f"{NOTHING_SAVED}; exiting for requeue"
        if self.received == signal.SIGINT:
            return f"checkpoint saved at step {step}; exiting on Ctrl-C (rerun the same command to resume)"
        return requeue_message(step)


def abort() -> None:
    """Kill this process' helpers, remove its staging folders, exit 130 (no exception: nothing runs after)."""
    _kill_children()  # first: a checkpoint writer must not write on into a folder being removed
    removed = run_lock.remove_staging()
    what = "the checkpoint being written was removed" if removed else "no checkpoint was being written"
    _say(ABORTED.format(what=what))
    os._exit(130)


def _say(line: str) -> None:
    # os.write, not print: a signal handler may interrupt a print to the same stream (a reentrant-call error)
    if os.environ.get("RANK", "0") == "0":
        os.write(2, (line + "\n").encode())


def _start_quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker now (the one every helper of this process shares, started anyway by
    the first shared memory, semaphore or spawned process) without its shutdown warnings (its command line takes
    sys.warnoptions, read only at the start) and with the stop signals blocked: it ignores SIGINT / SIGTERM itself,
    and a SIGUSR1 to every process (Slurm) would otherwise kill it, which leaks what it tracks. Already running: left
    as it is."""
    try:
        from multiprocessing import resource_tracker

        from .lifeline import stop_signals_blocked

        saved = list(sys.warnoptions)
        sys.warnoptions.append(f"ignore:{TRACKER_WARNINGS}:UserWarning")
        try:
            with stop_signals_blocked():
                resource_tracker.ensure_running()
        finally:
            sys.warnoptions[:] = saved
    except Exception:  # noqa: BLE001  (no tracker on this platform: nothing to quiet)
        pass


def _is_resource_tracker(pid: int) -> bool:
    """Whether `pid` is a multiprocessing resource tracker (its command line imports resource_tracker's main)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def _kill_children() -> None:
    """SIGKILL this process' direct children (their own children follow through lifeline.py), except the resource
    tracker (see the module's docstring)."""
    me = os.getpid()
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else []:
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == me and not _is_resource_tracker(int(entry.name)):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
