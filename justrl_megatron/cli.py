"""Console scripts: justrl-train, justrl-convert, justrl-bench, justrl-eval.

Each one imports `justrl_megatron.compat` first (CPU redirections for megatron-core when CUDA is absent).
"""

from __future__ import annotations

import sys

NOT_IMPLEMENTED_EXIT = 2


def _not_implemented(command: str, issue: str, argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(f"usage: {command} ...\n\n{command} is not implemented yet (it lands with {issue}).")
        return 0
    print(f"{command}: not implemented yet (it lands with {issue}).", file=sys.stderr)
    return NOT_IMPLEMENTED_EXIT


def train_main() -> None:
    """justrl-train [hydra overrides...]: GRPO training (default: the embedded CPU demo)."""
    import justrl_megatron.compat  # noqa: F401

    from .train_entry import main

    main()


def convert_main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    sys.exit(_not_implemented("justrl-convert", "issue 5 (checkpoint converter)", argv))


def bench_main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    sys.exit(_not_implemented("justrl-bench", "issue 9 (benchmarks)", argv))


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
