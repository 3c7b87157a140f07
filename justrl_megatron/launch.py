"""justrl-train --nproc-per-node=N: the ranks of one machine under one launcher that keeps the run's promises.

torchrun's agent breaks three of them: a refused launch still starts every rank (rank 1 may write into the live
run), a failing rank ends in a ChildFailedError traceback, and a signal to the launcher ends in a SignalException
traceback after waiting up to 30 s for the ranks to stop. This launcher, in order:

1. takes the run dir's lock for the whole launch (run_lock.py) before any rank exists; a busy run dir is one line,
   exit 2, nothing started, nothing written. The locked descriptor is inherited by every rank (rank 0 holds the lock
   through it), so the lock lives until the last process of the launch has exited;
2. starts N ranks (`python -m justrl_megatron.cli train OVERRIDES`, torchrun's environment: RANK, LOCAL_RANK,
   WORLD_SIZE, MASTER_ADDR/PORT; MASTER_PORT held from the moment it is chosen: rank 0 serves the job's store on the
   listening socket it inherits, ports.py) in its own process group; each rank dies with it
   (lifeline.watch_launcher), so a SIGKILLed launcher leaves nothing behind;
3. forwards SIGTERM, SIGUSR1 and SIGINT to every rank (they finish the step, save and exit 0; the ranks count the
   terminal's and the launcher's copy of one Ctrl-C as one press) and waits as long as they take;
4. when a rank fails, SIGKILLs the others at once (they cannot finish a step without it) and exits with that rank's
   code, in one line (nothing more when the rank already said why: a refused config exits 2, an abort 130); a
   refused config leaves nothing: a run dir the launch created holds only the lock file, and goes.

Several nodes (launch/slurm/train.sbatch: one launcher per node under srun, `--nnodes --node-rank --master-addr
--master-port`): `launch_node`, the same promises over the nodes (no lock of its own: rank 0 takes the run dir's, as
under torchrun). The node launchers keep a connection to node 0's: a rank that fails ends every rank of every node at
once (SIGKILL, never a SIGTERM that a rank would take for Slurm's stop request) and node 0 prints the one line that
names it, its node and its signal; a launcher that vanishes (a lost node) ends the others too.
"""

from __future__ import annotations

import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import time

from .early_interrupt import STOP_SIGNALS
from .lifeline import SAID_AND_FAILED
from .ports import STORE_FD_ENV, held_port

FORWARDED = (*STOP_SIGNALS, signal.SIGINT)
# a rank that exits with these has printed the run's line (refused config / run dir, abort, a failure named by rank 0)
OWN_CODES = (2, 130, SAID_AND_FAILED)
GRACEFUL = (2, 130)  # ... and every rank ends so by itself: the others get GRACE_S to do it (rank 0 to say why)
GRACE_S = 20.0
# what each rank runs instead of the trainer: a program with the same stop contract that meets the other ranks through
# ports.job_store (rank 0 serves the job's store on the port the launcher held for it)
ENTRY_ENV = "JUSTRL_ENTRY"


def split_nproc(args: list[str]) -> tuple[int | None, list[str]]:
    """(N of --nproc-per-node N / --nproc-per-node=N, or None; the other arguments)."""
    nproc, rest, i = None, [], 0
    while i < len(args):
        arg = args[i]
        if arg in ("--nproc-per-node", "--nproc_per_node") and i + 1 < len(args):
            nproc, i = args[i + 1], i + 2
            continue
        if arg.startswith(("--nproc-per-node=", "--nproc_per_node=")):
            nproc = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if nproc is None:
        return None, rest
    if not nproc.isdigit() or int(nproc) < 1:
        _exit(2, f"--nproc-per-node={nproc}: give a whole number of processes, 1 or more")
    return int(nproc), rest


def _exit(code: int, line: str | None = None):
    if line:
        print(f"justrl-train: {line}", file=sys.stderr, flush=True)
    sys.exit(code)


