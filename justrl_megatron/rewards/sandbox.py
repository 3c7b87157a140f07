"""An OS sandbox for untrusted Python: Linux namespaces through bubblewrap (``bwrap``), else util-linux ``unshare``.

``run_python(program, stdin, ...)`` runs ``python -I -S -c program`` (this interpreter, no site-packages) with:

* new PID, network, mount, IPC and UTS namespaces (+ a user namespace when not root, which unprivileged bwrap needs);
* a filesystem of its own: /usr and the Python runtime read-only, a fresh /proc and a minimal /dev, and a private,
  size-limited tmpfs at /tmp (the working directory) as the only writable place — nothing else of the host exists;
  every installed-package folder inside those trees (the interpreter's own site-packages, the distribution's
  dist-packages) is covered by an empty one;
* ``packages``: an allow-list of import packages (e.g. sympy, numpy), bound read-only under ``SITE`` (on sys.path
  after the standard library) together with everything their distributions and the distributions they require
  install (mpmath for sympy, numpy.libs for numpy); nothing else of the environment is there;
* no network: the new namespace has only loopback, where nothing listens; no AF_VSOCK socket (a VM's channel to its
  host is not namespaced) and no new user namespace (the kernel's widest attack surface for an unprivileged
  process): a seccomp filter refuses both (x86_64 and aarch64; bwrap's --disable-userns too, where it makes a user
  namespace of its own);
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
import glob
import json
import os
import platform
import secrets
import select
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass

from ..lifeline import stop_signals_blocked

HOW_TO = ("install bubblewrap (`apt-get install -y bubblewrap`, or tools/setup_env.sh as root), or allow "
          "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0); "
          "in a container, also allow namespaces (docker run --cap-add SYS_ADMIN --security-opt seccomp=unconfined "
          "--security-opt apparmor=unconfined)")

TEARDOWN_S = 2.0  # after the deadline: killing the namespace and reaping its launcher
SITE = "/packages"  # the allow-listed packages' folder inside the sandbox
# BLAS / OpenMP pools (numpy's OpenBLAS) start a thread per core by default: each counts against RLIMIT_NPROC and
# reserves memory, so a many-core host would break the limits at `import numpy`
_ONE_THREAD = {k: "1" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                                "VECLIB_MAXIMUM_THREADS")}

# First lines of every sandboxed program: leave root, refuse what the seccomp filter refuses (prctl 38/22:
# PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP with a filter), then limit this process and everything it starts.
_PRELUDE = """\
import os as _os, resource as _r
if _os.getuid() == 0 and {uid}:
    _os.setgroups([]); _os.setgid({uid}); _os.setuid({uid})
