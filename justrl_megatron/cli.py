"""Console scripts: justrl-train, justrl-convert, justrl-bench, justrl-eval.

Each one imports `justrl_megatron.compat` first (CPU redirections for megatron-core when CUDA is absent).
"""

from __future__ import annotations

import os
import sys

from . import early_interrupt

VALIDATE_ONLY = "--validate-only"


def train_main() -> None:
    """justrl-train [--nproc-per-node=N] [--validate-only] [hydra overrides...]: GRPO training (default: the embedded
    CPU demo); with --nproc-per-node, N ranks on this machine under justrl's launcher (launch.py); with
    --validate-only, the launch's checks alone (train_entry.validate_only; N: the world size checked)."""
    early_interrupt.install()
    if VALIDATE_ONLY not in sys.argv[1:]:  # a launch (one process, or the launcher before its ranks): a stop exits 0
        early_interrupt.install_stop()
    from .launch import split_nproc

    nproc, sys.argv[1:] = split_nproc(sys.argv[1:])
    if VALIDATE_ONLY in sys.argv[1:]:
        if nproc is not None:
            os.environ["WORLD_SIZE"] = str(nproc)
        from .console import quiet_console

        quiet_console()
        import justrl_megatron.compat  # noqa: F401

        from .train_entry import validate_only

        sys.exit(validate_only([a for a in sys.argv[1:] if a != VALIDATE_ONLY]))
    if nproc is not None:
        from .launch import main as launch_main

        launch_main(nproc, sys.argv[1:])
    from .console import quiet_console, verbose_requested

    quiet_console(verbose=verbose_requested(sys.argv[1:]))  # before the libraries are imported: their import warnings
    import justrl_megatron.compat  # noqa: F401

    from .lifeline import await_the_launcher_if_a_peer_died
    from .train_entry import main

    try:
        main()
    except Exception as exc:
        await_the_launcher_if_a_peer_died(exc)
        raise


def convert_main(argv: list[str] | None = None) -> None:
    """justrl-convert {hf-to-mcore,mcore-to-hf,verify} ...: HF <-> Megatron checkpoints."""
    import justrl_megatron.compat  # noqa: F401

    from .convert.cli import main

    sys.exit(main(argv))


def bench_main(argv: list[str] | None = None) -> None:
    """justrl-bench --phase {rewards,rollout,train,sync,step} ... | --vs trl: throughput benchmarks."""
    from .bench.cli import main

    sys.exit(main(argv))


def eval_main(argv: list[str] | None = None) -> None:
    from .evaluate import main

    sys.exit(main(argv))


if __name__ == "__main__":  # python -m justrl_megatron.cli {train,convert,bench,eval} ...
    commands = {"train": train_main, "convert": convert_main, "bench": bench_main, "eval": eval_main}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(f"usage: python -m justrl_megatron.cli {{{','.join(commands)}}} [args...]", file=sys.stderr)
        sys.exit(2)
    name = sys.argv.pop(1)
    sys.argv[0] = f"justrl-{name}"
    commands[name]()