def _lock_for_the_launch(overrides: list[str]) -> tuple[int | None, str | None, object]:
    """Take the run dir's lock (exit 2 in one line when busy): (the inheritable locked descriptor, the run dir, the
    outermost folder the lock created), or Nones when the command line does not compose (the ranks say why, exit 2)."""
    from . import run_lock
    from .train_entry import _run_dir_of, created_by_launch, run_dir_problem

    run_dir = _run_dir_of(overrides)
    if run_dir is None:  # the overrides do not compose (the ranks say why), or another entry's (JUSTRL_ENTRY)
        given = [a.split("=", 1)[1] for a in overrides if a.startswith("trainer.run_dir=")]
        if not given:
            return None, None, None
        run_dir = given[-1]
    problem = run_dir_problem(run_dir)
    if problem is not None:
        _exit(2, f"invalid config: {problem}")
    created = created_by_launch(run_dir)
    try:
        run_lock.hold(run_dir)
    except run_lock.RunDirBusy as exc:
        _exit(2, f"error: {exc}")
    except OSError as exc:
        _exit(2, f"trainer.run_dir={run_dir}: cannot write there ({exc.strerror or exc})")
    # a copy outside run_lock's table: its at-fork hook closes the table's descriptors in a child (which is right for
    # every other child, and runs in Popen's when it has a preexec_fn)
    fd = os.dup(run_lock._held[run_lock._key(run_dir)])
    os.set_inheritable(fd, True)
    return fd, run_dir, created


def _signal_running(ranks: dict, signum: int) -> None:
    """Pass a stop signal on to every rank still running (the launcher's own handler: ranks decide what it means)."""
    for proc in ranks.values():
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass


def _entry() -> list[str]:
    """What each rank runs after `python`: the trainer, or JUSTRL_ENTRY."""
    return shlex.split(os.environ.get(ENTRY_ENV, "")) or ["-m", "justrl_megatron.cli", "train"]


def _inherited_env() -> dict:
    """A rank's environment from this launcher's: without a trainer's own marks (lifeline.TRAINER_ENV, an earlier
    launch's TORCHELASTIC_RUN_ID), with the launcher's pid (the rank dies with it: lifeline.watch_launcher)."""
    from . import lifeline

    env = {k: v for k, v in os.environ.items() if k not in (lifeline.TRAINER_ENV, "TORCHELASTIC_RUN_ID")}
    env[lifeline.LAUNCHER_ENV] = str(os.getpid())
    return env


def _rank_env(rank: int, world: int, port: int, lock_fd: int | None) -> dict:
    env = _inherited_env()
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if lock_fd is not None:
        from .run_lock import LOCK_FD_ENV

        env[LOCK_FD_ENV] = str(lock_fd)
    return env


def _store_handover(rank: int, store: socket.socket | None) -> tuple[dict, tuple[int, ...]]:
    """(environment, descriptors) by which global rank 0 inherits the held MASTER_PORT socket to serve the job's
    store on (ports.job_store); nothing for the other ranks, or where this launcher holds no socket."""
    if rank != 0 or store is None:
        return {}, ()
    return {STORE_FD_ENV: str(store.fileno())}, (store.fileno(),)