_b = {bpf!r}
if _b:
    try:
        import ctypes as _c
        class _P(_c.Structure):
            _fields_ = [("n", _c.c_ushort), ("f", _c.c_char_p)]
        _l, _p, _z = _c.CDLL(None, use_errno=True), _P(len(_b) // 8, _b), _c.c_ulong(0)
        if _l.prctl(38, _c.c_ulong(1), _z, _z, _z) or _l.prctl(22, _c.c_ulong(2), _c.byref(_p), _z, _z):
            raise OSError(_c.get_errno(), _os.strerror(_c.get_errno()))
    except Exception as _e:  # no program runs without the filter; the probe reports this line
        _os.write(1, ("sandbox: no seccomp filter: " + repr(_e) + "\\n").encode())
        _os._exit(1)
    del _c, _P, _l, _p, _z
for _k, _v in ((_r.RLIMIT_NPROC, {nproc}), (_r.RLIMIT_AS, {memory}), (_r.RLIMIT_CPU, {cpu}),
               (_r.RLIMIT_FSIZE, {fsize}), (_r.RLIMIT_CORE, 0), (_r.RLIMIT_NOFILE, 64)):
    _r.setrlimit(_k, (_v, _v))
del _os, _r, _k, _v, _b
if {site!r}:
    import sys as _s
    _s.path.append({site!r})
    del _s
"""

# The seccomp filter, per architecture: (AUDIT_ARCH, syscall numbers, whether x32 numbers exist).
_ARCH = {"x86_64": (0xC000003E, {"socket": 41, "clone": 56, "unshare": 272, "clone3": 435}, True),
         "aarch64": (0xC00000B7, {"socket": 198, "clone": 220, "unshare": 97, "clone3": 435}, False)}
_AF_VSOCK, _CLONE_NEWUSER, _EPERM, _ENOSYS, _EAFNOSUPPORT = 40, 0x10000000, 1, 38, 97


def _seccomp_filter(machine: str | None = None) -> bytes:
    """A classic-BPF seccomp program (``struct sock_filter[]``) that refuses AF_VSOCK sockets and new user
    namespaces (unshare / clone with CLONE_NEWUSER; clone3, whose flags a filter cannot read, says ENOSYS and libc
    falls back to clone), and every call through another ABI (x32, i386 int 0x80). b"" on an architecture it does
    not know (the sandbox then runs without it: see the module's docstring)."""
    arch = _ARCH.get(machine or platform.machine())
    if arch is None:
        return b""
    audit, nr, x32 = arch
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, errno = 0x7FFF0000, lambda e: 0x00050000 | e
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, audit), (ret, 0, 0, errno(_EPERM)), (ld, 0, 0, 0)]
    if x32:
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, errno(_EPERM))]
    prog += [(jeq, 0, 1, nr["clone3"]), (ret, 0, 0, errno(_ENOSYS)),
             (jeq, 0, 4, nr["socket"]), (ld, 0, 0, 16), (jeq, 0, 1, _AF_VSOCK), (ret, 0, 0, errno(_EAFNOSUPPORT)),
             (ret, 0, 0, allow),
             (jeq, 1, 0, nr["unshare"]), (jeq, 0, 3, nr["clone"]), (ld, 0, 0, 16), (jset, 0, 1, _CLONE_NEWUSER),
             (ret, 0, 0, errno(_EPERM)), (ret, 0, 0, allow)]
    return b"".join(struct.pack("<HBBI", code, jt, jf, k) for code, jt, jf, k in prog)

# The unshare backend builds the root that bwrap builds itself: tmpfs root, read-only binds (the runtime, then each
# allow-listed package at its place under the site folder), empty read-only folders over the installed-package
# folders, then pivot_root. Arguments: prefix, tmpfs size, number of package binds, (source, target) pairs, number
# of hidden folders, the folders, the command.
_UNSHARE_SETUP = r"""set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
R=/tmp
mount -t tmpfs -o mode=755,nosuid,nodev root "$R"
for d in /usr "$1"; do mkdir -p "$R$d"; mount --rbind "$d" "$R$d"; mount -o remount,bind,ro,nosuid,nodev "$R$d"; done
for l in bin lib lib64 sbin; do [ -L "/$l" ] && ln -s "$(readlink "/$l")" "$R/$l"; done
size=$2; n=$3; shift 3
while [ "$n" -gt 0 ]; do
  if [ -d "$1" ]; then mkdir -p "$R$2"; else mkdir -p "$(dirname "$R$2")"; touch "$R$2"; fi
  mount --rbind "$1" "$R$2"; mount -o remount,bind,ro,nosuid,nodev "$R$2"; shift 2; n=$((n - 1))
done
n=$1; shift
while [ "$n" -gt 0 ]; do mount -t tmpfs -o ro,size=4k,mode=755,nosuid,nodev hidden "$R$1"; shift; n=$((n - 1)); done
mkdir -p "$R/tmp" "$R/proc" "$R/dev" "$R/.old"
mount -t tmpfs -o "size=$size,mode=1777,nosuid,nodev" tmp "$R/tmp"
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
for f in null zero urandom random; do touch "$R/dev/$f"; mount --bind "/dev/$f" "$R/dev/$f"; done
cd "$R"; pivot_root . .old; umount -l /.old; rmdir /.old; cd /tmp
export PATH=/usr/bin:/bin
exec setpriv --no-new-privs "$@"
"""


class SandboxUnavailable(RuntimeError):
    pass


class PackageMissing(ValueError):
    """An allow-listed package (or one it requires) is not installed here."""


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


