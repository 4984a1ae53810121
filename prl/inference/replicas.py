"""A node's replicas as independent servers (`inference.replica_servers`): this process starts one
`jobs/inference.py` per replica, each on its own GPUs and port, and ends with the first of them.
With a `teacher` section it starts the teacher's server beside them (PRL_TEACHER set: the same
program, prl.inference.teacher), one component with them: started, watched and ended alike.

    python jobs/inference.py RUN/config.yaml      # with inference.replica_servers and 2+ replicas a node, or a teacher

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
from prl.run.protocol import NODE_RANK_ENV, REPLICA_ENV, TEACHER_ENV

JOB = Path(__file__).resolve().parents[2] / "jobs" / "inference.py"
STOP_GRACE_S = 20.0
"""SIGTERM to SIGKILL for the other servers once one has exited (vLLM's own shutdown: --shutdown-timeout 10)."""


def replica(environ: dict[str, str] | os._Environ = os.environ) -> int:
    """This server's index on its node (0 when it is the node's only server)."""
    return int(environ.get(REPLICA_ENV, "0/1").partition("/")[0])


def log_rank(environ: dict[str, str] | os._Environ = os.environ) -> int | str:
    """The rank of this server's `inference/rank_R.log`: node x servers per node + its index. Read by
    every process that logs for the server (jobs/inference.py, the routes in each API-server process);
    the teacher's server: teacher_NODE."""
    index, _, count = environ.get(REPLICA_ENV, "0/1").partition("/")
    if environ.get(TEACHER_ENV):
        return f"teacher_{environ.get(NODE_RANK_ENV, '0')}"
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


def server_envs(cfg: Config, environ: dict[str, str] | os._Environ = os.environ) -> list[dict[str, str]]:
    """The environment of each server this node starts: a replica's each (one server: the node's
    own, as replica 0 of 1), then the teacher's, on the node's first GPU (teacher.gpu_memory_utilization of it)."""
    if len(cfg.inference.ports) > 1:
        envs = [replica_env(cfg, i, environ) for i in range(cfg.inference.local_replicas)]
    else:
        envs = [{**environ, REPLICA_ENV: "0/1"}]
    if cfg.teacher is not None:
        teacher = {**environ, REPLICA_ENV: "0/1", TEACHER_ENV: "1"}
        if cfg.inference.gpus_per_node:
            teacher["CUDA_VISIBLE_DEVICES"] = gpu_slice(environ.get("CUDA_VISIBLE_DEVICES") or "0", "0:1")
        envs.append(teacher)
    return envs


def ports(cfg: Config) -> list[int]:
    """The ports of the servers server_envs starts, in its order."""
    return cfg.inference.ports + ([cfg.teacher.port] if cfg.teacher is not None else [])


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
    for env in server_envs(cfg):
        servers.append(subprocess.Popen([sys.executable, str(JOB), *argv], env=env))
    started = ", ".join(f"pid {p.pid} on port {port}" for p, port in zip(servers, ports(cfg)))
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
