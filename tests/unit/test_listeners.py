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


def test_torchruns_rendezvous_store_listens_where_rank_0_chose_and_the_other_nodes_find_it(tmp_path, monkeypatch):
    """prl.run.rendezvous: trainer node rank 0 listens on the endpoint host's address alone, at a port
    the system picks (a squatted port of the old 15000 + job id scheme is never asked for), records it
    in the attempt's directory, and torchrun's own static rendezvous (the installed torch's) makes its
    store on that socket; node rank 1 connects where the record says."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as static

    from prl.run import rendezvous
    from prl.run.attempt import Attempt

    monkeypatch.setattr(static, "TCPStore", static.TCPStore)  # bind_static_store's patch ends with the test
    attempt = Attempt(tmp_path)
    argv = ["--nnodes=2", "--node-rank=0", "--rdzv-backend=static", "--rdzv-endpoint=127.0.0.1:0", "train.py"]
    host_port = rendezvous.endpoint(argv, attempt)
    assert (tmp_path / "rendezvous").read_text() == host_port + "\n"
    port = int(host_port.rsplit(":", 1)[1])
    # One node for this handler: with two, making its store waits for the other node's agent.
    handler = static.create_rdzv_handler(RendezvousParameters(backend="static", endpoint=host_port, run_id="job",
                                                               min_nodes=1, max_nodes=1, rank=0))
    store = handler.next_rendezvous().store
    assert listening(port) == {"127.0.0.1"}
    other = rendezvous.endpoint([*argv[:1], "--node-rank=1", *argv[2:]], attempt)
    assert other == host_port
    client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=5))
    dist.PrefixStore("job", client).set("from node 1", "hello")
    assert store.get("from node 1") == b"hello"
    assert rendezvous.with_option(argv, "--rdzv-endpoint", other)[3] == f"--rdzv-endpoint={host_port}"


def test_vllms_data_parallel_port_is_drawn_at_random_and_free():
    import subprocess
    import sys

    drawn = {int(subprocess.run([sys.executable, "-m", "prl.run.ports"], capture_output=True, text=True,
                                check=True).stdout) for _ in range(3)}
    assert all(port in ports.UNPREDICTABLE for port in drawn) and len(drawn) > 1


def test_vllms_multi_node_data_parallel_is_refused_unless_the_fabric_is_isolated(tmp_path):
    """vLLM's sockets between its data-parallel nodes take anyone who reaches them: `prl submit` refuses
    the layout with one line naming slurm.fabric_isolated, writes nothing; with the key set, the batch
    script draws the RPC port at random (no more 20000 + job id) and exports it."""
    from helpers import ROOT, TOY, prl

    joined = ["inference.nodes=2", "inference.data_parallel=2", "inference.multi_node=data_parallel",
              "inference.gpus_per_node=0", f"model.name={ROOT / '.cache/tiny-qwen2'}"]
    out = tmp_path / "out"
    r = prl("submit", str(TOY), f"run.output_dir={out}", *joined, "--dry-run", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("prl: error: slurm.fabric_isolated: inference.multi_node=data_parallel over 2 nodes")
    assert not out.exists()
    r = prl("submit", str(TOY), f"run.output_dir={out}", *joined, "slurm.fabric_isolated=true", "--dry-run",
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    script = next(out.glob("*/job.sbatch")).read_text()
    assert 'DATA_PARALLEL_RPC_PORT=$("$PRL_PYTHON" -m prl.run.ports)' in script and "% 5000" not in script
    assert 'export DATA_PARALLEL_ADDRESS="${INFERENCE_NODES[0]}" DATA_PARALLEL_RPC_PORT' in script
