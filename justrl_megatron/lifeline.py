"""Helper processes die with the trainer, even when it is killed with SIGKILL (OOM killer, `kill -9`, a lost node).

A killed trainer cannot clean up, so the helpers must notice by themselves:

- reward pool workers (`exit_with_starter`): multiprocessing's forkserver is their kernel parent and stays up as long
  as any of its children does, so PR_SET_PDEATHSIG would not fire; a daemon thread waits on the pipe that only the
  starting process holds open and SIGKILLs the worker when it closes.
- vLLM's engine processes under split placement (`exit_with_trainer`): vLLM spawns an engine-core process, which
  spawns a worker; the trainer asks the worker (a collective_rpc into rollout/weight_transfer.py's WorkerExtension,
  right after start-up) to watch the trainer's pid through a pidfd; when it exits, the worker SIGKILLs the engine-core
  process between them, then itself.
- everything else a run starts (`bind_helpers_to_this_process`, called by justrl-train before any helper exists):
  megatron's checkpoint writers (forked) and the `multiprocessing.Manager` server that collects their results
  (spawned), vLLM's engine processes, and whatever a library starts later. A forked child watches the trainer from an
  at-fork hook; a spawned Python child that imports justrl_megatron (multiprocessing's spawn imports the trainer's
  main module, so every spawned helper does) finds the trainer's pid in JUSTRL_TRAINER_PID and watches it from the
  package's import. multiprocessing's resource tracker ends by itself once every process that holds its pipe has.
- the ranks of a multi-process launch (`watch_launcher`, from the package's import, so before the slow imports): a rank
  SIGKILLs itself when its launcher exits, justrl's (launch.py, JUSTRL_LAUNCHER_PID: `justrl-train --nproc-per-node`,
  and each node's launcher under launch/slurm/train.sbatch) or torchrun's agent (its parent, recognised by its command
  line). A peer's death reaches a rank the same way, never as a signal it could take for a stop request: its launcher
  SIGKILLs it (launch.py; across nodes, at node 0's launcher's word). A launcher killed with SIGKILL (a lost Slurm step, `kill -9`) leaves no rank
  training headless, holding the run dir's lock.
A helper stuck in C code that holds the GIL is killed when it lets go of it.

Stop signals are the ranks' business (`leave_stop_signals_to_the_trainer`, every helper at its start: the package's
import in a spawned one, the at-fork hook in a forked one). A terminal's Ctrl-C, `timeout`, `kill -- -PGID` signal the
whole process group, and Slurm (proctrack) every process of the step; vLLM's engine core and workers take SIGINT /
SIGTERM for "shut down now" (handlers installed in vllm/v1/engine/core.py `run_engine_core` and
v1/executor/multiproc_executor.py `worker_main`), so a rank that should finish its step lost its engine under it. A
helper blocks SIGINT / SIGTERM / SIGUSR1 (a mask survives the handlers a library installs later, and exec, so it
covers the helper's own children too); a thread takes them and passes on only those its parent sent: vLLM and
multiprocessing stop their processes with terminate(), which must keep working.
"""

from __future__ import annotations

import _thread
import contextlib
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from multiprocessing.connection import wait


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
    poller = select.poll()  # not select(): a trainer's fds may pass select's 1024 limit
    poller.register(fd, select.POLLIN)
    poller.poll()  # a pidfd turns readable when its process exits


def exit_with_trainer(trainer: int) -> bool:
    """In a helper started (directly or through one process in between) by process `trainer`: when that exits,
    SIGKILL this process' parent unless that is the trainer itself (vLLM's engine-core process), then this process.
    Returns whether a watch was started (not in the trainer itself)."""
    if trainer == os.getpid():
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


TRAINER_ENV = "JUSTRL_TRAINER_PID"  # set by the trainer; inherited by every process it starts
_hook_installed = False


def _die_with(pid: int) -> None:
    """A daemon thread that SIGKILLs this process when process `pid` exits."""
    def watch():
        _wait_for_exit(pid)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="justrl-trainer-watch").start()


def _trainer_pid() -> int | None:
    try:
        pid = int(os.environ.get(TRAINER_ENV, ""))
    except ValueError:
        return None
    return pid if pid > 0 and pid != os.getpid() else None


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
_WAKE = signal.SIGUSR2  # to the main thread, to break a blocking call once a parent's stop signal is due there
_shielded = False
_rearm_at_fork = False


def _shield_forked_child() -> None:
    global _shielded
    _shielded = False  # the parent's relay thread did not survive the fork; the mask did
    leave_stop_signals_to_the_trainer()


