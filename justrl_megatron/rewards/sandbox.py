"""An OS sandbox for untrusted Python: Linux namespaces through bubblewrap (``bwrap``), else util-linux ``unshare``.

``run_python(program, stdin, ...)`` runs ``python -I -S -c program`` (this interpreter, no site-packages) with:

* new PID, network, mount, IPC and UTS namespaces (+ a user namespace when not root, which unprivileged bwrap needs);
* a filesystem of its own: /usr and the Python runtime read-only, a fresh /proc and a minimal /dev, and a private,
  size-limited tmpfs at /tmp (the working directory) as the only writable place — nothing else of the host exists;
* no network: the new namespace has only loopback, where nothing listens;
* no privileges: as root the program drops to a random unprivileged uid before anything else (the kernel exempts
  uid 0 from RLIMIT_NPROC), no capabilities, no_new_privs, nosuid mounts;
* RLIMIT_NPROC / AS / CPU / FSIZE / CORE set before the program's first line;
* a wall-clock deadline after which the whole PID namespace is killed: killing bwrap (or unshare) kills the
  namespace's init (``--die-with-parent`` / ``--kill-child``), and the kernel then kills every process in it — a
  ``setsid`` or double-forked child cannot outlive it. The same happens when the caller itself dies (a pool worker
  killed at its timeout).

Only stdout comes back (capped); stdin carries the input. ``check_available()`` says why no sandbox can be built.
"""
from __future__ import annotations

import functools
import json
import os
import secrets
import select
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from ..lifeline import stop_signals_blocked

HOW_TO = ("install bubblewrap (`apt-get install -y bubblewrap`, or tools/setup_env.sh as root), or allow "
          "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0); "
          "in a container, also allow namespaces (docker run --cap-add SYS_ADMIN --security-opt seccomp=unconfined "
          "--security-opt apparmor=unconfined)")

TEARDOWN_S = 2.0  # after the deadline: killing the namespace and reaping its launcher

# First lines of every sandboxed program: leave root, then limit this process and everything it starts.
_PRELUDE = """\
import os as _os, resource as _r
if _os.getuid() == 0 and {uid}:
    _os.setgroups([]); _os.setgid({uid}); _os.setuid({uid})
for _k, _v in ((_r.RLIMIT_NPROC, {nproc}), (_r.RLIMIT_AS, {memory}), (_r.RLIMIT_CPU, {cpu}),
               (_r.RLIMIT_FSIZE, {fsize}), (_r.RLIMIT_CORE, 0), (_r.RLIMIT_NOFILE, 64)):
    _r.setrlimit(_k, (_v, _v))
del _os, _r, _k, _v
"""

# The unshare backend builds the root that bwrap builds itself: tmpfs root, read-only binds, then pivot_root.
_UNSHARE_SETUP = r"""set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
R=/tmp
mount -t tmpfs -o mode=755,nosuid,nodev root "$R"
for d in /usr "$1"; do mkdir -p "$R$d"; mount --rbind "$d" "$R$d"; mount -o remount,bind,ro,nosuid,nodev "$R$d"; done
for l in bin lib lib64 sbin; do [ -L "/$l" ] && ln -s "$(readlink "/$l")" "$R/$l"; done
mkdir -p "$R/tmp" "$R/proc" "$R/dev" "$R/.old"
mount -t tmpfs -o "size=$2,mode=1777,nosuid,nodev" tmp "$R/tmp"
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
for f in null zero urandom random; do touch "$R/dev/$f"; mount --bind "/dev/$f" "$R/dev/$f"; done
cd "$R"; pivot_root . .old; umount -l /.old; rmdir /.old; cd /tmp
shift 2
export PATH=/usr/bin:/bin
exec setpriv --no-new-privs "$@"
"""


class SandboxUnavailable(RuntimeError):
    pass


@dataclass
class Result:
    stdout: bytes
    timed_out: bool  # the deadline passed: the namespace was killed
    truncated: bool  # stdout passed max_output: the namespace was killed
    returncode: int | None


