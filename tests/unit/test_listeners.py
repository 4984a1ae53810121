"""Issue 53, item 5: the run's TCP listeners take only the address the run is reached at. The weight
broadcast's store (prl.run.broadcast_store) and torchrun's rendezvous store (prl.run.rendezvous)
listen on loopback in local mode, where torch's own listeners take every interface; another user
who scans /proc/net/tcp from another node finds nothing to connect to.

    pytest tests/unit/test_listeners.py
"""

from __future__ import annotations

import ipaddress
import socket

import pytest
from broadcast_helpers import CPU, KEY

from prl.run import broadcast as bc, broadcast_store as bs, ports
from prl.trainer.broadcast_sender import Sender


def listening(port: int) -> set[str]:
    """The addresses a socket of this machine listens on at `port`, as any user reads /proc/net/tcp(6)."""
    found = set()
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                raw = bytes.fromhex(address)
                # /proc writes each 32-bit word in host (little-endian) order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
                found.add(str(ipaddress.ip_address(words)))
    return found


def test_the_broadcast_store_listens_on_loopback_alone_in_local_mode(tmp_path):
    """What torch's TCPStore does by itself (every interface, ::), and what the trainer's store does:
    127.0.0.1, MASTER_ADDR of a local run; the run's own processes still connect."""
    import datetime

    import torch.distributed as dist

    plain = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    assert listening(plain.port) & {"::", "0.0.0.0"}  # the issue: reachable from every interface
    sender = Sender(bc.Access(KEY, tmp_path / "weights_store"), bc.host_address({"MASTER_ADDR": "127.0.0.1"}),
                    world=2, backend="gloo", device=CPU, slots=1, timeout_s=10)
    try:
        assert listening(sender.raw_store.port) == {"127.0.0.1"}
        client = bs.store(*bc.Access(KEY, tmp_path / "weights_store").address(), host_it=False, timeout_s=5)
        assert client.check([]) is not None
    finally:
        sender.close()


def test_a_listener_takes_the_named_address_and_a_node_name_on_loopback_takes_every_interface(capsys):
    with ports.listen("127.0.0.1") as sock:
        assert listening(sock.getsockname()[1]) == {"127.0.0.1"}
    # Debian's "127.0.1.1 HOSTNAME": the other nodes reach this node's name at another address.
    if not ipaddress.ip_address(socket.gethostbyname(socket.gethostname())).is_loopback:
        pytest.skip("this machine's name does not name a loopback address")
    with ports.listen(socket.gethostname()) as sock:
        assert listening(sock.getsockname()[1]) & {"::", "0.0.0.0"}
    assert "listening on every interface" in capsys.readouterr().err
