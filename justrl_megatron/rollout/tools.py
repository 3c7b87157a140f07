"""Tools a policy may call while it generates (rollout.tools): the `Tool` seam and the sandboxed Python tool.

A tool says three things: whether a finished piece of model text ends in a call to it (`find_call`), how to run a
call (`run`, in a worker thread: it must never raise), and how its result reads to the model (`format`, tokenised and
appended as context). rollout/multi_turn.py drives the engine around them.

The Python tool recognises the format Qwen / DeepSeek-R1-Distill models write by themselves, a fenced block

    ```python
    print(3 + 7)
    ```

(the call is made once the block closes: at a line of just ``` (Markdown's rule: `fenced_block_at_end`), so a fence
inside the code, e.g. `print("```")`, does not end it early) and answers in kind (ToRL / ReTool style):

    ```output
    10
    ```

The code runs in rewards/sandbox.py's OS sandbox (bubblewrap or unshare: no network, no host files, a private size
limited /tmp, process / memory / CPU / file-size limits, the whole PID namespace killed at the deadline), where the
standard library and the packages of rollout.tool.packages (default sympy and numpy, read-only) import and nothing
else installed does. Code from a model is hostile: it runs there and nowhere else. A machine where no sandbox runs,
or where those packages do not import under the tool's limits, is refused before the model loads (`problems`); a
sandbox that fails during a rollout (crashed) gives the model an error message, never an exception in the rollout.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Protocol

FENCE = "```"
# the program the sandbox runs: the call's code comes on stdin (never spliced into source); errors are printed to
# stdout (the sandbox returns only stdout) without the wrapper's frames; a last bare expression is printed, as a
# notebook cell would (models often end a block with `x` rather than `print(x)`)
_RUNNER = r"""
import ast as _ast, sys as _sys, traceback as _tb
_sys.stdout.reconfigure(line_buffering=True)
_sys.stderr = _sys.stdout
_src = _sys.stdin.read()
_g = {"__name__": "__main__"}
try:
    _tree = _ast.parse(_src, "<code>")
    _last = None
    if _tree.body and isinstance(_tree.body[-1], _ast.Expr):
        _last = _ast.Expression(_tree.body.pop().value)
    exec(compile(_tree, "<code>", "exec"), _g)
    if _last is not None:
        _v = eval(compile(_last, "<code>", "eval"), _g)
        if _v is not None:
            print(repr(_v))
except SystemExit as _e:
    _sys.exit(_e.code if isinstance(_e.code, int) else 1)
except SyntaxError as _e:  # raised inside ast.parse: its frames say nothing about the code
    print("".join(_tb.format_exception_only(type(_e), _e)), end="")
    _sys.exit(1)
except BaseException as _e:
    _tb.print_exception(type(_e), _e, _e.__traceback__.tb_next if _e.__traceback__ else None)
    _sys.exit(1)