def _python() -> tuple[str, str]:
    """(the interpreter's real path, its runtime prefix): what the sandbox must see read-only."""
    exe = os.path.realpath(sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


def _run_as() -> int:
    # Random per sandbox: RLIMIT_NPROC counts per uid, so concurrent sandboxes do not share a budget.
    return 200_000 + secrets.randbelow(1_000_000) if os.geteuid() == 0 else 0


def _ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[:k]) for k in range(1, len(parts) + 1)]


def _bwrap_argv(tmpfs_bytes: int) -> list[str]:
    exe, prefix = _python()
    argv = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session"]
    if os.geteuid() == 0:  # privileged: no user namespace (root in it would keep uid 0); the prelude drops root
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for link in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(link):
            argv += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            argv += ["--ro-bind", link, link]
    for path in (prefix, exe):
        if path.startswith("/usr/") or (path == exe and exe.startswith(prefix + "/")):
            continue
        parents = _ancestors(path)  # traversable by the unprivileged uid (/root is 0700 on the host)
        argv += [a for p in parents for a in ("--perms", "0755", "--dir", p)] + ["--ro-bind", path, path]
    argv += ["--size", str(tmpfs_bytes), "--perms", "1777", "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev",
             "--chdir", "/tmp", "--clearenv"]
    return argv + ["--"]


def _unshare_argv(tmpfs_bytes: int) -> list[str]:
    _, prefix = _python()
    argv = ["unshare", "--pid", "--net", "--mount", "--ipc", "--uts", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        argv += ["--user", "--map-root-user"]
    return argv + ["--", "/bin/sh", "-c", _UNSHARE_SETUP, "sandbox", prefix, str(tmpfs_bytes)]


def _argv(backend: str, tmpfs_bytes: int) -> list[str]:
    return _bwrap_argv(tmpfs_bytes) if backend == "bwrap" else _unshare_argv(tmpfs_bytes)


def _probe(backend: str) -> str | None:
    """None when ``backend`` runs a sandboxed program here, else what went wrong."""
    if shutil.which(backend) is None:
        return f"{backend} not found"
    try:
        r = _launch(backend, "print('ok')", b"", deadline_s=30, tmpfs_mb=1, max_output=1024)
    except OSError as e:
        return str(e)
    return None if r.stdout == b"ok\n" else f"{backend} exited with {r.returncode}"


@functools.lru_cache(maxsize=None)
def backend() -> str:
    """The sandbox this machine supports ("bwrap", else "unshare"), probed once per process."""
    why = {}
    for name in ("bwrap", "unshare"):
        why[name] = _probe(name)
        if why[name] is None:
            return name
    raise SandboxUnavailable("no namespace sandbox for the code reward on this machine ("
                             + "; ".join(f"{k}: {v}" for k, v in why.items()) + "): " + HOW_TO)


BACKENDS = ("auto", "bwrap", "unshare")


@functools.lru_cache(maxsize=None)
def check_available(kind: str = "auto") -> str:
    """The backend ``kind`` resolves to here; SandboxUnavailable (saying how to get one) when it cannot run."""
    if kind == "auto":
        return backend()
    if kind not in BACKENDS:
        raise ValueError(f"unknown sandbox {kind!r}; choose one of {BACKENDS}")
    why = _probe(kind)
    if why is not None:
        raise SandboxUnavailable(f"the {kind} sandbox cannot run here ({why}): {HOW_TO}")
    return kind


def run_python(program: str, stdin: bytes, *, deadline_s: float, cpu_s: int = 10, memory_mb: int = 512,
               file_mb: int = 16, nproc: int = 16, max_output: int = 4 << 20, kind: str = "auto") -> Result:
    """Run ``program`` in the sandbox; returns within ``deadline_s`` + ``TEARDOWN_S``."""
    return _launch(check_available(kind), program, stdin, deadline_s=deadline_s, cpu_s=cpu_s, memory_mb=memory_mb,
                   file_mb=file_mb, nproc=nproc, max_output=max_output, tmpfs_mb=file_mb)


def _launch(backend: str, program: str, stdin: bytes, *, deadline_s: float, tmpfs_mb: int, max_output: int,
            cpu_s: int = 10, memory_mb: int = 512, file_mb: int = 16, nproc: int = 16) -> Result:
    exe, _ = _python()
    prelude = _PRELUDE.format(uid=_run_as(), nproc=nproc, memory=memory_mb << 20, cpu=cpu_s, fsize=file_mb << 20)
    argv = _argv(backend, tmpfs_mb << 20) + [exe, "-I", "-S", "-c", prelude + program]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
           "HOME": "/tmp", "TMPDIR": "/tmp"}
    if backend == "bwrap":  # --clearenv drops ours; give the program the same minimal set
        argv[argv.index("--") :argv.index("--")] = [a for k, v in env.items() for a in ("--setenv", k, v)]
    deadline = time.monotonic() + deadline_s
    info_r = info_w = None
    if backend == "bwrap":  # bwrap reports its namespace's init: waiting for that init is waiting for the namespace
        info_r, info_w = os.pipe()
        argv[1:1] = ["--info-fd", str(info_w)]
    try:
        with stop_signals_blocked():  # a stop signal to every process (Slurm, a group kill) is the rank's to act on
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    env=env, close_fds=True, pass_fds=() if info_w is None else (info_w,))
    finally:
        if info_w is not None:
            os.close(info_w)
    init = _init_pidfd(info_r, deadline) if info_r is not None else None
    out, timed_out, truncated = bytearray(), False, False
    try:
        timed_out, truncated = _pump(proc, stdin, out, deadline, max_output)
    finally:
        _kill_namespace(proc, init)
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
    return Result(bytes(out), timed_out, truncated, proc.returncode)


