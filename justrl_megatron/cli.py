"""Console scripts: justrl-train, justrl-convert, justrl-bench, justrl-eval.

Each one imports `justrl_megatron.compat` first (CPU redirections for megatron-core when CUDA is absent).
"""

from __future__ import annotations

import sys


def train_main() -> None:
    """justrl-train [hydra overrides...]: GRPO training (default: the embedded CPU demo)."""
    from .console import quiet_console, verbose_requested

    quiet_console(verbose=verbose_requested(sys.argv[1:]))  # before the libraries are imported: their import warnings
    import justrl_megatron.compat  # noqa: F401

    from .train_entry import main

    main()


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