"""


@dataclass
class Observation:
    """What one call gave back."""

    text: str  # what the model sees (before `Tool.format`)
    status: str  # ok | error (the code raised or exited non-zero, or the sandbox failed) | timeout
    seconds: float  # wall time of the call (sandbox start to teardown)


class Tool(Protocol):
    name: str

    def find_call(self, text: str) -> str | None:
        """The call that `text` (the model's text since the last tool output) ends with, else None."""

    def run(self, call: str) -> Observation:
        """Run a call; never raises (a failure is an Observation with status error)."""

    def format(self, obs: Observation) -> str:
        """The tool turn as the model reads it."""

    def problems(self) -> list[str]:
        """What this machine lacks for the tool to run (config validation asks, before the model loads)."""


_CLOSING_FENCE = re.compile(r"^[ \t]*```[ \t]*\r?$", re.MULTILINE)


def fenced_block_at_end(text: str) -> tuple[str, str] | None:
    """(header, code) of the fenced block `text` ends in (nothing after its closing fence but whitespace), else None.

    Markdown's rule for the closing fence: a line of its own, ``` with nothing but spaces or tabs around it. A fence
    inside the code, e.g. in a string literal (`print("```")`, `s = "```python"`), does not close the block; a
    line of just ``` inside a multi-line string still does, as in any Markdown reader. An opening fence may stand
    anywhere outside a block (a model may write "Let me check:```python"); its header is the rest of its line."""
    pos = 0
    while True:
        start = text.find(FENCE, pos)
        if start < 0:
            return None
        eol = text.find("\n", start)
        if eol < 0:
            return None  # the header line is still being written
        close = _CLOSING_FENCE.search(text, eol + 1)
        if close is None:
            return None  # the block is still open
        if not text[close.end():].strip():
            return text[start + len(FENCE):eol], text[eol + 1:close.start()]
        pos = close.end()


def trigger_token_ids(tokenizer) -> set[int]:
    """Token ids that carry a backtick: only after one of them can a fence have closed. Any backtick, not only "```":
    Qwen2's tokenizer writes a closing "```\\n" as "``" + "`\\n" (byte-level BPE keeps "`" as itself; a byte-fallback
    vocabulary spells it <0x60>)."""
    return {i for piece, i in tokenizer.get_vocab().items() if "`" in piece or piece == "<0x60>"}


class PythonTool:
    """A fenced ```python block run in the OS sandbox; its stdout (or traceback) comes back as an ```output block."""

    name = "python"
    languages = ("python", "py", "python3")

    def __init__(self, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 1024,
                 sandbox: str = "auto", nproc: int = 16, file_mb: int = 16, packages=()):
        self.timeout_s, self.memory_mb, self.sandbox = float(timeout_s), int(memory_mb), sandbox
        self.max_output_chars, self.nproc, self.file_mb = int(max_output_chars), int(nproc), int(file_mb)
        self.packages = tuple(str(p) for p in packages)  # import packages the code may use (rollout.tool.packages)

    def find_call(self, text: str) -> str | None:
        """The code of the block `text` ends in, when that block was opened with a Python tag (text after the closing
        fence on its line is whitespace: a token may carry the newline). See `fenced_block_at_end` for the rule."""
        block = fenced_block_at_end(text)
        if block is None:
            return None
        header, code = block
        if header.strip().lower() not in self.languages or not code.strip():
            return None
        return code

    def run(self, call: str) -> Observation:
        from ..rewards import sandbox

        t = time.perf_counter()
        try:
            # CPU time one second past the deadline: the wall clock decides, and a busy loop is a timeout
            r = sandbox.run_python(_RUNNER, call.encode(), deadline_s=self.timeout_s, cpu_s=int(self.timeout_s) + 1,
                                   memory_mb=self.memory_mb, file_mb=self.file_mb, nproc=self.nproc,
                                   max_output=4 * self.max_output_chars + 4096, kind=self.sandbox,
                                   packages=self.packages)
        except Exception as exc:  # noqa: BLE001  (the sandbox itself failed: the model is told, the rollout goes on)
            return Observation(f"error: the sandbox failed ({type(exc).__name__}: {exc})", "error",
                               time.perf_counter() - t)
        seconds = time.perf_counter() - t
        text = r.stdout.decode("utf-8", errors="replace")
        if r.timed_out:
            said = f"TimeoutError: the code ran longer than {self.timeout_s:g} s and was stopped"
            return Observation(f"{text.rstrip()}\n{said}".lstrip("\n"), "timeout", seconds)
        if r.truncated:
            return Observation(text, "ok", seconds)  # cut below: the model reads the first characters
        return Observation(text, "ok" if r.returncode == 0 else "error", seconds)

    def format(self, obs: Observation) -> str:
        text = obs.text.rstrip("\n")
        if len(text) > self.max_output_chars:
            text = text[:self.max_output_chars] + f"\n... (output cut at {self.max_output_chars} characters)"
        return f"\n{FENCE}output\n{text}\n{FENCE}\n"

    def problems(self) -> list[str]:
        from ..rewards import sandbox

        why = sandbox.unavailable(self.sandbox)
        if why is not None:
            return [f"rollout.tools: the python tool runs model code in an OS sandbox and {why}"]
        why = sandbox.package_problem(self.packages, kind=self.sandbox, memory_mb=self.memory_mb, nproc=self.nproc,
                                      file_mb=self.file_mb)
        if why is not None:
            return [f"rollout.tool.packages={list(self.packages)}: {why} (install them, drop them from the list, or "
                    f"raise rollout.tool.memory_mb)"]
        return []


TOOLS = {"python": PythonTool}

# What rollout.tool.packages may not bring into the sandbox, by itself or as a requirement, unless
# rollout.tool.allow_training_stack says so: the trainer's own stack (normalised distribution names, and import names
# for a package not installed here). Model-written code runs there; the stack is the trainer's, not the tool's.
TRAINING_STACK = ("torch", "vllm", "megatron", "megatron-core", "transformer-engine", "flash-attn", "apex", "triton",
                  "deepspeed", "xformers", "justrl-megatron")


def _stack_name(name: str) -> str | None:
    """The TRAINING_STACK entry a distribution or import name is (or is a part of: transformer-engine-cu12), else
    None."""
    normal = re.sub(r"[-_.]+", "-", name).lower()
    return next((s for s in TRAINING_STACK if normal == s or normal.startswith(s + "-")), None)


def training_stack_in(packages, *, requirements: bool = True) -> list[str]:
    """What of the training stack the import packages `packages` would put into the sandbox, each as "torch" or
    "accelerate (requires torch)" (`requirements`: also what they require, read from the installed metadata); a
    package not installed here counts by its own name only."""
    from ..rewards.sandbox import PackageMissing, package_distributions

    found = []
    for name in packages:
        if _stack_name(name):
            found.append(name)
            continue
        if not requirements:
            continue
        try:
            brought = package_distributions((name,))
        except PackageMissing:
            continue  # the sandbox check names it
        stack = sorted({_stack_name(d) for d in brought} - {None})
        if stack:
            found.append(f"{name} (requires {', '.join(stack)})")
    return found


def make_tools(rollout_cfg) -> list:
    """The tools `rollout.tools` names, with the rollout.tool limits and packages."""
    tool = rollout_cfg.tool
    return [TOOLS[name](timeout_s=tool.timeout_s, memory_mb=tool.memory_mb, max_output_chars=tool.max_output_chars,
                        sandbox=tool.sandbox, packages=tuple(tool.packages))
            for name in rollout_cfg.tools]


def environment(rollout_cfg) -> dict:
    """What a tool call's output depends on, as config keys: the tools and every tool setting but the number of calls
    run at once ({} without tools). A group kept at a stop carries the outputs of this environment
    (rollout/stream_source.py: another one on resume generates the group anew)."""
    if not rollout_cfg.tools:
        return {}
    tool = rollout_cfg.tool
    return {"rollout.tools": list(rollout_cfg.tools), "rollout.tool.max_turns": tool.max_turns,
            "rollout.tool.timeout_s": tool.timeout_s, "rollout.tool.memory_mb": tool.memory_mb,
            "rollout.tool.max_output_chars": tool.max_output_chars, "rollout.tool.sandbox": tool.sandbox,
            "rollout.tool.packages": list(tool.packages)}


def problems(cfg) -> list[str]:
    """rollout.tools' refusals (config.validate collects them); with a valid tool configuration, also what this
    machine lacks to run the tools (each tool's `problems`: no OS sandbox, packages that do not import in it)."""
    ro, out = cfg.rollout, []
    tools = list(ro.tools or [])
    unknown = [t for t in tools if t not in TOOLS]
    if unknown:
        out.append(f"rollout.tools: unknown tool(s) {unknown}; known: {', '.join(TOOLS)}")
    twice = sorted({t for t in tools if tools.count(t) > 1})
    if twice:
        out.append(f"rollout.tools names {', '.join(twice)} more than once; list each tool once")
    tool = ro.tool
    packages = list(tool.packages or [])
    bad = [p for p in packages if not isinstance(p, str) or not p.isidentifier()]
    if bad or len(set(packages)) < len(packages):
        out.append(f"rollout.tool.packages must list import names (e.g. [sympy, numpy]), each once; got {packages}")
    elif not tool.allow_training_stack and (stack := training_stack_in(packages, requirements=bool(tools))):
        out.append(f"rollout.tool.packages={packages}: {', '.join(stack)} would put the training stack into the "
                   f"sandbox where model-written code runs; drop it, or set rollout.tool.allow_training_stack=true")
    for key, rule, ok in (("max_turns", ">= 1 (tool calls per response)", lambda v: isinstance(v, int) and v >= 1),
                          ("timeout_s", "> 0", lambda v: v > 0), ("memory_mb", ">= 32", lambda v: v >= 32),
                          ("max_output_chars", ">= 1", lambda v: v >= 1), ("workers", ">= 1", lambda v: v >= 1)):
        value = getattr(tool, key)
        if isinstance(value, float) and not math.isfinite(value):
            continue  # said by config.nonfinite_problems
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            out.append(f"rollout.tool.{key} must be {rule}, got {value!r}")
    from ..rewards.sandbox import BACKENDS

    if tool.sandbox not in BACKENDS:
        out.append(f"rollout.tool.sandbox must be one of {', '.join(BACKENDS)}, got {tool.sandbox!r}")
    if cfg.algo.tool_error_penalty < 0 or cfg.algo.tool_timeout_penalty < 0:
        out.append(f"algo.tool_error_penalty and algo.tool_timeout_penalty are subtracted per call: they must be "
                   f">= 0, got {cfg.algo.tool_error_penalty} and {cfg.algo.tool_timeout_penalty}")
    if not tools:
        return out
    if ro.tensor_parallel > 1:
        out.append(f"rollout.tools needs rollout.tensor_parallel=1 (the ranks of one engine would have to see tool "
                   f"results in the same order), got {ro.tensor_parallel}")
    if cfg.algo.routing_replay == "rollout":
        out.append("rollout.tools does not work with algo.routing_replay=rollout (vLLM returns no experts for tool "
                   "tokens); use algo.routing_replay=old")
    if not out:  # runs the sandbox: only for a configuration that could otherwise train
        out += [p for tool in make_tools(ro) for p in tool.problems()]
    return out


def tool_penalties(rewards, tool_stats, *, error_penalty: float, timeout_penalty: float) -> tuple[list, dict]:
    """Rewards minus `error_penalty` per failed call and `timeout_penalty` per timed-out call of each response
    (algo.tool_error_penalty / tool_timeout_penalty); returns (rewards, {reward/tool_penalty_mean})."""
    if tool_stats is None or not (error_penalty or timeout_penalty):
        return list(rewards), {}
    cut = [error_penalty * s["errors"] + timeout_penalty * s["timeouts"] for s in tool_stats]
    return [r - c for r, c in zip(rewards, cut)], {"reward/tool_penalty_mean": sum(cut) / max(len(cut), 1)}


def tool_metrics(rollouts) -> dict[str, float]:
    """tool/*: calls, errors, timeouts, model turns and sandbox seconds per response; the share of responses with a
    call; tool tokens per response (context, not trained on). Empty without tools."""
    stats = rollouts.tool_stats
    if not stats:
        return {}
    n = len(stats)
    mean = lambda key: sum(s[key] for s in stats) / n  # noqa: E731
    tool_tokens = [len(m) - sum(m) for m in rollouts.sampled_mask]
    return {"tool/calls_per_response": mean("calls"), "tool/call_rate": sum(s["calls"] > 0 for s in stats) / n,
            "tool/errors_per_response": mean("errors"), "tool/timeouts_per_response": mean("timeouts"),
            "tool/turns_per_response": mean("turns"), "tool/sandbox_s_per_response": mean("sandbox_s"),
            "tool/sandbox_s_total": sum(s["sandbox_s"] for s in stats),
            "tool/output_tokens_mean": sum(tool_tokens) / n}

