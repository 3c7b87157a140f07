"""TCP ports on this machine, for a rendezvous or a store (without importing torch: the launcher needs one before any
rank exists, and importing the training stack would cost it seconds).

`free_port` names a port that was free a moment ago: whoever binds it later may find it taken (another process on a
shared node took it in between). Where the port is announced to other processes before it is used, hold it instead:
`held_port` keeps the socket bound and listening until its owner hands it over (distributed.listening_store binds
its store on the port it announces, with nothing in between).
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def held_port() -> socket.socket:
    """A listening socket on a port the kernel picks, on every interface: no other process can bind that port while
    it is open (its number: `.getsockname()[1]`). Close it right before the server that needs the port binds it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the server's own bind may follow at once
    s.bind(("", 0))
    s.listen()
    return s
