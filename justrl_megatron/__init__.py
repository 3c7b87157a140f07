"""justrl-megatron."""

import os as _os
import sys as _sys

if _sys.orig_argv[1:3] == ["-m", "justrl_megatron.cli"]:  # a launched rank: `python -m` imports this package first
    from .early_interrupt import install as _install_early_interrupt

    _install_early_interrupt()

if _os.environ.get("JUSTRL_QUIET_CONSOLE") == "1":  # a child of a quiet run (e.g. vLLM's engine core): quiet too
    from .console import install_from_env as _install_from_env

    _install_from_env()

if _os.environ.get("JUSTRL_TRAINER_PID"):  # a helper a trainer started (lifeline.py): it dies with the trainer
    from .lifeline import watch_from_env as _watch_from_env

    _watch_from_env()
elif _os.environ.get("JUSTRL_LAUNCHER_PID") or _os.environ.get("LOCAL_RANK") is not None:
    # a rank of a launch (justrl's launcher or torchrun): it dies with its launcher (lifeline.py)
    from .lifeline import watch_launcher as _watch_launcher

    _watch_launcher()