def _kill_all(ranks: dict) -> None:
    for proc in ranks.values():
        if proc.returncode is None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _ignore_usr1() -> None:
    # (in the child, before exec: an ignored signal stays ignored) a rank still importing ignores Slurm's SIGUSR1
    # (the sbatch repeats it) rather than dying of it; its StopSignal handler replaces this
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def launch(nproc: int, overrides: list[str]) -> int:
    """Run `nproc` ranks of the trainer (or JUSTRL_ENTRY) on this machine; the launch's exit code."""
    lock_fd, run_dir, created = _lock_for_the_launch(overrides)
    print(f"justrl-train: {nproc} process(es) on this machine", file=sys.stderr, flush=True)
    entry = _entry()
    store = held_port()  # MASTER_PORT, listening until rank 0 serves the job's store on it (ports.py)
    port = store.getsockname()[1]
    ranks: dict[int, subprocess.Popen] = {}
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        _signal_running(ranks, signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    for rank in range(nproc):
        handed_env, handed_fds = _store_handover(rank, store)
        ranks[rank] = subprocess.Popen([sys.executable, *entry, *overrides],
                                       env={**_rank_env(rank, nproc, port, lock_fd), **handed_env},
                                       pass_fds=(*(() if lock_fd is None else (lock_fd,)), *handed_fds),
                                       preexec_fn=_ignore_usr1)
    store.close()  # rank 0's copy holds the port
    failed: tuple[int, int] | None = None  # (rank, returncode) of the first rank that failed
    kill_at = None  # when the ranks still running are SIGKILLed
    pids = {proc.pid: rank for rank, proc in ranks.items()}
    while any(proc.returncode is None for proc in ranks.values()):
        if kill_at is not None and time.monotonic() >= kill_at:
            _kill_all(ranks)
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.05)
            continue
        if pid not in pids:
            continue
        rank = pids[pid]
        ranks[rank].returncode = code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed = (rank, code)
            # without this rank the others cannot finish a step: at once, unless it ended the way every rank will
            # (a refused config, Ctrl-C), so that rank 0 gets to say why
            kill_at = time.monotonic() + (GRACE_S if code in GRACEFUL else 0.0)
    if failed is None:
        return 0
    rank, code = failed
    if code == 2 and created is not None:  # a refused config (the ranks said why)
        from .train_entry import remove_unused

        remove_unused(run_dir, created)
    line = failure_line(rank, code, nproc, received)
    if line is None:
        return _exit_code(code, received)
    _exit(_exit_code(code, received), line)


# --- several nodes (launch/slurm/train.sbatch: one of these per node, under srun) ------------------------------------

NODE_FLAGS = ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--run-id")
VERDICT_WAIT_S = 5.0  # how long a node whose rank failed waits for node 0's verdict before it speaks for itself
CONNECT_S = 300.0  # how long a node keeps trying to reach node 0's launcher


