"""What a training process needs to know about Slurm: which job and restart it is, and when to stop for a requeue.

The launcher (launch/slurm/train.sbatch) owns the requeue: its batch shell traps SIGUSR1 (sent `--signal=B:USR1@T`
before the time limit, or by `scancel --signal=USR1 --batch JOB`), forwards it to every process of the training step,
waits for the step to end, then runs `scontrol requeue`. The requeued job runs the same command, which resumes from
the run dir. The trainer's side of that contract, built from this module:

    stop = StopSignal().install()            # SIGUSR1 and SIGTERM only set a flag
    log(describe(current_job()))             # "slurm job 42 restart 1 on 2 nodes n[1-2] ..."
    for step in range(start, total):
        train_one_step()
        if stop.agreed():                    # every rank stops after the same step (collective: call it on all ranks)
            save_checkpoint(step)
            print(requeue_message(step))     # "checkpoint saved at step N; exiting for requeue"
            sys.exit(0)

Signals reach the ranks of different nodes at different moments; `agreed()` all-reduces the flag so that no rank
leaves while another waits in a collective.
"""

from __future__ import annotations

import atexit
import os
import signal
from dataclasses import dataclass
from typing import Mapping

from .early_interrupt import STOP_SIGNALS

REQUEUE_MESSAGE = "checkpoint saved at step {step}; exiting for requeue"
_INSTALLED: list["StopSignal"] = []  # the handlers in place in this process (stop_requested reads them)


def stop_requested() -> bool:
    """True once a StopSignal installed in this process got its signal: what a long call (a rollout) polls to stop
    early, without being handed the trainer's StopSignal (a local view: rollout/stopping.py agrees across ranks)."""
    return any(s.requested for s in _INSTALLED)


def requeue_message(step: int) -> str:
    """The line the trainer prints after its requeue checkpoint (the tests and log readers grep for it)."""
    return REQUEUE_MESSAGE.format(step=step)


@dataclass(frozen=True)
class SlurmJob:
    """The Slurm facts of this process; job_id is None outside Slurm."""

    job_id: str | None
    job_name: str | None
    restart_count: int  # SLURM_RESTART_COUNT: 0 on the first run, +1 per requeue
    num_nodes: int
    node_id: int  # this node's index in the allocation (torchrun's --node-rank)
    nodelist: str | None
    submit_dir: str | None

    @property
    def in_slurm(self) -> bool:
        return self.job_id is not None

    @property
    def is_restart(self) -> bool:
        return self.restart_count > 0


def current_job(env: Mapping[str, str] | None = None) -> SlurmJob:
    env = os.environ if env is None else env
    return SlurmJob(
        job_id=env.get("SLURM_JOB_ID") or None,
        job_name=env.get("SLURM_JOB_NAME") or None,
        restart_count=int(env.get("SLURM_RESTART_COUNT") or 0),
        num_nodes=int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1),
        node_id=int(env.get("SLURM_NODEID") or 0),
        nodelist=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or None,
        submit_dir=env.get("SLURM_SUBMIT_DIR") or None,
    )


def describe(job: SlurmJob) -> str:
    """One log line: which job, which restart, where."""
    if not job.in_slurm:
        return "not running under slurm"
    return (
        f"slurm job {job.job_id} ({job.job_name}) restart {job.restart_count} "
        f"on {job.num_nodes} node(s) {job.nodelist}; this is node {job.node_id}"
    )


class StopSignal:
    """Turns SIGUSR1 / SIGTERM into a flag that the training loop polls between steps.

    The handlers only record the signal, so the current step (and any collective in it) finishes normally; only a
    rollout in progress is cut short: the engines read `stop_requested()` between their steps and abort it, every
    rank together (rollout/stopping.py). A second signal changes nothing: the loop still stops at the next step
    boundary.
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: int | None = None  # the first signal number seen
        self._previous: dict[int, object] = {}

    def install(self) -> "StopSignal":
        """Install the handlers (main thread only, as Python requires). Returns self.

        The previous handlers come back at interpreter exit (atexit): Python's own shutdown would otherwise reset
        them to SIG_DFL, and a late SIGUSR1 (the launcher repeats it) would kill a rank that already finished,
        where torchrun left it ignored."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        atexit.register(self.restore)
        _INSTALLED.append(self)
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before `install()` (idempotent)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        atexit.unregister(self.restore)
        if self in _INSTALLED:
            _INSTALLED.remove(self)

    def __enter__(self) -> "StopSignal":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum

    @property
    def requested(self) -> bool:
        """True once this process got a stop signal (local view; use `agreed()` in a multi-rank job)."""
        return self.received is not None

    @property
    def signal_name(self) -> str | None:
        return None if self.received is None else signal.Signals(self.received).name

    def agreed(self, group=None) -> bool:
        """True when any rank got a stop signal. A collective (all-reduce MAX) when torch.distributed is
        initialised: every rank of `group` must call it at the same point, e.g. after each step."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        # nccl reduces only CUDA tensors, gloo only CPU ones: the group's backend decides
        from . import compat

        device = compat.default_device() if dist.get_backend(group) == "nccl" else torch.device("cpu")
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
