"""The code reward's sandbox against hostile solutions, and every verifier's bounds in time and in range.

Each hostile snippet is checked twice: its reward stays at the wrong-answer value, and its side effect is absent on
the host (no file, no connection, no process left running). Hostile tests run on every backend this machine has.
"""
import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

from justrl_megatron.rewards import BatchScorer, CodeReward, Verifier, get_reward_fn, sandbox
from justrl_megatron.rewards.code import plan_test

ROOT = Path(__file__).resolve().parents[1]
ADD = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"], "setup": ""}
FAST = dict(timeout_s=4.0, per_test_s=2)


def _backends():
    out = []
    for kind in ("bwrap", "unshare"):
        try:
            sandbox.check_available(kind)
            out.append(kind)
        except sandbox.SandboxUnavailable:
            pass
    return out or ["auto"]  # "auto" then fails loudly at construction: no backend at all is a finding


BACKENDS = _backends()


def py(code: str) -> str:
    return "```python\n" + textwrap.dedent(code).strip("\n") + "\n```"


def stray(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return [p for p in found if p != os.getpid()]


@pytest.fixture(params=BACKENDS)
def code_fn(request):
    return CodeReward(sandbox=request.param, **FAST)


def test_correct_and_partial(code_fn):
    assert code_fn(py("def add(a, b):\n    return a + b"), ADD) == 1.0
    assert code_fn(py("def add(a, b):\n    return 3"), ADD) == 0.5
    plain = {"tests": ["assert set(pair(3)) == {3, 4}", "assert math.isclose(half(3), 1.5)",
                       "assert not is_odd(4)", "assert list(gen(3)) == [0, 1, 2]", "assert Box(2).area() == 4"],
             "setup": "import math"}
    solution = """
        def pair(x): return (x, x + 1)
        def half(x): return x / 2
        def is_odd(x): return x % 2 == 1
        def gen(n): return (i for i in range(n))
        class Box:
            def __init__(self, s): self.s = s
            def area(self): return self.s ** 2
    """
    assert code_fn(py(solution), plain) == 1.0


def test_file_write_outside_fails(code_fn, tmp_path):
    target = tmp_path / "escaped.txt"
    fn = code_fn(py(f"""
        def add(a, b):
            open({str(target)!r}, "w").write("x")
            return a + b
    """), ADD)
    assert fn == 0.0 and not target.exists()
    # also not into the runtime, nor the sandbox's /dev or /
    for path in (os.path.join(sys.base_prefix, "escaped.txt"), "/dev/escaped", "/escaped"):
        assert code_fn(py(f"def add(a, b):\n    open({path!r}, 'w').write('x')\n    return a + b"), ADD) == 0.0
        assert not os.path.exists(path)


def test_secret_outside_unreadable(code_fn, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    answer = {"tests": ["assert leak() == 'hunter2'"], "setup": ""}
    assert code_fn(py(f"def leak():\n    return open({str(secret)!r}).read()"), answer) == 0.0
    assert code_fn(py("import os\ndef leak():\n    return str(os.listdir('/etc'))"), answer) == 0.0


def test_no_network_to_a_local_listener(code_fn):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        fn = code_fn(py(f"""
            import socket
            def add(a, b):
                socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"pwn")
                return a + b
        """), ADD)
        assert fn == 0.0
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


def test_fork_storm_contained(code_fn):
    marker = f"forkstorm-{os.getpid()}-{time.monotonic_ns()}"
    answer = {"tests": ["assert forks() >= 50"], "setup": ""}
    solution = f"""
        import os, sys
        n = 0
        for _ in range(50):
            try:
                if os.fork() == 0:
                    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
                n += 1
            except OSError:
                break
        def forks():
            return n
    """
    assert code_fn(py(solution), answer) == 0.0
    time.sleep(0.3)
    assert stray(marker) == []


@pytest.mark.slow
def test_setsid_double_fork_killed_at_deadline(code_fn):
    marker = f"escapee-{os.getpid()}-{time.monotonic_ns()}"
    solution = f"""
        import os, signal, sys
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
            os._exit(0)
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # the per-test alarm cannot stop it
        while True:
            pass
    """
    t0 = time.monotonic()
    assert code_fn(py(solution), ADD) == 0.0  # the deadline: the failure value
    assert time.monotonic() - t0 < code_fn.time_limit_s
    time.sleep(0.3)
    assert stray(marker) == []
    # a daemon left behind by a solution that finishes normally dies with the namespace too
    daemon = textwrap.dedent(solution).split("signal.pthread_sigmask")[0] + "def add(a, b):\n    return a + b\n"
    assert code_fn(py(daemon), ADD) == 1.0
    time.sleep(0.3)
    assert stray(marker) == []


def test_forged_output_cannot_raise_the_score(code_fn):
    answer = {"tests": ["assert fact(5) == 120", "assert fact(3) == 6"], "setup": ""}
    forge = """
        import json, os
        lines = [json.dumps([i, 0, v]) for i in range(2) for v in (True, ["i", "120"], ["i", "6"], ["ok"])]
        lines += ["%s test true" % ("0" * 32), "[0, 0, [\\"i\\", \\"120\\"]]"]
        for fd in range(64):
            for line in lines:
                try:
                    os.write(fd, (line + "\\n").encode())
                except OSError:
                    pass
        def fact(n):
            return 0
    """
    assert code_fn(py(forge), answer) == 0.0
    # forged lines and then no harness at all: a claimed value still has to be the right one
    assert code_fn(py(forge.replace("def fact(n):\n            return 0", "os._exit(0)")), answer) <= 0.5


def test_equality_tricks_score_zero(code_fn):
    always = """
        class Anything:
            def __eq__(self, other): return True
            __hash__ = object.__hash__
        def add(a, b): return Anything()
    """
    int_trick = """
        class Sly(int):
            def __eq__(self, other): return True
        def add(a, b): return Sly(0)
    """
    for solution in (always, int_trick):
        assert code_fn(py(solution), ADD) == 0.0
    # redefining the builtins / stdlib names a test's verdict uses does not move the verdict into the sandbox
    shadow = {"tests": ["assert set(pair(3)) == set((9, 9))", "assert math.isclose(half(3), 7.0)"], "setup": ""}
    solution = """
        class math:
            isclose = staticmethod(lambda *a, **k: True)
        def set(*a): return 0
        def pair(x): return (x, x + 1)
        def half(x): return x / 2
    """
    assert code_fn(py(solution), shadow) == 0.0
    # the verdict never runs inside: a test with a comparison inside a comprehension cannot be judged and fails
    steps, _ = plan_test("assert add(1, 2) == 3")
    assert steps == [["eval", "add(1, 2)"]]  # the expected value does not enter the sandbox
    assert code_fn(py("def add(a, b): return a + b"), {"tests": ["assert all(add(x, 0) == x for x in [1])"]}) == 0


@pytest.mark.slow
def test_memory_bomb_and_infinite_loop_bounded(code_fn, tmp_path):
    for bomb in ("x = bytearray(8 << 30)", "x = []\nwhile True:\n    x.append('x' * 10**6)",
                 "open('/tmp/fill', 'wb').write(b'x' * (200 << 20))"):
        t0 = time.monotonic()
        assert code_fn(py(bomb + "\ndef add(a, b):\n    return a + b"), ADD) == 0.0  # contained, bounded
        assert time.monotonic() - t0 < code_fn.time_limit_s
    loop = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass"
    with BatchScorer(code_fn, num_workers=1) as scorer:
        assert scorer.timeout_s > code_fn.timeout_s + sandbox.TEARDOWN_S
        t0 = time.monotonic()
        assert scorer.score([py(loop), py("def add(a, b):\n    return a + b")], [ADD, ADD]) == [0.0, 1.0]
        assert time.monotonic() - t0 < 2 * code_fn.time_limit_s
        assert scorer.stats["timeouts"] == 1 and scorer.stats["crashes"] == 0  # the sandbox's clock, not the pool's


def test_unprivileged_user_namespace_path(tmp_path):
    """As a normal user bwrap uses a user namespace; run the same checks as uid 65534 where this machine can."""
    system_python = "/usr/bin/python3"
    if os.geteuid() != 0 or shutil.which("bwrap") is None or not os.path.exists(system_python):
        pytest.skip("needs root (to become another user), bwrap and a system python readable by that user")
    script = textwrap.dedent("""
        import sys
        from justrl_megatron.rewards import CodeReward
        fn = CodeReward(sandbox="bwrap", timeout_s=4, per_test_s=2)
        add = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"], "setup": ""}
        storm = "import os\\nn = 0\\nfor _ in range(50):\\n    try:\\n        pid = os.fork()\\n    except OSError:\\n"
        storm += "        break\\n    if pid == 0:\\n        import time; time.sleep(5); os._exit(0)\\n    n += 1\\n"
        storm += "def add(a, b):\\n    return a + b if n >= 50 else 0"
        print(fn("```python\\ndef add(a, b):\\n    return a + b\\n```", add),
              fn("```python\\n" + storm + "\\n```", add))
    """)
    r = subprocess.run([system_python, "-c", script], cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                       user=65534, group=65534, extra_groups=[], capture_output=True, text=True, timeout=60)
    if "SandboxUnavailable" in r.stderr:
        pytest.skip("unprivileged user namespaces are off here: " + r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1.0", "0.0"]


def test_no_sandbox_refuses_at_construction(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither bwrap nor unshare can be found
    sandbox.backend.cache_clear()
    sandbox.check_available.cache_clear()
    try:
        with pytest.raises(sandbox.SandboxUnavailable, match="install bubblewrap"):
            CodeReward()
        with pytest.raises(sandbox.SandboxUnavailable, match="user namespaces"):
            get_reward_fn("code", sandbox="bwrap")
    finally:
        sandbox.backend.cache_clear()
        sandbox.check_available.cache_clear()


# --------------------------------------------------------------------------- allow-listed packages, seccomp filter
def _sandboxed(kind: str, program: str, **limits) -> list[str]:
    r = sandbox.run_python(textwrap.dedent(program), b"", deadline_s=60, cpu_s=60, kind=kind, **limits)
    assert not r.timed_out and not r.truncated, r
    return r.stdout.decode().splitlines()


@pytest.mark.parametrize("kind", BACKENDS)
def test_allow_listed_packages_import_read_only_and_nothing_else_does(kind):
    venv_site = sysconfig.get_path("purelib")  # this test's environment: torch, vllm, requests, ... are there
    hidden = sandbox._hidden_dirs()
    assert any(d.startswith(os.path.realpath(sys.base_prefix)) for d in hidden)  # the interpreter's own site-packages
    out = _sandboxed(kind, f"""
        import os, sys
        import sympy, numpy
        x = sympy.Symbol("x")
        print(sympy.solve(x**2 - 4, x), int(numpy.arange(5).sum()), numpy.linalg.det(numpy.eye(3)))
        sys.path += {[venv_site, *hidden]!r}  # by path, too
        for name in ("torch", "vllm", "justrl_megatron", "requests", "IPython"):
            try:
                __import__(name)
                print("imported", name)
            except ImportError:
                pass
        print(os.path.exists({venv_site!r}), [os.listdir(d) for d in {hidden!r}])
        try:
            open(sympy.__file__, "a")
        except OSError:
            print("read-only", bool(os.statvfs(os.path.dirname(sympy.__file__)).f_flag & os.ST_RDONLY))
        print(sorted(os.listdir({sandbox.SITE!r})))
    """, packages=("sympy", "numpy"))
    mounted = sorted(dst.rsplit("/", 1)[1] for _, dst in sandbox.package_binds(("sympy", "numpy")))
    assert {"sympy", "mpmath", "numpy", "numpy.libs"} <= set(mounted)  # mpmath: sympy's requirement
    assert out == ["[-2, 2] 10 1.0", f"False {[[] for _ in hidden]}", "read-only True", str(mounted)]
    # without the allow-list: the standard library alone
    assert _sandboxed(kind, "try:\n    import sympy\nexcept ImportError as e:\n    print(type(e).__name__)") == \
        ["ModuleNotFoundError"]
    with pytest.raises(sandbox.PackageMissing, match="not_a_package_here is not installed"):
        sandbox.run_python("", b"", deadline_s=5, kind=kind, packages=("sympy", "not_a_package_here"))


@pytest.mark.skipif(platform.machine() not in sandbox._ARCH, reason="no seccomp filter for this architecture")
@pytest.mark.parametrize("kind", BACKENDS)
def test_no_user_namespace_and_no_vsock_socket(kind):
    """A new user namespace (unshare, clone, the util-linux tool) and an AF_VSOCK socket (a VM's channel to its
    host) are refused; fork, threads and subprocesses, which the same system calls carry, still work."""
    nr = sandbox._ARCH[platform.machine()][1]
    out = _sandboxed(kind, f"""
        import ctypes, errno, os, socket, subprocess, threading
        libc = ctypes.CDLL(None, use_errno=True)
        def said(rc):
            return "ok" if rc >= 0 else errno.errorcode[ctypes.get_errno()]
        print("unshare", said(libc.unshare(0x10000000)))
        pid = libc.syscall({nr["clone"]}, ctypes.c_ulong(0x10000000 | 17), 0, 0, 0, 0)  # CLONE_NEWUSER | SIGCHLD
        if pid == 0:
            os._exit(0)
        print("clone", said(pid))
        print("clone3", said(libc.syscall({nr["clone3"]}, 0, 0)))
        print("tool", subprocess.run(["unshare", "--user", "true"], capture_output=True).returncode)
        try:
            socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        except OSError as e:
            print("vsock", errno.errorcode[e.errno])
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        t = threading.Thread(target=print, args=("thread ok",))
        t.start(); t.join()
        print("fork", os.waitpid(pid, 0)[1] >> 8, subprocess.run(["true"]).returncode)
    """)
    assert out == ["unshare EPERM", "clone EPERM", "clone3 ENOSYS", "tool 1", "vsock EAFNOSUPPORT", "thread ok",
                   "fork 7 0"]


def _run_bpf(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """What the kernel would do with a seccomp filter for one system call (the instructions the filter uses)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    code = [struct.unpack("<HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
        elif op == 0x06:
            return k
        else:
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[op]
            pc += jt if hit else jf
        pc += 1


@pytest.mark.parametrize("machine", sorted(sandbox._ARCH))
def test_seccomp_filter_decisions_on_every_architecture(machine):
    """The filter of each architecture it knows, run instruction by instruction (only the running one reaches a
    kernel here): what it refuses, with which errno, and that it lets everything else through."""
    audit, nr, x32 = sandbox._ARCH[machine]
    prog = sandbox._seccomp_filter(machine)
    allow, eperm = 0x7FFF0000, 0x50000 | 1
    assert _run_bpf(prog, nr["socket"], audit, 40) == 0x50000 | 97  # AF_VSOCK: EAFNOSUPPORT
    assert _run_bpf(prog, nr["socket"], audit, 2) == allow  # AF_INET (and the namespace has no route anywhere)
    for call in ("unshare", "clone"):
        assert _run_bpf(prog, nr[call], audit, 0x10000000 | 17) == eperm
        assert _run_bpf(prog, nr[call], audit, 0x01200011) == allow  # fork's flags
    assert _run_bpf(prog, nr["clone3"], audit) == 0x50000 | 38  # ENOSYS: libc falls back to clone
    assert _run_bpf(prog, 0, audit) == allow and _run_bpf(prog, 59, audit, 0x10000000) == allow
    assert _run_bpf(prog, nr["socket"], 0x40000003, 40) == eperm  # another ABI (i386)
    if x32:
        assert _run_bpf(prog, 0x40000000 | nr["socket"], audit, 40) == eperm
    assert sandbox._seccomp_filter("sparc") == b""


# --------------------------------------------------------------------------------------- other verifiers' bounds
def test_gsm8k_megabyte_response_is_fast():
    tails = ["<answer>1 " * 100_000, "#### " * 200_000, "1," * 500_000, "\\boxed{" * 100_000]
    for clip in (None, 2000):
        fn = get_reward_fn("gsm8k", clip_chars=clip)
        with BatchScorer(fn) as scorer:
            assert scorer.in_process
            t0 = time.monotonic()
            rewards = scorer.score([t + "\n#### 42" for t in tails] + tails, ["42"] * 8)
            assert time.monotonic() - t0 < 2.0
        assert rewards[:4] == [1.0] * 4


def test_math_verify_own_timeout_is_counted():
    # A tower of powers: sympy tries to evaluate it and math-verify's own 1 s alarm fires first.
    fn = get_reward_fn("math_verify", timeout_s=1, clip_chars=None)
    tower = "The answer is $\\boxed{9^{9^{9^{9^{9}}}}}$"
    with BatchScorer(fn, num_workers=1, timeout_s=30) as scorer:
        rewards = scorer.score([tower, "so \\boxed{2}"], ["3", "2"])
        assert rewards == [0.0, 1.0]
        assert scorer.stats["timeouts"] == 1 and scorer.stats["crashes"] == 0 and scorer.stats["restarts"] == 0


class _Fifty(Verifier):
    in_process = True

    def grade(self, response, answer):
        return 50.0  # a buggy verifier: far outside [0, 1]


def test_rewards_clamped_to_the_declared_range():
    with BatchScorer(_Fifty(correct=1, wrong=-1)) as scorer:
        assert scorer.score(["x", "y"], [1, 2]) == [1.0, 1.0]
        assert scorer.stats["clamped"] == 2
    weighted = get_reward_fn("weighted", correctness="gsm8k")
    assert weighted.reward_range == pytest.approx((0.0, 1.5))
