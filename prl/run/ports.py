"""TCP ports for the processes this machine starts (a local server, torchrun's rendezvous, tests), and
listeners bound to one address: where the run needs to be reached, not every interface of the node.

Torch-free and below every program, so the control plane, the programs and the tests take it from here.
"""

from __future__ import annotations

import ipaddress
import random
import socket
import sys

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
UNPREDICTABLE = range(20000, 32768)
"""Where `unpredictable_port` draws from: below Linux's ephemeral range (32768-60999), so an outgoing
connection of the node does not take the port between the draw and the listener's bind."""


def free_port() -> int:
    """A TCP port nobody listens on right now on 127.0.0.1 (the caller's process binds it moments
    later; another may take it first, which that bind then reports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind_address(host: str) -> tuple[int, tuple]:
    """(address family, socket address) to listen on for clients that connect to `host`: the address
    `host` names here. A node name that names a loopback address on its own node only (Debian's
    127.0.1.1 line in /etc/hosts) while other nodes reach it by another: every interface, saying so,
    as torch would (listening on loopback, the other nodes could not connect)."""
    family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    if ipaddress.ip_address(address[0]).is_loopback and host not in LOOPBACK_NAMES:
        print(f"prl: {host} names a loopback address ({address[0]}) on this node: listening on every "
              "interface, where the other nodes can reach it", file=sys.stderr, flush=True)
        return (socket.AF_INET6, ("::", 0, 0, 0)) if socket.has_dualstack_ipv6() else (socket.AF_INET, ("0.0.0.0", 0))
    return family, address


def listen(host: str, port: int = 0) -> socket.socket:
    """A socket listening at `port` (0: one the system picks) on `host`'s address alone: for a torch
    TCPStore's server (its master_listen_fd), which by itself listens on every interface."""
    family, address = bind_address(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((address[0], port, *address[2:]))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def unpredictable_port(tries: int = 100) -> int:
    """A port drawn at random from UNPREDICTABLE that nobody listens on now, on any interface: for a
    listener prl does not start itself (vLLM's data-parallel RPC port), where a port derived from the
    job id could be squatted before the job starts.

        DATA_PARALLEL_RPC_PORT=$(python -m prl.run.ports)"""
    draw = random.SystemRandom()
    for _ in range(tries):
        port = draw.choice(UNPREDICTABLE)
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    raise SystemExit(f"prl.run.ports: no free port in {tries} draws from {UNPREDICTABLE.start}-{UNPREDICTABLE.stop - 1}")


if __name__ == "__main__":
    print(unpredictable_port())
