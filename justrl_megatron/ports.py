"""TCP ports on this machine, for a rendezvous or a store (without importing torch: the launcher needs one before any
rank exists, and importing the training stack would cost it seconds).

`free_port` names a port that was free a moment ago: whoever binds it later may find it taken (another process on a
shared node took it in between). Where the port is announced to other processes before it is used, hold it instead:
`held_port` keeps the socket bound and listening until its owner hands it over (distributed.listening_store binds
its store on the port it announces, with nothing in between). The job's rendezvous port is held so too: justrl's
launcher binds MASTER_PORT before any rank exists and rank 0 inherits the listening socket (`STORE_FD_ENV`), on which
it serves the job's store (`job_store`, which every rank calls in place of torch's env:// rendezvous); a process
that tries the port in between finds it taken.
"""

from __future__ import annotations

import datetime
import os
import socket

STORE_FD_ENV = "JUSTRL_STORE_FD"  # rank 0's inherited descriptor of the listening MASTER_PORT socket (launch.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def held_port(port: int = 0) -> socket.socket:
    """A listening socket on `port` (0: one the kernel picks), on every interface: no other process can bind that
    port while it is open (its number: `.getsockname()[1]`). Close it right before the server that needs the port
    binds it, or hand the server the socket itself. OSError when the port is taken."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the server's own bind may follow at once
    s.bind(("", port))
    s.listen()
    return s


def job_store(timeout: datetime.timedelta):
    """(the job's rendezvous store at MASTER_ADDR:MASTER_PORT, rank, world) as torch's env:// gives them. Rank 0 of a
    launch by justrl's launcher serves the store on the listening socket it inherited (`STORE_FD_ENV`): the port
    was held from the moment the launcher chose it, so a process that tried to take it in between found it taken (and
    torch's own env:// would find it taken too: a rank under justrl's launcher must meet through this). Under bare
    torchrun, rank 0 binds MASTER_PORT itself (env://)."""
    import torch.distributed as dist  # (here, not at the top: the launcher imports this module before any rank exists)

    fd = os.environ.pop(STORE_FD_ENV, None)  # not for this rank's children (an engine process)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if fd is None or rank != 0:
        return next(dist.rendezvous("env://", timeout=timeout))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, True, timeout,
                          multi_tenant=True, master_listen_fd=int(fd))
    return store, rank, world
