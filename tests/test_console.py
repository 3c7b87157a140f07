"""console.py: known-harmless library lines are hidden by their exact text; everything else shows; verbose shows all.

Each case runs in a fresh interpreter (quiet_console changes process-wide warning filters, loggers and environment)
and is judged by what reaches its stderr.
"""

import subprocess
import sys

import pytest

from helpers import ENV
from justrl_megatron.console import verbose_requested

KNOWN_WARNING = "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer."
KNOWN_RECORD = "RotaryEmbedding: Failed to load weights"
RECORD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"

EMIT = f"""
import logging, sys, warnings
logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
{{setup}}
warnings.warn({KNOWN_WARNING!r}, UserWarning)                                   # known: hidden when quiet
warnings.warn({KNOWN_WARNING!r}[:-1] + " with a twist.", UserWarning)           # similar, not the same: shows
warnings.warn({KNOWN_WARNING!r}, RuntimeWarning)                                # same text, other category: shows
lib = logging.getLogger({RECORD_LOGGER!r})
lib.warning({KNOWN_RECORD!r})                                                    # known: hidden when quiet
lib.warning("LlamaRMSNorm: Failed to load weights")                              # similar, not the same: shows
lib.warning({KNOWN_RECORD!r} + " (partially)")                                   # a longer message: shows
lib.error({KNOWN_RECORD!r})                                                      # an error: always shows
logging.getLogger("vllm.other").warning({KNOWN_RECORD!r})                        # another logger: shows
logging.getLogger("justrl_megatron.train").warning("ours: reward is NaN")        # our own: always shows
warnings.warn("ours: prompts were dropped", UserWarning)
print("done", file=sys.stderr)
"""

ALWAYS_SHOWN = [
    "UserWarning: full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer with a twist.",
    f"RuntimeWarning: {KNOWN_WARNING}",
    f"{RECORD_LOGGER} WARNING LlamaRMSNorm: Failed to load weights",
    f"{RECORD_LOGGER} WARNING {KNOWN_RECORD} (partially)",
    f"{RECORD_LOGGER} ERROR {KNOWN_RECORD}",
    f"vllm.other WARNING {KNOWN_RECORD}",
    "justrl_megatron.train WARNING ours: reward is NaN",
    "UserWarning: ours: prompts were dropped",
    "done",
]


def stderr_of(setup: str, env: dict | None = None) -> list[str]:
    code = EMIT.replace("{setup}", setup)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**ENV, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return [line.split(": ", 1)[1] if line.startswith("<string>:") else line for line in proc.stderr.splitlines()
            if not line.startswith("  ")]  # drop the source lines warnings print under each warning


KNOWN_LINES = (f"UserWarning: {KNOWN_WARNING}", f"{RECORD_LOGGER} WARNING {KNOWN_RECORD}")


def known_lines(lines):
    return [line for line in lines if line in KNOWN_LINES]


def test_without_the_console_everything_shows():
    lines = stderr_of("")
    assert len(known_lines(lines)) == 2, lines
    assert all(line in lines for line in ALWAYS_SHOWN), lines


@pytest.mark.parametrize("calls", [
    "quiet_console()",
    "quiet_console(); quiet_console()",  # idempotent
    "quiet_console(verbose=True); quiet_console()",  # the last call decides
])
def test_quiet_hides_exactly_the_known_messages(calls):
    lines = stderr_of(f"from justrl_megatron.console import quiet_console\n{calls}")
    assert known_lines(lines) == [], lines
    assert all(line in lines for line in ALWAYS_SHOWN), lines


@pytest.mark.parametrize("calls", ["quiet_console(verbose=True)", "quiet_console(); quiet_console(verbose=True)"])
def test_verbose_shows_everything(calls):
    lines = stderr_of(f"from justrl_megatron.console import quiet_console\n{calls}")
    assert len(known_lines(lines)) == 2, lines
    assert all(line in lines for line in ALWAYS_SHOWN), lines


def test_a_child_of_a_quiet_process_is_quiet_once_it_imports_the_package():
    """vLLM's engine core in a spawned child imports justrl_megatron (our worker extension): same filters there."""
    parent = "from justrl_megatron.console import quiet_console\nquiet_console()\nimport os\n" \
             "print('FLAG', os.environ['JUSTRL_QUIET_CONSOLE'], file=sys.stderr)"
    assert "FLAG 1" in stderr_of(parent)
    lines = stderr_of("import justrl_megatron", env={"JUSTRL_QUIET_CONSOLE": "1"})
    assert known_lines(lines) == [], lines
    assert all(line in lines for line in ALWAYS_SHOWN), lines
    lines = stderr_of("import justrl_megatron", env={"JUSTRL_QUIET_CONSOLE": "0"})
    assert len(known_lines(lines)) == 2, lines


def test_megatrons_non_leaf_grad_read_through_compat_is_hidden_but_not_elsewhere():
    """megatron's DistributedOptimizer.zero_grad reads .grad of non-leaf shard views; on CPU the read goes through
    compat's TorchFunctionMode (the warning names compat.py). Only that attribution is hidden."""
    code = """
import sys, warnings, torch
from justrl_megatron.console import quiet_console
quiet_console()
x = torch.ones(2, requires_grad=True)
(x * 2).grad  # plain torch, outside compat's mode: shows
import justrl_megatron.compat
(x * 3).grad  # through compat's mode: hidden
print("done", file=sys.stderr)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr
    hits = [line for line in proc.stderr.splitlines() if "is not a leaf Tensor is being accessed" in line]
    assert len(hits) == 1 and hits[0].startswith("<string>:6: UserWarning"), proc.stderr


def test_verbose_is_read_from_the_command_line():
    assert verbose_requested(["trainer.total_steps=2", "logging.verbose=true"])
    assert verbose_requested(["++logging.verbose=True"])
    assert not verbose_requested(["logging.verbose=false"])
    assert not verbose_requested(["trainer.total_steps=2"])
