"""Run `jobs/inference.py` as a child process on this machine: for tests and benchmarks.

    server = start_server(Path("cfg.yaml"), ["model.dtype=float32"], output=Path("server.out"))
    server.wait_healthy(timeout_s=600)
    ...
    server.stop()

The child gets its own session, so `stop` can end it and everything it spawned (vLLM's engine and
worker processes) through its PID alone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from prl.run import proof, protocol, secret
from prl.run.home import PRL_HOME
from prl.run.ports import free_port
from prl.run.rundir import RunDir


@dataclass
class LocalServer:
    process: subprocess.Popen
    url: str
    output: Path
    """stdout + stderr of the server (vLLM's own logs)."""
    log_dir: Path | None
    """Its PRL_LOG_DIR (prl's log files: inference/rank_0.log), if one was given."""
    key: str
    """What every request but /health must carry: the run's secret (prl.run.secret) or the key of
    inference.api_key_env."""

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def wait_healthy(self, timeout_s: float) -> None:
        """Until GET /health answers 200 and the server proves it holds the key (prl.run.proof: what
        answers on the port may not be this server); RuntimeError (with the log tail) if it exits or
        times out."""
        deadline = time.monotonic() + timeout_s
        # One client for every poll: httpx.get builds a client, and with it an SSL context, each time,
        # which took this process 6 s of CPU over a 62 s start on 2 cores, beside the server it waits for
        # (py-spy; benchmarks/reports/server-start-wait-cpu_cpu2_2026-11-28.md).
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"inference server exited with {self.process.returncode}:\n{self.tail()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        asyncio.run(proof.prove(self.url, self.key))
                        return
                except (httpx.TransportError, proof.Unproven):
                    pass
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"inference server not healthy after {timeout_s}s:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the server (vLLM then stops its engine processes); SIGKILL its group if it hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        # The group id is the server's PID (its own session): this reaches only what it started.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def start_server(
    config: Path,
    overrides: Sequence[str] = (),
    *,
    output: Path,
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> LocalServer:
    """`python jobs/inference.py CONFIG OVERRIDES inference.port=<port, else a free one>`, output to `output`;
    returns at once. The server listens on 127.0.0.1 unless the overrides say otherwise."""
    from prl.config import load_config

    port = port or free_port()
    overrides = ["inference.host=127.0.0.1", *overrides, f"inference.port={port}"]
    argv = [sys.executable, str(PRL_HOME / "jobs" / "inference.py"), str(config), *overrides]
    environ = {**os.environ, protocol.NODE_RANK_ENV: "0", **(env or {})}
    cfg = load_config(str(config), overrides)
    # The child's run directory is the one seen from here, not from its own working directory.
    environ.setdefault("PRL_RUN_DIR", str(RunDir.of(cfg, environ).path))
    key = secret.server_key(cfg, environ)
    if log_dir is not None:
        environ["PRL_LOG_DIR"] = str(log_dir)
    with output.open("w") as out:
        process = subprocess.Popen(
            argv, cwd=PRL_HOME, env=environ, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return LocalServer(process, f"http://127.0.0.1:{port}", output, log_dir, key)
