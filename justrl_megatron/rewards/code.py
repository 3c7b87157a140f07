"""MBPP-style code reward: run the response's function against the tests in a sandboxed subprocess.

Grade = the fraction of tests that pass (partial credit). The sandbox is a fresh ``python -I -S`` process in a
private temporary directory, with limits on CPU time, address space, file size and wall-clock time (the whole
process group is killed at the deadline), a minimal environment, and — inside the harness, before the solution
runs — sockets, subprocesses, forking and destructive ``os``/``shutil`` calls replaced by stubs that raise. That stops
accidents and the usual reward hacks; it is not a security boundary against hostile code (use a container for that).

The code is the last fenced ```python block of the response (else the last fenced block, else the content of the
last ``<answer>`` tag); none of these is the no-answer value.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile

from .base import Verifier, structured_answer

_PY_BLOCK = re.compile(r"```(?:python|py|Python)[ \t]*\n(.*?)```", re.S)
_ANY_BLOCK = re.compile(r"```[^\n`]*\n(.*?)```", re.S)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)

# Runs inside the sandbox. Reads spec.json, reports one line per test on a dup of the original stdout, prefixed by a
# random marker the solution cannot know; the solution's own output goes to /dev/null.
_HARNESS = r"""
import json, os, resource, signal, sys


def _blocked(*a, **k):
    raise PermissionError("blocked in the reward sandbox")


def _on_alarm(signum, frame):
    raise TimeoutError("test timed out")


def main():
    # Everything the report needs lives in this frame's locals, out of the solution's globals.
    with open("spec.json") as f:
        spec = json.load(f)
    marker = spec.pop("marker")
    # Limits are set here rather than in a preexec_fn, which is unsafe when the parent process has threads.
    for limit, value in ((resource.RLIMIT_CPU, spec["cpu_s"]), (resource.RLIMIT_AS, spec["memory_mb"] << 20),
                         (resource.RLIMIT_FSIZE, spec["file_mb"] << 20), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    out = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    write = os.write

    import shutil, socket, subprocess
    socket.socket = socket.create_connection = socket.socketpair = _blocked
    subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_output = subprocess.check_call = _blocked
    shutil.rmtree = shutil.move = shutil.chown = _blocked
    for name in ("system", "popen", "fork", "forkpty", "kill", "killpg", "remove", "unlink", "rmdir", "removedirs",
                 "rename", "renames", "replace", "truncate", "chmod", "chown", "putenv", "setuid", "execv", "execve",
                 "execl", "execlp", "execvp", "spawnv", "spawnl", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, _blocked)
    signal.signal(signal.SIGALRM, _on_alarm)

    g = {"__name__": "solution"}  # a main guard in the response must not run (it may read stdin)
    try:
        signal.alarm(spec["per_test_s"])
        exec(compile(spec["setup"] + "\n" + spec["code"], "solution.py", "exec"), g)
    except BaseException:
        return
    finally:
        signal.alarm(0)
    for i, test in enumerate(spec["tests"]):
        ok = False
        try:
            signal.alarm(spec["per_test_s"])
            exec(compile(test, "test_%d.py" % i, "exec"), g)
            ok = True
        except BaseException:
            pass
        finally:
            signal.alarm(0)
        write(out, ("%s test %s\n" % (marker, "true" if ok else "false")).encode())


main()
"""


def extract_code(response: str) -> str | None:
    for pattern in (_PY_BLOCK, _ANY_BLOCK, _ANSWER_TAG):
        found = pattern.findall(response)
        if found and found[-1].strip():
            code = found[-1]
            inner = _PY_BLOCK.findall(code) or _ANY_BLOCK.findall(code)  # a fenced block inside <answer>
            return inner[-1] if inner else code
    return None


def run_tests(code: str, tests: list[str], setup: str = "", *, timeout_s: float = 10.0, per_test_s: int = 3,
              cpu_s: int = 10, memory_mb: int = 512, file_mb: int = 16) -> tuple[int, int]:
    """Run ``code`` then each test in the sandbox; returns (passed, total). A test not reached counts as failed."""
    marker = secrets.token_hex(16)
    workdir = tempfile.mkdtemp(prefix="justrl-code-")
    try:
        with open(os.path.join(workdir, "spec.json"), "w") as f:
            json.dump({"code": code, "setup": setup, "tests": tests, "marker": marker, "per_test_s": per_test_s,
                       "cpu_s": cpu_s, "memory_mb": memory_mb, "file_mb": file_mb}, f)
        with open(os.path.join(workdir, "harness.py"), "w") as f:
            f.write(_HARNESS)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "PYTHONHASHSEED": "0",
               "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
        proc = subprocess.Popen([sys.executable, "-I", "-S", "harness.py"], cwd=workdir, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, _ = proc.communicate()
        passed = 0
        prefix = marker.encode() + b" test "
        for line in out.splitlines():
            if line.startswith(prefix) and line[len(prefix):].strip() == b"true":
                passed += 1
        return passed, len(tests)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class CodeReward(Verifier):
    """answer: ``{"tests": [...], "setup": str}`` (or its JSON string); grade = fraction of tests passed."""

    in_process = False

    def __init__(self, correct: float | None = None, wrong: float | None = None, no_answer: float | None = None,
                 timeout_s: float = 10.0, per_test_s: int = 3, cpu_s: int = 10, memory_mb: int = 512):
        super().__init__(correct, wrong, no_answer)
        self.timeout_s, self.per_test_s, self.cpu_s, self.memory_mb = float(timeout_s), int(per_test_s), int(cpu_s), \
            int(memory_mb)

    def grade(self, response: str, answer) -> float | None:
        spec = structured_answer(answer)
        tests = list(spec["tests"])
        code = extract_code(response)
        if code is None:
            return None
        if not tests:
            return 0.0
        passed, total = run_tests(code, tests, spec.get("setup") or "", timeout_s=self.timeout_s,
                                  per_test_s=self.per_test_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb)
        return passed / total
