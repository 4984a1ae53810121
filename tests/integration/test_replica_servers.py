"""inference.replica_servers on one node, with real vLLM on CPU: one `jobs/inference.py` starts a server
per replica (prl.inference.replicas), each on its own port, and they live and end as one component.

    pytest tests/integration/test_replica_servers.py
"""

from __future__ import annotations

import re
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from inference_helpers import API_KEY
from prl.inference.standalone import start_server

pytestmark = pytest.mark.vllm


def two_free_ports() -> int:
    """A port P with P + 1 free too (each server binds its own)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port < 65535:
            with socket.socket() as other:
                try:
                    other.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise RuntimeError("no two consecutive free ports")


def config(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "inference.yaml"
    path.write_text(
        f"run: {{name: replicas, output_dir: {tmp_path}/out}}\n"
        f"model: {{name: {model}, dtype: float32, max_model_len: 256}}\n"
        "inference: {gpus_per_node: 0, data_parallel: 2, replica_servers: true, enforce_eager: true,\n"
        "            api_key_env: PRL_TEST_API_KEY, env: {VLLM_CPU_KVCACHE_SPACE: '1'}}\n"
        "orchestrator: {environment: {id: prl.envs.toy}}\n"
    )
    return path


def server_pids(output: Path) -> list[int]:
    """The servers' PIDs, as the node's process announced them."""
    line = re.search(r"prl.inference.replicas: servers (.*)", output.read_text()).group(1)
    return [int(pid) for pid in re.findall(r"pid (\d+)", line)]


def test_two_replica_servers_serve_load_weights_and_stop_together(tmp_path, tiny_model):
    port = two_free_ports()
    logs = tmp_path / "logs"
    node = start_server(config(tmp_path, tiny_model), output=tmp_path / "node.out", log_dir=logs, port=port,
                        env={"PRL_TEST_API_KEY": API_KEY})
    try:
        urls = [f"http://127.0.0.1:{port + i}" for i in range(2)]
        deadline = time.monotonic() + 600
        for url in urls:
            wait_healthy(url, node, deadline)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "seed": 1, "temperature": 1.0}}
        for url in urls:
            generated = httpx.post(f"{url}/prl/generate", json=body, headers=headers, timeout=120)
            assert generated.status_code == 200 and len(generated.json()["token_ids"]) == 4, generated.text
            updated = httpx.post(f"{url}/update_weights", json={"path": str(tiny_model)}, headers=headers, timeout=300)
            assert updated.status_code == 200, updated.text
        for rank in (0, 1):  # each server logs as its own rank, on its own port, its own weight update
            text = (logs / f"inference/rank_{rank}.log").read_text()
            assert f"port {port + rank} (server {rank} of the node's 2)" in text
            assert text.count(f"weights updated from {tiny_model}") == 1, text
        pids = server_pids(node.output)
        # SIGTERM to the node's process (what prl.run.node forwards): both servers shut down, it exits 0.
        node.process.send_signal(signal.SIGTERM)
        assert node.process.wait(timeout=120) == 0, node.tail()
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    finally:
        node.stop()


def wait_healthy(url: str, node, deadline: float) -> None:
    with httpx.Client(timeout=5) as client:  # one SSL context, not one a poll (LocalServer.wait_healthy)
        while True:
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert node.process.poll() is None, node.tail()
            assert time.monotonic() < deadline, node.tail()
            time.sleep(0.5)


def test_a_server_that_cannot_start_ends_the_node_with_its_status(tmp_path, tiny_model):
    """Replica 1's port is taken: it exits at once (one line naming inference.port), and the node's
    process stops replica 0, still starting vLLM, and exits with replica 1's status."""
    port = two_free_ports()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port + 1))
        squatter.listen()
        node = start_server(config(tmp_path, tiny_model), output=tmp_path / "node.out", port=port,
                            env={"PRL_TEST_API_KEY": API_KEY})
        try:
            assert node.process.wait(timeout=120) == 1, node.tail()
        finally:
            node.stop()
    text = node.output.read_text()
    assert f"inference.port: 127.0.0.1:{port + 1} is taken" in text
    assert re.search(r"server pid \d+ exited with 1; stopping the others", text), text
    assert not [pid for pid in server_pids(node.output) if Path(f"/proc/{pid}").exists()]
