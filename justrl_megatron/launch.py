"""justrl-train --nproc-per-node=N: the ranks of one machine under one launcher that keeps the run's promises.

torchrun's agent breaks three of them: a refused launch still starts every rank (rank 1 may write into the live
run), a failing rank ends in a ChildFailedError traceback, and a signal to the launcher ends in a SignalException
traceback after waiting up to 30 s for the ranks to stop. This launcher, in order:

1. takes the run dir's lock for the whole launch (run_lock.py) before any rank exists; a busy run dir is one line,
   exit 2, nothing started, nothing written. The locked descriptor is inherited by every rank (rank 0 holds the lock
   through it), so the lock lives until the last process of the launch has exited;
2. starts N ranks (`python -m justrl_megatron.cli train OVERRIDES`, torchrun's environment: RANK, LOCAL_RANK,
   WORLD_SIZE, MASTER_ADDR/PORT) in its own process group; each rank dies with it (lifeline.watch_launcher), so a
   SIGKILLed launcher leaves nothing behind;
3. forwards SIGTERM, SIGUSR1 and SIGINT to every rank (they finish the step, save and exit 0; the ranks count the
   terminal's and the launcher's copy of one Ctrl-C as one press) and waits as long as they take;
4. when a rank fails, SIGKILLs the others at once (they cannot finish a step without it) and exits with that rank's
   code, in one line (nothing more when the rank already said why: a refused config exits 2, an abort 130); a
   refused config leaves nothing: a run dir the launch created holds only the lock file, and goes.

One machine; several nodes run torchrun under srun (launch/slurm/train.sbatch), where the ranks die with torchrun too.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
OWN_CODES = (2, 130)  # a rank that exits with these has printed its own line (refused config / run dir, abort)
GRACE_S = 20.0  # how long the other ranks get to end on their own after one exits with one of OWN_CODES
ENTRY_ENV = "JUSTRL_ENTRY"  # what each rank runs instead of the trainer (a program with the same stop contract)


def split_nproc(args: list[str]) -> tuple[int | None, list[str]]:
    """(N of --nproc-per-node N / --nproc-per-node=N, or None; the other arguments)."""
    nproc, rest, i = None, [], 0
    while i < len(args):
        arg = args[i]
        if arg in ("--nproc-per-node", "--nproc_per_node") and i + 1 < len(args):
            nproc, i = args[i + 1], i + 2
            continue
        if arg.startswith(("--nproc-per-node=", "--nproc_per_node=")):
            nproc = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if nproc is None:
        return None, rest
    if not nproc.isdigit() or int(nproc) < 1:
        _exit(2, f"--nproc-per-node={nproc}: give a whole number of processes, 1 or more")
    return int(nproc), rest


def _exit(code: int, line: str | None = None):
    if line:
        print(f"justrl-train: {line}", file=sys.stderr, flush=True)
    sys.exit(code)


def _lock_for_the_launch(overrides: list[str]) -> tuple[int | None, str | None, object]:
    """Take the run dir's lock (exit 2 in one line when busy): (the inheritable locked descriptor, the run dir, the
    outermost folder the lock created), or Nones when the command line does not compose (the ranks say why, exit 2)."""
    from . import run_lock
    from .train_entry import _run_dir_of, created_by_launch, run_dir_problem

    run_dir = _run_dir_of(overrides)
    if run_dir is None:  # the overrides do not compose (the ranks say why), or another entry's (JUSTRL_ENTRY)
        given = [a.split("=", 1)[1] for a in overrides if a.startswith("trainer.run_dir=")]
        if not given:
            return None, None, None
        run_dir = given[-1]
    problem = run_dir_problem(run_dir)
    if problem is not None:
        _exit(2, f"invalid config: {problem}")
    created = created_by_launch(run_dir)
    try:
        run_lock.hold(run_dir)
    except run_lock.RunDirBusy as exc:
        _exit(2, f"error: {exc}")
    except OSError as exc:
        _exit(2, f"trainer.run_dir={run_dir}: cannot write there ({exc.strerror or exc})")
    # a copy outside run_lock's table: its at-fork hook closes the table's descriptors in a child (which is right for
    # every other child, and runs in Popen's when it has a preexec_fn)
    fd = os.dup(run_lock._held[run_lock._key(run_dir)])
    os.set_inheritable(fd, True)
    return fd, run_dir, created


def _rank_env(rank: int, world: int, port: int, lock_fd: int | None) -> dict:
    from . import lifeline

    env = {k: v for k, v in os.environ.items() if k not in (lifeline.TRAINER_ENV, "TORCHELASTIC_RUN_ID")}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               **{lifeline.LAUNCHER_ENV: str(os.getpid())})
    if lock_fd is not None:
        from .run_lock import LOCK_FD_ENV

        env[LOCK_FD_ENV] = str(lock_fd)
    return env


def _kill_all(ranks: dict) -> None:
    for proc in ranks.values():
        if proc.returncode is None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _ignore_usr1() -> None:
    # (in the child, before exec: an ignored signal stays ignored) a rank still importing ignores Slurm's SIGUSR1
    # (the sbatch repeats it) rather than dying of it; its StopSignal handler replaces this
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def launch(nproc: int, overrides: list[str]) -> int:
    """Run `nproc` ranks of the trainer (or JUSTRL_ENTRY) on this machine; the launch's exit code."""
    from .ports import free_port

    lock_fd, run_dir, created = _lock_for_the_launch(overrides)
    print(f"justrl-train: {nproc} process(es) on this machine", file=sys.stderr, flush=True)
    entry = shlex.split(os.environ.get(ENTRY_ENV, "")) or ["-m", "justrl_megatron.cli", "train"]
    port = free_port()
    ranks: dict[int, subprocess.Popen] = {}
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        for proc in ranks.values():
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:
                    pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    for rank in range(nproc):
        ranks[rank] = subprocess.Popen([sys.executable, *entry, *overrides],
                                       env=_rank_env(rank, nproc, port, lock_fd),
                                       pass_fds=() if lock_fd is None else (lock_fd,), preexec_fn=_ignore_usr1)
    failed: tuple[int, int] | None = None  # (rank, returncode) of the first rank that failed
    kill_at = None  # when the ranks still running are SIGKILLed
    pids = {proc.pid: rank for rank, proc in ranks.items()}
    while any(proc.returncode is None for proc in ranks.values()):
        if kill_at is not None and time.monotonic() >= kill_at:
            _kill_all(ranks)
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.05)
            continue
        if pid not in pids:
            continue
        rank = pids[pid]
        ranks[rank].returncode = code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed = (rank, code)
            # without this rank the others cannot finish a step: at once, unless it ended the way every rank will
            # (a refused config, Ctrl-C), so that rank 0 gets to say why
            kill_at = time.monotonic() + (GRACE_S if code in OWN_CODES else 0.0)
    if failed is None:
        return 0
    rank, code = failed
    if code == 2 and created is not None:  # a refused config (the ranks said why)
        from .train_entry import remove_unused

        remove_unused(run_dir, created)
    if code in OWN_CODES:
        return code
    others = f"; the other {nproc - 1} rank(s) were stopped" if nproc > 1 else ""
    if code < 0 and -code in received:
        _exit(128 - code, f"stopped by {signal.Signals(-code).name} before training started; nothing was saved")
    if code < 0:
        name = signal.Signals(-code).name
        why = " (the out-of-memory killer?)" if -code == signal.SIGKILL and not received else ""
        _exit(128 - code, f"error: rank {rank} was killed by {name}{why}{others}")
    _exit(code, f"error: rank {rank} exited with code {code} (its output above says why){others}")


def main(nproc: int, overrides: list[str]) -> None:
    try:
        code = launch(nproc, overrides)
    except KeyboardInterrupt:  # Ctrl-C before the ranks exist (the lock's composition)
        _exit(130, "interrupted before training started; nothing was saved")
    sys.exit(code)


if __name__ == "__main__":  # python -m justrl_megatron.launch --nproc-per-node=N [overrides]
    n, rest = split_nproc(sys.argv[1:])
    main(n or 1, rest)
