"""MBPP-style code reward: run the response's code against the tests in an OS sandbox; grade = fraction passed.

Nothing the sandboxed code reports is trusted. Each test (``assert add(1, 2) == 3``) is split here, in the verifier's
process, into the values only the solution can compute (``add(1, 2)``) and the verdict (``_v0 == 3``). Only the value
expressions enter the sandbox (sandbox.py: namespaces, read-only runtime, no network, rlimits, a deadline that kills
the whole PID namespace); it sends back each value as plain data (int, float, str, list, dict, ... — any other object
is an error), and the verdict runs here on those decoded values. The expected values never enter the sandbox, so
output the solution forges can only claim values it could as well have returned, and an object whose ``__eq__``
always says True never reaches a comparison. A test is split at comparisons, boolean operators, arithmetic,
containers and calls of builtins / stdlib modules (``set(f(x)) == set([1])``, ``math.isclose(f(x), 2.5)``); a test
that compares solution values inside a comprehension or lambda cannot be split and counts as failed. Statements
other than ``assert`` run here when they do not touch the solution (``expected = 5``), else in the sandbox.

The code is the last fenced ```python block of the response (else the last fenced block, else the content of the
last ``<answer>`` tag); none of these is the no-answer value. A response past the sandbox's deadline raises
``VerifierTimeout`` (the scorer counts it); constructing the verifier fails where no sandbox can run.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import json

from . import sandbox as _sandbox
from .base import Verifier, VerifierTimeout, structured_answer
from .code_harness import HARNESS, decode

MAX_CODE_CHARS = 100_000
# Modules a test may use around solution values in the verifier's process (pure, stdlib).
_MODULES = frozenset({"math", "cmath", "re", "collections", "itertools", "heapq", "bisect", "functools", "operator",
                      "string", "fractions", "decimal", "statistics"})
_SPLIT = (ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.IfExp, ast.Tuple, ast.List, ast.Set, ast.Dict,
          ast.Subscript, ast.Slice, ast.Starred, ast.keyword)
_DECIDES = (ast.Compare, ast.BoolOp, ast.IfExp)
_PLACEHOLDER = "_sandbox_value_"


class _Unsplittable(Exception):
    pass


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(header, body) of every closed ``` block, paired left to right (linear time: no backtracking regex)."""
    parts = text.split("```")
    blocks = []
    for k in range(1, len(parts) - 1, 2):
        header, newline, body = parts[k].partition("\n")
        if newline:
            blocks.append((header.strip(), body))
    return blocks


def extract_code(response: str) -> str | None:
    blocks = [b for b in _fenced_blocks(response) if b[1].strip()]
    py = [body for header, body in blocks if header in ("python", "py", "Python")]
    if py or blocks:
        return (py or [b[1] for b in blocks])[-1]
    end = response.rfind("</answer>")
    start = response.rfind("<answer>", 0, max(end, 0))
    if end < 0 or start < 0 or not response[start + 8:end].strip():
        return None
    inner = response[start + 8:end]
    blocks = _fenced_blocks(inner)
    return blocks[-1][1] if blocks else inner


def _bound_names(tree: ast.AST) -> set[str]:
    """Every name a test statement binds (over-approximated: locals too); ``import <stdlib module>`` excepted."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] not in _MODULES}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


class _Splitter(ast.NodeTransformer):
    """Replace each subexpression only the sandbox can evaluate by a placeholder ``_vN``; collect their sources."""

    def __init__(self, local: set[str], exprs: list[str]):
        self.local, self.exprs = local, exprs

    def needs_sandbox(self, node) -> bool:
        return any(isinstance(n, ast.Name) and n.id not in self.local for n in ast.walk(node))

    def visit(self, node):
        if not self.needs_sandbox(node):
            return node
        if isinstance(node, _SPLIT) or (isinstance(node, ast.Call) and not self.needs_sandbox(node.func)):
            return self.generic_visit(node)
        if any(isinstance(n, _DECIDES) and self.needs_sandbox(n) for n in ast.walk(node)):
            raise _Unsplittable  # a verdict on solution values would be computed inside the sandbox
        self.exprs.append(ast.unparse(node))
        return ast.copy_location(ast.Name(id=f"{_PLACEHOLDER}{len(self.exprs) - 1}", ctx=ast.Load()), node)


def plan_test(test: str) -> tuple[list, list]:
    """(sandbox steps ``[kind, source]``, verifier-side program ``[(kind, code, first step, steps)]``) for a test.
    Builtins and the stdlib modules always mean the real ones here, even where the solution redefines them: else a
    solution's own ``set`` or ``math`` would pull the whole comparison into the sandbox."""
    local = set(dir(builtins)) | _MODULES
    steps, program = [], []
    for stmt in ast.parse(test).body:
        exprs: list[str] = []
        splitter = _Splitter(local, exprs)
        if isinstance(stmt, ast.Assert):
            verdict = ast.Expression(splitter.visit(stmt.test))
            code = compile(ast.fix_missing_locations(verdict), "test", "eval")
            program.append(("assert", code, len(steps), len(exprs)))
            steps += [["eval", e] for e in exprs]
        elif not splitter.needs_sandbox(stmt):
            program.append(("exec", compile(ast.Module([stmt], []), "test", "exec"), 0, 0))
            local |= _bound_names(stmt)
        else:
            steps.append(["exec", ast.unparse(stmt)])
            local -= _bound_names(stmt)
    if not any(entry[0] == "assert" for entry in program):
        raise _Unsplittable  # nothing to check here
    return steps, program