def leave_stop_signals_to_the_trainer() -> None:
    """In a helper process, in its main thread, before it starts threads or children: SIGINT / SIGTERM / SIGUSR1
    reach it only from its parent (its manager's terminate()); sent by anyone else (the terminal, Slurm, a group
    kill) they are dropped. SIGKILL, and so the lifelines above, are untouched."""
    global _shielded, _rearm_at_fork
    if _shielded:
        return
    _shielded = True
    if not _rearm_at_fork:  # a child it forks (vLLM's workers may be forked) is a helper too
        os.register_at_fork(after_in_child=_shield_forked_child)
        _rearm_at_fork = True
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # inherited by threads started from now on
    if threading.current_thread() is threading.main_thread():
        signal.signal(_WAKE, lambda signum, frame: None)  # a handler: the signal interrupts a blocking call

    def relay():
        while True:
            info = signal.sigwaitinfo(STOP_SIGNALS)
            if info.si_pid != os.getppid():
                continue
            handler = signal.getsignal(info.si_signo)
            if handler == signal.SIG_IGN:
                continue
            if callable(handler):  # Python runs it in the main thread; the wake breaks a wait there (a lock, a poll)
                _thread.interrupt_main(info.si_signo)
                signal.pthread_kill(threading.main_thread().ident, _WAKE)
                continue
            # the default action (terminate): this thread alone takes the signal
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [info.si_signo])
            signal.pthread_kill(threading.get_ident(), info.si_signo)

    threading.Thread(target=relay, daemon=True, name="justrl-stop-signal-relay").start()


@contextlib.contextmanager
def stop_signals_blocked():
    """Around starting a program (subprocess.Popen, exec): it starts with SIGINT / SIGTERM / SIGUSR1 blocked, so only
    SIGKILL, which its starter uses, ends it."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _after_fork_in_child() -> None:
    pid = _trainer_pid()
    if pid is not None:
        leave_stop_signals_to_the_trainer()
        _die_with(pid)


def bind_helpers_to_this_process() -> None:
    """In the trainer, before it starts any helper: every process it starts from now on (directly or not, forked or
    spawned) dies with it, even when it is killed with SIGKILL."""
    global _hook_installed
    os.environ[TRAINER_ENV] = str(os.getpid())
    if not _hook_installed:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _hook_installed = True


def watch_from_env() -> bool:
    """In a process that imports justrl_megatron: when a trainer started it (JUSTRL_TRAINER_PID), die with that
    trainer. Returns whether a watch was started."""
    pid = _trainer_pid()
    if pid is None:
        return False
    leave_stop_signals_to_the_trainer()
    _die_with(pid)
    return True


LAUNCHER_ENV = "JUSTRL_LAUNCHER_PID"  # set by launch.py for its ranks only (a rank takes it out of its environment)


def _is_torchrun(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    return any(a == "torch.distributed.run" or a.endswith(("/torchrun", "torch/distributed/run.py")) for a in args[:4])


_WATCHED: list[int] = []  # the launcher this rank dies with (watch_launcher)


def watch_launcher() -> bool:
    """In a rank: SIGKILL this process when its launcher (justrl's launcher, JUSTRL_LAUNCHER_PID, or torchrun's agent:
    its parent) exits; at once when it is already gone. Returns whether a watch was started."""
    parent = os.getppid()
    launcher = os.environ.pop(LAUNCHER_ENV, "")  # helpers this rank starts must not take it for theirs
    if launcher.isdigit():  # (its parent, or above it when JUSTRL_ENTRY is a wrapper); already gone: dies at once
        _WATCHED.append(int(launcher))
        _die_with(int(launcher))
        return True
    if os.environ.get("LOCAL_RANK") is not None and _is_torchrun(parent):
        _die_with(parent)
        return True
    return False


# what gloo says in a collective whose peer process is gone
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


# The exit code of a rank of justrl's launcher whose failure the run's one line has named already (rank 0's: a rollout
# rank that stopped answering, a full disk; or the rank's own, liveness.exit_process): the launcher adds no line and
# stops the other ranks at once (launch.py); the launch exits 1.
SAID_AND_FAILED = 3


def said_and_failed_code() -> int:
    """SAID_AND_FAILED in a rank of justrl's launcher; 1 alone or under torchrun (whose agent names nothing)."""
    return SAID_AND_FAILED if _WATCHED else 1


def end_after_rank_0_said(is_rank_0: bool, grace_s: float = 10.0) -> None:
    """Exit (said_and_failed_code) after an error every rank raised at the same point and rank 0 has just named in one
    line. The other ranks of justrl's launcher wait for rank 0's exit, `grace_s` at most (their launcher SIGKILLs them
    then): the launcher stops everyone at the first exit it sees, and rank 0 must not be killed before its line."""
    if not is_rank_0 and _WATCHED:
        time.sleep(grace_s)
    sys.exit(said_and_failed_code())


def await_the_launcher_if_a_peer_died(exc: BaseException, grace_s: float = 10.0) -> None:
    """In a rank of justrl's launcher, on an error escaping the rank: when it is a collective that lost its peer, the
    peer died, and its launcher names that rank in one line and SIGKILLs this one (within a second; across nodes at
    node 0's launcher's word). This rank's own traceback, printed first, would only name the wrong rank: wait for the
    launcher instead, `grace_s` at most (then the caller raises as usual)."""
    if _WATCHED and any(text in str(exc) for text in PEER_GONE):
        time.sleep(grace_s)
