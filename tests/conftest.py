"""Shared fixtures: the tiny offline model and real inference servers (started and stopped by PID).

    pytest -m vllm tests/test_inference.py      # the layer that uses them
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tools/make_tiny_model.py built into a fresh directory (a few seconds, no network)."""
    out = tmp_path_factory.mktemp("models") / "tiny-qwen2"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_model.py"), "--out", str(out)], check=True)
    return out


@pytest.fixture(scope="session")
def start_inference_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable]:
    """start(config_yaml, overrides, env) -> a healthy LocalServer on a free port, logging under a
    fresh PRL_LOG_DIR; every server still running is stopped, by PID, at the end of the session."""
    from prl.inference.standalone import start_server

    started = []

    def start(config: Path, overrides: Sequence[str] = (), env: dict[str, str] | None = None):
        work = tmp_path_factory.mktemp("inference")
        server = start_server(config, overrides, output=work / "server.out", log_dir=work / "logs", env=env)
        started.append(server)
        try:
            server.wait_healthy(timeout_s=600)
        except RuntimeError as e:
            pytest.fail(str(e))
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """The test cluster (tools/slurm_cluster.sh up) must answer; without one the slurm tests are
    skipped, unless PRL_SLURM_REQUIRED=1 (tools/test.sh as root, CI), where that is a failure."""
    import os
    import shutil

    ok = shutil.which("sinfo") and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0
    if not ok:
        if os.environ.get("PRL_SLURM_REQUIRED") == "1":
            pytest.fail("PRL_SLURM_REQUIRED=1 but no Slurm cluster answers: run tools/slurm_cluster.sh up")
        pytest.skip("no Slurm cluster: run `tools/slurm_cluster.sh up` (root) to run these tests")
