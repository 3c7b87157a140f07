"""A free TCP port on this machine, for a rendezvous or a store (without importing torch: the launcher needs one
before any rank exists, and importing the training stack would cost it seconds)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
