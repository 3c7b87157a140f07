"""justrl-train's Ctrl-C before training starts: one line (rank 0), exit 130, no traceback.

Installed by the console script first thing, and by the package itself in a rank its launcher started with
`python -m justrl_megatron.cli` (that imports the package before cli runs: a Ctrl-C while it loads would otherwise
be a KeyboardInterrupt traceback). train/interrupt.py takes over once the loop runs. Only os and signal here: this
runs before anything else is imported.
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