def split_node_flags(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """({flag: value} of NODE_FLAGS given as --flag=value or --flag value; the other arguments)."""
    flags, rest, i = {}, [], 0
    while i < len(args):
        name, _, value = args[i].partition("=")
        if name in NODE_FLAGS and not value and i + 1 < len(args):
            flags[name], i = args[i + 1], i + 2
            continue
        if name in NODE_FLAGS and value:
            flags[name] = value
        else:
            rest.append(args[i])
        i += 1
    return flags, rest


def failure_line(rank: int, code: int, world: int, received: list[int], node: str | None = None) -> str | None:
    """The one line that names a failed rank (None when the rank said why itself: OWN_CODES)."""
    if code in OWN_CODES:
        return None
    where = f" on node {node}" if node else ""
    others = f"; the other {world - 1} rank(s) were stopped" if world > 1 else ""
    if code < 0 and -code in received:  # it had no handler yet: the trainer's own takes over as the loop starts
        return f"stopped by {signal.Signals(-code).name} before training started; nothing to save"
    if code < 0:
        name = signal.Signals(-code).name
        why = " (the out-of-memory killer?)" if -code == signal.SIGKILL and not received else ""
        return f"error: rank {rank}{where} was killed by {name}{why}{others}"
    return f"error: rank {rank}{where} exited with code {code} (its output above says why){others}"


def _exit_code(code: int, received=()) -> int:
    """The launch's exit code for a rank's: a stop (SIGTERM, SIGUSR1) before training started exits 0, as a stop
    during training does (the ranks had nothing to save); a Ctrl-C 130; a failure rank 0 named 1."""
    if code < 0 and -code in received and -code in STOP_SIGNALS:
        return 0
    if code == SAID_AND_FAILED:
        return 1
    return 128 - code if code < 0 else code


class _Link:
    """Line messages between the node launchers: node 0 listens (hub), every other node connects to it.

    node -> node 0: `hello NODE HOST`, `fail CODE LINE` (a rank of that node failed; LINE is what to print, `-` for
    nothing), `done` (its ranks all exited 0). node 0 -> every node: `stop CODE` (the verdict: kill your ranks and
    exit CODE without a word; node 0 prints the line)."""

    def __init__(self, node_rank: int, nnodes: int, addr: str, port: int):
        self.node_rank, self.nnodes, self.addr, self.port = node_rank, nnodes, addr, port
        self.server = self.conn = None
        self.peers: dict[object, dict] = {}  # node 0: socket -> {"node", "host", "done", "buf"}
        self.buf = b""
        self.done_nodes: set = set()  # node 0: the nodes that said done (or fail)
        self.connect_until = time.monotonic() + CONNECT_S
        self.next_try = 0.0
        if node_rank == 0:
            self.server = socket.create_server(("", port), reuse_port=False, backlog=max(nnodes, 8))
            self.server.setblocking(False)

    def sockets(self) -> list:
        if self.server is not None:
            return [self.server, *self.peers]
        return [self.conn] if self.conn is not None else []

    def try_connect(self) -> None:
        if self.server is not None or self.conn is not None or time.monotonic() < self.next_try:
            return
        self.next_try = time.monotonic() + 0.2
        try:
            conn = socket.create_connection((self.addr, self.port), timeout=0.5)
        except OSError:
            return
        conn.setblocking(True)
        conn.sendall(f"hello {self.node_rank} {_host()}\n".encode())
        self.conn = conn

    def send(self, text: str) -> None:
        targets = list(self.peers) if self.server is not None else [self.conn]
        for sock in targets:
            if sock is None:
                continue
            try:
                sock.sendall((text + "\n").encode())
            except OSError:
                pass

    def read(self, sock) -> list[str] | None:
        """Complete lines from `sock` (None at EOF)."""
        if sock is self.server:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return []
            conn.setblocking(True)
            self.peers[conn] = {"node": None, "host": "?", "done": False, "buf": b""}
            return []
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            return None
        state = self.peers[sock] if self.server is not None else None
        buf = (state["buf"] if state else self.buf) + data
        *lines, rest = buf.split(b"\n")
        if state:
            state["buf"] = rest
        else:
            self.buf = rest
        return [line.decode(errors="replace") for line in lines]


def _host() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def launch_node(nproc: int, overrides: list[str], nnodes: int, node_rank: int, master_addr: str, master_port: int,
                run_id: str | None = None) -> int:
    """One node's share of a several-node launch: ranks node_rank*nproc ... (node_rank+1)*nproc-1 of nnodes*nproc,
    rendezvous at master_addr:master_port (rank 0's store); the node launchers talk over master_port+1.

    A rank that fails ends every rank of every node within a second: its launcher SIGKILLs its other ranks and tells
    node 0's launcher, which tells every node to SIGKILL theirs, and prints the one line that names the rank, its node
    and its signal or exit code. No rank ever takes a peer's death for a stop request (no SIGTERM goes round: a
    SIGTERM is always Slurm's or the user's, and means "finish the step, save, exit")."""
    if node_rank == 0:
        print(f"justrl-train: {nnodes} node(s) x {nproc} process(es)", file=sys.stderr, flush=True)
    entry = _entry()
    node = _Node(nproc, nnodes, node_rank, master_addr, _link_the_nodes(node_rank, nnodes, master_addr, master_port))
    store = _hold_the_rendezvous_port(master_port) if node_rank == 0 else None
    for sig in FORWARDED:
        signal.signal(sig, node.forward)
    node.start_ranks(entry, overrides, master_port, run_id, store)
    while not node.over():
        ready = node.wait()
        node.reap()
        for sock in ready:
            node.hear(sock)
    return node.exit_code()


def _hold_the_rendezvous_port(master_port: int) -> socket.socket:
    """Node 0: MASTER_PORT, listening until rank 0 serves the job's store on it (ports.py); one line and exit 1,
    before any rank starts, when it is taken."""
    try:
        return held_port(master_port)
    except OSError as exc:
        _exit(1, f"error: node 0 cannot listen on MASTER_PORT {master_port} for the ranks' rendezvous "
                 f"({exc.strerror or exc}); nothing was started: pick another MASTER_PORT")


def _link_the_nodes(node_rank: int, nnodes: int, master_addr: str, master_port: int) -> _Link:
    """This node launcher's end of the link between them (node 0 listens on master_port+1); one line and exit 1,
    before any rank starts, when node 0 cannot listen."""
    try:
        return _Link(node_rank, nnodes, master_addr, master_port + 1)
    except OSError as exc:
        _exit(1, f"error: node 0 cannot listen on port {master_port + 1} for the other nodes' launchers "
                 f"({exc.strerror or exc}); nothing was started: pick another MASTER_PORT")


def _node_rank_env(rank: int, local: int, nproc: int, nnodes: int, node_rank: int, master_addr: str,
                   master_port: int, run_id: str | None) -> dict:
    """The environment of one rank of a several-node launch (torchrun's names)."""
    env = dict(_inherited_env(), RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(nnodes * nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(node_rank), NODE_RANK=str(node_rank),
               MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    if run_id:
        env["TORCHELASTIC_RUN_ID"] = run_id  # the launch's id (run_lock.launch_id): one per job and restart
    return env


class _Node:
    """One node launcher while its ranks run: its ranks, what it heard (signals, the other launchers), and the verdict
    (the code every node exits with, once decided: node 0 decides, the others hear it)."""

    def __init__(self, nproc: int, nnodes: int, node_rank: int, master_addr: str, link: _Link):
        self.nproc, self.nnodes, self.node_rank, self.master_addr = nproc, nnodes, node_rank, master_addr
        self.link = link
        self.world = nnodes * nproc
        self.host = _host()
        self.ranks: dict[int, subprocess.Popen] = {}
        self.pids: dict[int, int] = {}  # pid -> rank
        self.pidfds: dict[int, subprocess.Popen] = {}  # (where the kernel has them) a readable fd per running rank
        self.received: list[int] = []  # the stop signals this launcher got
        self.verdict: int | None = None
        self.verdict_at = 0.0
        self.failed: tuple[int, int] | None = None  # (rank, code) of this node's first failed rank
        self.kill_at: float | None = None  # when the ranks still running are SIGKILLed
        self.asked_at: float | None = None  # another node: when it told node 0 of its failure
        self.said_done = False

    # --- signals and ranks ----------------------------------------------------------------------------------------
    def forward(self, signum, frame) -> None:
        """The launcher's handler of FORWARDED: a stop signal goes on to every running rank, unless judged already."""
        self.received.append(signum)
        if self.verdict is None:
            _signal_running(self.ranks, signum)

    def start_ranks(self, entry: list[str], overrides: list[str], master_port: int, run_id: str | None,
                    store: socket.socket | None) -> None:
        """`store`: node 0's listening MASTER_PORT socket, for rank 0 (closed here once rank 0 has its copy)."""
        for local in range(self.nproc):
            rank = self.node_rank * self.nproc + local
            env = _node_rank_env(rank, local, self.nproc, self.nnodes, self.node_rank, self.master_addr, master_port,
                                 run_id)
            handed_env, handed_fds = _store_handover(rank, store)
            self.ranks[rank] = subprocess.Popen([sys.executable, *entry, *overrides], env={**env, **handed_env},
                                                pass_fds=handed_fds, preexec_fn=_ignore_usr1)
        if store is not None:
            store.close()
        self.pids = {proc.pid: rank for rank, proc in self.ranks.items()}
        for proc in self.ranks.values():
            try:
                self.pidfds[os.pidfd_open(proc.pid)] = proc
            except (AttributeError, OSError):  # no pidfd: the 50 ms poll of `wait`
                pass

    # --- the loop: over? wait, reap, hear -------------------------------------------------------------------------
    def over(self) -> bool:
        """SIGKILL the ranks when their time is up; once none runs, whether this launcher may leave now."""
        now = time.monotonic()
        if self.kill_at is not None and now >= self.kill_at:
            _kill_all(self.ranks)
        if any(proc.returncode is None for proc in self.ranks.values()):
            return False
        link = self.link
        # the other nodes leave after node 0 (once it has printed its line): srun's --kill-on-bad-exit, which the
        # first task to exit sets off, cannot cut node 0 short before it has
        if self.verdict is not None and (self.node_rank == 0 or link.conn is None
                                         or now >= self.verdict_at + VERDICT_WAIT_S):
            return True
        if self.failed is None and self.node_rank != 0:
            if link.conn is None and now < link.connect_until:
                link.try_connect()
            if link.conn is not None and not self.said_done:
                link.send("done")
                self.said_done = True
            if self.said_done or now >= link.connect_until:
                return True
        if self.failed is None and self.node_rank == 0:
            if len(link.done_nodes) >= self.nnodes - 1 or (now >= link.connect_until and not any(
                    not p["done"] for p in link.peers.values())):
                return True
        if self.failed is not None and self.node_rank != 0 and (link.conn is None
                                                                or now - self.asked_at >= VERDICT_WAIT_S):
            return True  # nobody to hear it: speak for this node
        return False

    def wait(self) -> list:
        """Until a rank exits or a launcher speaks (or a short while): the readable pidfds and sockets."""
        self.link.try_connect()
        timeout = 0.05 if not self.pidfds or self.kill_at is not None else 0.5
        try:
            ready, _, _ = select.select([*self.pidfds, *self.link.sockets()], [], [], timeout)
        except InterruptedError:
            ready = []
        return ready

    def reap(self) -> None:
        """Collect the ranks that exited; the first failure stops this node's other ranks and is judged."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid not in self.pids:
                continue
            rank = self.pids[pid]
            self.ranks[rank].returncode = code = os.waitstatus_to_exitcode(status)
            for fd, proc in list(self.pidfds.items()):
                if proc.pid == pid:
                    os.close(fd)
                    del self.pidfds[fd]
            if code != 0 and self.failed is None and self.verdict is None:
                self._rank_failed(rank, code)

    def _rank_failed(self, rank: int, code: int) -> None:
        self.failed = (rank, code)
        grace = code in GRACEFUL
        self.kill_at = time.monotonic() + (GRACE_S if grace else 0.0)
        if not grace:
            _kill_all(self.ranks)  # at once: they cannot finish a step without it
        line = failure_line(rank, code, self.world, self.received, self.host)
        if self.node_rank == 0:
            self._decide(code, line, grace)
        else:
            self.link.send(f"fail {code} {int(grace)} {line or '-'}")
            self.asked_at = time.monotonic()

    def _decide(self, code: int, line: str | None, grace: bool) -> None:
        """Node 0: the first failure anywhere is the verdict; every node stops its ranks."""
        self.verdict = code
        self.verdict_at = time.monotonic()
        if line:
            print(f"justrl-train: {line}", file=sys.stderr, flush=True)
        self.link.send(f"stop {code} {int(grace)}")
        self.kill_at = min(self.kill_at or float("inf"), time.monotonic() + (GRACE_S if grace else 0.0))

    def hear(self, sock) -> None:
        """What a readable socket says: node 0 hears the nodes, a node hears node 0 (a pidfd was reaped already)."""
        if isinstance(sock, int):  # a pidfd
            return
        lines = self.link.read(sock)
        if self.node_rank == 0 and sock is not self.link.server:
            self._hear_a_node(sock, lines)
        elif self.node_rank != 0:
            self._hear_node_0(lines)

    def _hear_a_node(self, sock, lines: list[str] | None) -> None:
        """Node 0: a node's hello, done or fail; its launcher gone without a word is a failure of its own."""
        state = self.link.peers[sock]
        if lines is None:
            self.link.peers.pop(sock)
            sock.close()
            if not state["done"] and self.verdict is None:  # that node's launcher is gone without a word
                self._decide(1, f"error: the launcher of node {state['node']} ({state['host']}) ended without a "
                                f"word (a lost node, or kill -9?); the other ranks were stopped", False)
            return
        for text in lines:
            kind, _, rest = text.partition(" ")
            if kind == "hello":
                node, _, state["host"] = rest.partition(" ")
                state["node"] = int(node)
            elif kind == "done":
                state["done"] = True
                self.link.done_nodes.add(state["node"])
            elif kind == "fail":
                code, grace, line = rest.split(" ", 2)
                state["done"] = True  # it exits once it has the verdict
                self.link.done_nodes.add(state["node"])
                if self.verdict is None:
                    self._decide(int(code), None if line == "-" else line, grace == "1")

    def _hear_node_0(self, lines: list[str] | None) -> None:
        """Another node: node 0's verdict; node 0's launcher gone without a word stops this node's ranks."""
        link = self.link
        if lines is None:
            link.conn.close()
            link.conn = None
            link.connect_until = 0.0  # no second connection
            if self.verdict is None and self.failed is None and any(
                    p.returncode is None for p in self.ranks.values()):
                print(f"justrl-train: error: the launcher of node 0 ({self.master_addr}) ended without a word (a "
                      f"lost node, or kill -9?); the {self.nproc} rank(s) of node {self.host} were stopped",
                      file=sys.stderr, flush=True)
                _kill_all(self.ranks)
                self.verdict = 1
            return  # (a failure of this node's own, not yet judged: it speaks for itself in exit_code)
        for text in lines:
            kind, _, rest = text.partition(" ")
            if kind == "stop" and self.verdict is None:
                code, grace = rest.split(" ")
                self.verdict = int(code)
                self.verdict_at = time.monotonic()
                self.kill_at = time.monotonic() + (GRACE_S if grace == "1" else 0.0)
                if grace != "1":
                    _kill_all(self.ranks)

    def exit_code(self) -> int:
        """The verdict's code; a node that heard none speaks for its own failed rank; 0 when every rank ended well."""
        if self.verdict is not None:
            return _exit_code(self.verdict, self.received)
        if self.failed is not None:  # another node that heard no verdict
            line = failure_line(self.failed[0], self.failed[1], self.world, self.received, self.host)
            if line:
                print(f"justrl-train: {line}", file=sys.stderr, flush=True)
            return _exit_code(self.failed[1], self.received)
        return 0


def main(nproc: int, overrides: list[str]) -> None:
    try:
        code = launch(nproc, overrides)
    except KeyboardInterrupt:  # Ctrl-C before the ranks exist (the lock's composition)
        _exit(130, "interrupted before training started; nothing was saved")
    sys.exit(code)


if __name__ == "__main__":  # python -m justrl_megatron.launch --nproc-per-node=N [--nnodes=M ...] [overrides]
    n, rest = split_nproc(sys.argv[1:])
    flags, rest = split_node_flags(rest)
    if "--nnodes" not in flags:
        main(n or 1, rest)
    missing = [f for f in NODE_FLAGS[:4] if f not in flags]
    if missing:
        _exit(2, f"--nnodes needs {', '.join(missing)} too")
    sys.exit(launch_node(n or 1, rest, int(flags["--nnodes"]), int(flags["--node-rank"]), flags["--master-addr"],
                         int(flags["--master-port"]), flags.get("--run-id")))
