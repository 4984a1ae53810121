"""TCP ports for the processes this machine starts (a local server, torchrun's rendezvous, tests).

Torch-free and below every program, so the control plane, the programs and the tests take it from here.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port nobody listens on right now on 127.0.0.1 (the caller's process binds it moments
    later; another may take it first, which that bind then reports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