def _verify(program: list, results: list, modules: dict) -> bool:
    """Run a test's verifier-side program on the values the sandbox reported (``None``: that step failed)."""
    if any(r is None for r in results):
        return False
    env = {"__builtins__": builtins, **modules}
    for kind, code, first, count in program:
        if kind == "exec":
            exec(code, env)
            continue
        env.update({f"{_PLACEHOLDER}{i}": decode(r) for i, r in enumerate(results[first:first + count])})
        if not eval(code, env):
            return False
    return True


def run_tests(code: str, tests: list[str], setup: str = "", *, timeout_s: float = 10.0, per_test_s: int = 3,
              cpu_s: int = 10, memory_mb: int = 512, file_mb: int = 16, sandbox_kind: str = "auto") -> tuple[int, int]:
    """(passed, total) of ``tests`` against ``code``; raises VerifierTimeout when the sandbox's deadline passed."""
    try:
        ast.parse(setup + "\n" + code)
    except Exception:  # noqa: BLE001 - SyntaxError, or the parser's own limits on hostile nesting: no test can pass
        return 0, len(tests)
    plans = []
    for test in tests:
        try:
            plans.append(plan_test(test))
        except (_Unsplittable, SyntaxError, ValueError):
            plans.append(None)
    spec = {"code": code, "setup": setup, "per_test_s": per_test_s,
            "tests": [p[0] if p else [] for p in plans]}
    result = _sandbox.run_python(HARNESS, json.dumps(spec).encode(), deadline_s=timeout_s, cpu_s=cpu_s,
                                memory_mb=memory_mb, file_mb=file_mb, kind=sandbox_kind)
    if result.timed_out:
        raise VerifierTimeout(f"code sandbox passed its {timeout_s:.0f}s deadline")
    reported = _read_results(result.stdout, [len(p[0]) if p else 0 for p in plans])
    modules = {name: importlib.import_module(name) for name in _MODULES}
    passed = 0
    for plan, results in zip(plans, reported):
        try:
            passed += plan is not None and _verify(plan[1], results, modules)
        except Exception:  # noqa: BLE001 - a failing verdict, or a value that does not decode
            pass
    return passed, len(tests)


def _read_results(stdout: bytes, sizes: list[int]) -> list[list]:
    """Per test, the payload of each step (None: missing, failed, or reported twice — forged)."""
    seen: dict = {}
    for line in stdout.split(b"\n"):
        try:
            i, j, payload = json.loads(line)
        except (ValueError, TypeError, RecursionError):
            continue
        if type(i) is int and type(j) is int and 0 <= i < len(sizes) and 0 <= j < sizes[i]:
            seen[i, j] = None if (i, j) in seen or payload == ["err"] else payload
    return [[seen.get((i, j)) for j in range(n)] for i, n in enumerate(sizes)]


class CodeReward(Verifier):
    """answer: ``{"tests": [...], "setup": str}`` (or its JSON string); grade = fraction of tests passed.
    ``sandbox``: "auto" (bwrap, else unshare), "bwrap" or "unshare"."""

    in_process = False

    def __init__(self, correct: float | None = None, wrong: float | None = None, no_answer: float | None = None,
                 timeout_s: float = 10.0, per_test_s: int = 3, cpu_s: int = 10, memory_mb: int = 512,
                 sandbox: str = "auto"):
        super().__init__(correct, wrong, no_answer)
        self.timeout_s, self.per_test_s, self.cpu_s, self.memory_mb = float(timeout_s), int(per_test_s), int(cpu_s), \
            int(memory_mb)
        self.sandbox = sandbox
        _sandbox.check_available(sandbox)  # fail at construction, saying how to fix it, not on every response

    @property
    def time_limit_s(self) -> float:
        return self.timeout_s + _sandbox.TEARDOWN_S + 1.0  # the deadline, the namespace's teardown, the verdicts

    def grade(self, response: str, answer) -> float | None:
        spec = structured_answer(answer)
        tests = list(spec["tests"])
        code = extract_code(response)
        if code is None:
            return None
        if not tests or len(code) > MAX_CODE_CHARS:
            return 0.0
        passed, total = run_tests(code, tests, spec.get("setup") or "", timeout_s=self.timeout_s,
                                  per_test_s=self.per_test_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb,
                                  sandbox_kind=self.sandbox)
        return min(passed, total) / total