def _hidden_dirs() -> list[str]:
    """The installed-package folders inside the trees the sandbox mounts (/usr, the Python runtime): the
    interpreter's own site-packages, the distribution's dist-packages. Each gets an empty read-only folder over it,
    so that code cannot put one on sys.path and import what is installed there."""
    exe, prefix = _python()
    found = {sysconfig.get_path(key, vars={"base": prefix, "platbase": prefix}) for key in ("purelib", "platlib")}
    found.update(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    for root in ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/local/lib64"):
        found.update(glob.glob(f"{root}/python3*/*-packages"))
    inside = ("/usr/", prefix + "/")
    return sorted({os.path.realpath(p) for p in found
                   if p and os.path.isdir(p) and os.path.realpath(p).startswith(inside)})


@functools.lru_cache(maxsize=None)
def _import_names() -> dict:
    """{import package: [its distributions]} of this environment (a scan of every installed distribution: once)."""
    from importlib import metadata

    return metadata.packages_distributions()


@functools.lru_cache(maxsize=None)
def package_distributions(packages: tuple[str, ...]) -> dict[str, str]:
    """{distribution name: what brought it (an import package of ``packages``, or the distribution that requires
    it)} for the distributions of the import packages ``packages`` and those they require (extras aside), in the
    order found. PackageMissing names one that is not installed here."""
    if not packages:
        return {}
    from importlib import metadata

    from packaging.requirements import Requirement

    by_import = _import_names()
    todo = []
    for name in packages:
        if not isinstance(name, str) or not name.isidentifier():
            raise PackageMissing(f"{name!r} is not an import name")
        if name not in by_import:
            raise PackageMissing(f"{name} is not installed in this environment ({sys.prefix})")
        todo += [(dist, name) for dist in by_import[name]]
    found = {}
    while todo:
        dist_name, wanted_by = todo.pop()
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            raise PackageMissing(f"{dist_name} (which {wanted_by} requires) is not installed in this environment "
                                 f"({sys.prefix})") from None
        if dist.metadata["Name"] in found:
            continue
        found[dist.metadata["Name"]] = wanted_by
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append((req.name, dist.metadata["Name"]))
    return found


@functools.lru_cache(maxsize=None)
def package_binds(packages: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(host path, path in the sandbox) of everything the distributions of the import packages ``packages``, and the
    distributions they require (extras aside), install into site-packages: the package folders, their top-level
    modules, bundled libraries (numpy.libs) and metadata, each at its place under SITE. PackageMissing names one
    that is not installed here."""
    from importlib import metadata

    binds = {}
    for dist_name in package_distributions(packages):
        dist = metadata.distribution(dist_name)
        if dist.files is None:
            raise PackageMissing(f"{dist_name} lists no files (no RECORD): which to mount cannot be told")
        for top in sorted({f.parts[0] for f in dist.files if f.parts and not f.is_absolute()} - {"..", "__pycache__"}):
            path = os.path.realpath(dist.locate_file(top))
            if os.path.exists(path):
                binds.setdefault(f"{SITE}/{top}", path)
    return tuple((src, dst) for dst, src in sorted(binds.items()))


def _bwrap_argv(tmpfs_bytes: int, packages: tuple[str, ...] = ()) -> list[str]:
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
    for hidden in _hidden_dirs():
        argv += ["--size", "4096", "--tmpfs", hidden, "--remount-ro", hidden]
    binds = package_binds(packages)
    if binds:  # bwrap makes missing folders 0700: the unprivileged uid must traverse SITE
        argv += ["--perms", "0755", "--dir", SITE]
    for src, dst in binds:
        argv += ["--ro-bind", src, dst]
    argv += ["--size", str(tmpfs_bytes), "--perms", "1777", "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev",
             "--chdir", "/tmp", "--clearenv"]
    return argv + ["--"]


def _unshare_argv(tmpfs_bytes: int, packages: tuple[str, ...] = ()) -> list[str]:
    _, prefix = _python()
    argv = ["unshare", "--pid", "--net", "--mount", "--ipc", "--uts", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        argv += ["--user", "--map-root-user"]
    binds, hidden = package_binds(packages), _hidden_dirs()
    return argv + ["--", "/bin/sh", "-c", _UNSHARE_SETUP, "sandbox", prefix, str(tmpfs_bytes),
                   str(len(binds)), *(p for pair in binds for p in pair), str(len(hidden)), *hidden]


def _argv(backend: str, tmpfs_bytes: int, packages: tuple[str, ...] = ()) -> list[str]:
    return (_bwrap_argv if backend == "bwrap" else _unshare_argv)(tmpfs_bytes, packages)


def _probe(backend: str) -> str | None:
    """None when ``backend`` runs a sandboxed program here, else what went wrong."""
    if shutil.which(backend) is None:
        return f"{backend} not found"
    try:
        r = _launch(backend, "print('ok')", b"", deadline_s=30, tmpfs_mb=1, max_output=1024)
    except OSError as e:
        return str(e)
    if r.stdout == b"ok\n":
        return None
    said = r.stdout.decode("utf-8", "replace").strip()[-200:]
    return f"{backend} exited with {r.returncode}" + (f": {said}" if said else "")


@functools.lru_cache(maxsize=None)
def backend() -> str:
    """The sandbox this machine supports ("bwrap", else "unshare"), probed once per process."""
    why = {}
    for name in ("bwrap", "unshare"):
        why[name] = _probe(name)
        if why[name] is None:
            return name
    raise SandboxUnavailable("no namespace sandbox runs on this machine ("
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


def unavailable(kind: str = "auto") -> str | None:
    """``check_available``'s verdict as a refusal line: why no sandbox of ``kind`` runs here and how to get one, or
    None when one does. Every user of the sandbox asks this one check before it starts (the code reward when it is
    built, which config validation does; rollout.tools in config validation)."""
    try:
        check_available(kind)
    except SandboxUnavailable as exc:
        return str(exc)
    return None


@functools.lru_cache(maxsize=None)
def package_problem(packages: tuple[str, ...], *, kind: str = "auto", memory_mb: int = 512, nproc: int = 16,
                    file_mb: int = 16) -> str | None:
    """None when the allow-listed ``packages`` import inside the sandbox under these limits, else why not (one
    line). Assumes the sandbox itself runs (``unavailable``)."""
    if not packages:
        return None
    try:
        package_binds(packages)
    except PackageMissing as exc:
        return str(exc)
    program = (f"try:\n    import {', '.join(packages)}\nexcept BaseException as e:\n"
               f"    print(type(e).__name__ + ': ' + str(e))\nelse:\n    print('ok')")
    r = run_python(program, b"", deadline_s=60, cpu_s=60, memory_mb=memory_mb, file_mb=file_mb, nproc=nproc,
                   max_output=4096, kind=kind, packages=packages)
    said = r.stdout.decode("utf-8", "replace").strip()
    if said == "ok":
        return None
    why = "did not finish in 60 s" if r.timed_out else said.splitlines()[-1][:300] if said else \
        f"exited with {r.returncode}"
    return f"import {', '.join(packages)} inside the sandbox (memory {memory_mb} MiB, {nproc} processes): {why}"


def run_python(program: str, stdin: bytes, *, deadline_s: float, cpu_s: int = 10, memory_mb: int = 512,
               file_mb: int = 16, nproc: int = 16, max_output: int = 4 << 20, kind: str = "auto",
               packages: tuple[str, ...] = ()) -> Result:
    """Run ``program`` in the sandbox, with the allow-listed import ``packages`` importable (read-only); returns
    within ``deadline_s`` + ``TEARDOWN_S``."""
    return _launch(check_available(kind), program, stdin, deadline_s=deadline_s, cpu_s=cpu_s, memory_mb=memory_mb,
                   file_mb=file_mb, nproc=nproc, max_output=max_output, tmpfs_mb=file_mb, packages=tuple(packages))


def _launch(backend: str, program: str, stdin: bytes, *, deadline_s: float, tmpfs_mb: int, max_output: int,
            cpu_s: int = 10, memory_mb: int = 512, file_mb: int = 16, nproc: int = 16,
            packages: tuple[str, ...] = ()) -> Result:
    exe, _ = _python()
    prelude = _PRELUDE.format(uid=_run_as(), bpf=_seccomp_filter(), nproc=nproc, memory=memory_mb << 20, cpu=cpu_s,
                              fsize=file_mb << 20, site=SITE if packages else "")
    argv = _argv(backend, tmpfs_mb << 20, packages) + [exe, "-I", "-S", "-c", prelude + program]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
           "HOME": "/tmp", "TMPDIR": "/tmp", **_ONE_THREAD}
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

