"""A node's replicas as independent servers (`inference.replica_servers`): this process starts one
`jobs/inference.py` per replica, each on its own GPUs and port, and ends with the first of them.

    python jobs/inference.py RUN/config.yaml      # with inference.replica_servers and 2+ replicas a node

Each server is vLLM's single-replica path (its front end in its own process, its engine forked from
it), so a node starts no API-server or worker interpreters beyond one per replica. The servers are
one component: when one of them exits, for whatever reason, the others are stopped, and its exit
status is the node's (prl.run.node then records the component's failure and the job ends).
Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from prl.config import Config
from prl.run.node import gpu_slice
from prl.run.protocol import NODE_RANK_ENV, REPLICA_ENV

JOB = Path(__file__).resolve().parents[2] / "jobs" / "inference.py"
STOP_GRACE_S = 20.0
"""SIGTERM to SIGKILL for the other servers once one has exited (vLLM's own shutdown: --shutdown-timeout 10)."""


def replica(environ: dict[str, str] | os._Environ = os.environ) -> int:
    """This server's index on its node (0 when it is the node's only server)."""
    return int(environ.get(REPLICA_ENV, "0/1").partition("/")[0])


def log_rank(environ: dict[str, str] | os._Environ = os.environ) -> int:
    """The rank of this server's `inference/rank_R.log`: node x servers per node + its index. Read by
    every process that logs for the server (jobs/inference.py, the routes in each API-server process)."""
    index, _, count = environ.get(REPLICA_ENV, "0/1").partition("/")
    return int(environ.get(NODE_RANK_ENV, "0")) * int(count) + int(index)


def replica_env(cfg: Config, index: int, environ: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """The environment of server `index`: which of how many it is, its tensor_parallel GPUs of the
    node's visible ones (servers index // servers_per_gpu's, where several share each GPU)."""
    env = {**environ, REPLICA_ENV: f"{index}/{cfg.inference.local_replicas}"}
    if cfg.inference.gpus_per_node:
        width = cfg.inference.tensor_parallel
        visible = environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(cfg.inference.gpus_per_node)))
        env["CUDA_VISIBLE_DEVICES"] = gpu_slice(visible, f"{index // cfg.inference.servers_per_gpu * width}:{width}")
    return env


def run(argv: list[str], cfg: Config) -> int:
    """Start the node's servers (`jobs/inference.py ARGV` each) and wait; the first one's exit status."""
    servers: list[subprocess.Popen] = []

    def forward(signum: int, frame: object) -> None:
        for server in servers:
            if server.poll() is None:
                server.send_signal(signum)

    # Before the first start: a TERM from prl.run.node meanwhile reaches every server started so far.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    for i in range(cfg.inference.local_replicas):
        servers.append(subprocess.Popen([sys.executable, str(JOB), *argv], env=replica_env(cfg, i)))
    started = ", ".join(f"pid {p.pid} on port {port}" for p, port in zip(servers, cfg.inference.ports))
    print(f"prl.inference.replicas: servers {started}", flush=True)
    while not (ended := [s for s in servers if s.poll() is not None]):
        time.sleep(0.2)
    first = ended[0]
    if any(s.poll() is None for s in servers):
        print(f"prl.inference.replicas: server pid {first.pid} exited with {first.returncode}; stopping the others",
              flush=True)
    stop(servers)
    return first.returncode if first.returncode >= 0 else 128 - first.returncode


def stop(servers: list[subprocess.Popen]) -> None:
    """SIGTERM to each server still running, SIGKILL after STOP_GRACE_S (what it started ends with
    prl.run.node, whose subreaper it is)."""
    for server in servers:
        if server.poll() is None:
            server.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for server in servers:
        try:
            server.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
