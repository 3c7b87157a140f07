"""justrl-train's Ctrl-C and stop signals before training starts: one line (rank 0), no traceback.

Ctrl-C exits 130. Installed by the console script first thing, and by the package itself in a rank its launcher
started with `python -m justrl_megatron.cli` (that imports the package before cli runs: a Ctrl-C while it loads would
otherwise be a KeyboardInterrupt traceback).
A stop (SIGTERM, SIGUSR1: Slurm's time limit or requeue) exits 0, as a stop during training does: there is nothing
to save yet, and the line says so (`install_stop`, for a training launch of one process). A rank of a multi-rank
launch is left to die of the signal: its peers may be waiting for it in a rendezvous, and its launcher ends them at
once and says the line, exiting 0 (launch.py). interrupt.py takes over once the loop runs. Only os and signal here:
this runs before anything else is imported.
"""

import os
import signal

BEFORE_TRAINING = "justrl-train: interrupted before training started; nothing was saved\n"


def interrupted_before_training(signum, frame) -> None:
    # at once and without an exception (a KeyboardInterrupt in an import, or a second copy of the same Ctrl-C from
    # the launcher inside an except block, would print a traceback); that second copy (the terminal and the launcher
    # both send it) must not run this again between the line and the exit
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.environ.get("RANK", "0") == "0":
        os.write(2, BEFORE_TRAINING.encode())
    os._exit(130)


def install() -> None:
    signal.signal(signal.SIGINT, interrupted_before_training)


STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)  # Slurm's requeue and time limit, a user's kill (slurm.py)
_training = False  # the trainer's own handlers took over (interrupt.Interruptible.install)


def training_started() -> None:
    global _training
    _training = True


def stopped_before_training(signum, frame) -> None:
    if _training:  # put back at exit by the trainer's handlers (slurm.StopSignal.restore): a late repeat is nothing
        return
    # as for Ctrl-C: at once, without an exception, and once (Slurm and a launcher may both send the signal)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if os.environ.get("RANK", "0") == "0":
        name = signal.Signals(signum).name
        os.write(2, f"justrl-train: stopped by {name} before training started; nothing to save\n".encode())
    os._exit(0)


def install_stop() -> None:
    """A stop before training starts exits 0 with one line. Left as they were: the signals of a process of a launch
    of several, and a signal its parent set to be ignored (a launcher's rank still importing ignores SIGUSR1, which
    the batch script repeats until the trainer's own handler takes it: launch.py)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, stopped_before_training)
