"""torchrun, with its rendezvous store where only the run reaches it, on a port nobody can take first.

    python -m prl.run.rendezvous --nnodes=2 ... --node-rank=$SLURM_PROCID --rdzv-backend=static \
        --rdzv-endpoint=$MASTER_ADDR:0 ... jobs/trainer.py RUN/config.yaml

torchrun's static rendezvous makes node rank 0 host a TCPStore at the endpoint, which the other
nodes and every rank connect to. By itself that store listens on every interface of the node, and
the port used to be 15000 + job id mod 5000: anyone could squat it before the job started, and every
requeue of the job then failed at its rendezvous (issue 53). Here node rank 0 listens first, on the
endpoint host's address alone (loopback in local mode; prl.run.ports.listen) and at a port the system
picks (endpoint port 0), hands that socket to torchrun's store, and records `HOST:PORT` in the
attempt's directory (logs/attempt_N/rendezvous, only the run's owner reads it); the other nodes wait
for that record and connect there. A port given in the endpoint (not 0) is used as it is.
"""

from __future__ import annotations

import socket
import sys
import time

from prl.run import protocol
from prl.run.attempt import Attempt
from prl.run.files import write_atomic
from prl.run.ports import listen

WAIT_S = 900.0
"""How long a node other than rank 0 waits for rank 0's record: torchrun's own default rendezvous timeout."""


def option(argv: list[str], name: str) -> str:
    """The value of `--name=VALUE` in argv (the form prl.run.launch writes)."""
    return next(arg.split("=", 1)[1] for arg in argv if arg.startswith(f"{name}="))


def with_option(argv: list[str], name: str, value: str) -> list[str]:
    return [f"{name}={value}" if arg.startswith(f"{name}=") else arg for arg in argv]


def bind_static_store(sock: socket.socket) -> None:
    """torchrun's static rendezvous (torch.distributed.elastic.rendezvous.static_tcp_rendezvous) makes
    its TCPStore by that module's name: node rank 0's is made on `sock` (master_listen_fd), which
    listens where prl chose, instead of a socket of its own on every interface. Pinned against the
    installed torch by tests/unit/test_listeners.py."""
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as static

    made, fds = static.TCPStore, [sock.detach()]

    def store(host, port, world_size=None, is_master=False, *args, **kwargs):
        if is_master and fds:
            kwargs["master_listen_fd"] = fds.pop()
        return made(host, port, world_size, is_master, *args, **kwargs)

    static.TCPStore = store


def published(attempt: Attempt, wait_s: float = WAIT_S) -> str:
    """Node rank 0's `HOST:PORT` for this attempt, once it is recorded (SystemExit after wait_s)."""
    record = attempt.marker(protocol.RENDEZVOUS)
    deadline = time.monotonic() + wait_s
    while not (text := record.read_text().strip() if record.exists() else ""):
        if time.monotonic() > deadline:
            raise SystemExit(f"prl.run.rendezvous: {record} not written in {wait_s:.0f}s (trainer node rank 0 did "
                             "not start)")
        time.sleep(0.2)
    return text


def endpoint(argv: list[str], attempt: Attempt | None) -> str:
    """The endpoint torchrun gets: node rank 0 listens (and records where), the others read the record."""
    host, port = option(argv, "--rdzv-endpoint").rsplit(":", 1)
    if option(argv, "--node-rank") != "0":
        return published(attempt) if port == "0" and attempt is not None else f"{host}:{port}"
    sock = listen(host, int(port))
    where = f"{host}:{sock.getsockname()[1]}"
    bind_static_store(sock)  # the socket is torch's from here
    if attempt is not None:
        write_atomic(attempt.marker(protocol.RENDEZVOUS), where + "\n")
    return where


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run

    args = sys.argv[1:] if argv is None else argv
    run.main(with_option(args, "--rdzv-endpoint", endpoint(args, Attempt.current())))


if __name__ == "__main__":
    main()