def _readable(fd: int, timeout_s: float) -> bool:
    """Wait up to timeout_s for fd to be readable. poll, not select: a process with many files open (a trainer, a
    test session) hands out fds above select()'s 1024 limit ("filedescriptor out of range in select()")."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout_s) * 1000))


def _init_pidfd(info_r: int, deadline: float) -> int | None:
    """A pidfd of the init bwrap reports on its info fd (None: it is gone already, or never reported)."""
    data = b""
    try:
        while time.monotonic() < deadline:
            if not _readable(info_r, deadline - time.monotonic()):
                break
            chunk = os.read(info_r, 4096)
            if not chunk:
                break
            data += chunk
            try:
                return os.pidfd_open(int(json.loads(data)["child-pid"]))
            except ValueError:  # not all of it yet
                continue
    except (OSError, KeyError, TypeError):
        return None
    finally:
        os.close(info_r)
    return None


def _kill_namespace(proc: subprocess.Popen, init: int | None):
    """Kill the namespace's init and wait until it has exited: the kernel completes an init's exit only once every
    other process of its namespace is gone, so when this returns nothing of the sandbox runs any more (killing the
    launcher alone would return while they are still dying). bwrap's launcher exits as soon as the program does, hence
    its init's pidfd; ``unshare --fork`` itself waits for its init, so waiting for it is enough."""
    if init is not None:
        try:
            signal.pidfd_send_signal(init, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _readable(init, TEARDOWN_S / 2)  # readable once the init has exited
        os.close(init)
    elif proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                inits = [int(pid) for pid in f.read().split()]
        except OSError:
            inits = []
        for pid in inits:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for _ in range(2):
        try:
            proc.wait(timeout=TEARDOWN_S / 2)
            return
        except subprocess.TimeoutExpired:  # the launcher takes its init along when killed (pdeathsig)
            proc.kill()


def _pump(proc, stdin: bytes, out: bytearray, deadline: float, max_output: int) -> tuple[bool, bool]:
    """Feed stdin and collect stdout until EOF, the deadline or the output cap; never blocks past the deadline."""
    sel = selectors.DefaultSelector()
    os.set_blocking(proc.stdout.fileno(), False)
    sel.register(proc.stdout, selectors.EVENT_READ)
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return True, False
            for key, _ in sel.select(timeout=left):
                if key.fileobj is proc.stdin:
                    try:
                        pending = pending[os.write(proc.stdin.fileno(), pending[:65536]):]
                    except (BrokenPipeError, BlockingIOError, OSError):
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(proc.stdout.fileno(), 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    return False, False
                out += chunk
                if len(out) > max_output:
                    del out[max_output:]
                    return False, True
    finally:
        sel.close()

