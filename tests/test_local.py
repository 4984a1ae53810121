"""Local mode (`prl submit --local`) in probe mode: same wiring contract, supervision and teardown
as the batch script, on this machine."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_local(tmp_path, *overrides):
    args = [sys.executable, "-m", "prl.cli", "submit", str(ROOT / "configs/toy.yaml"), "--local",
            f"run.output_dir={tmp_path}", "run.mode=probe", "inference.port=18765", *overrides]
    return subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def pids(stdout):
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"started (\w+) \(pid (\d+)\)", stdout)}


def test_local_probe_run_completes_and_leaves_nothing_behind(tmp_path):
    r = run_local(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "run complete" in r.stdout
    reports = [json.loads(p.read_text()) for p in (tmp_path / "toy/logs/attempt_0/probe").glob("*.json")]
    assert sorted(x["component"] for x in reports) == ["inference", "orchestrator", "trainer"]
    trainer = next(x for x in reports if x["component"] == "trainer")
    assert trainer["world_size"] == 1 and trainer["env"]["MASTER_ADDR"] == "127.0.0.1"
    for pid in pids(r.stdout).values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_local_failure_names_the_component(tmp_path):
    r = run_local(tmp_path, "orchestrator.env.PRL_PROBE_EXIT=5")
    assert r.returncode == 13, r.stdout + r.stderr
    assert "orchestrator failed with exit status 5" in r.stderr
    assert (tmp_path / "toy/logs/attempt_0/failed").read_text().startswith("orchestrator failed")
    inference_pid = pids(r.stdout)["inference"]
    assert not Path(f"/proc/{inference_pid}").exists()


def test_second_launch_is_a_new_attempt(tmp_path):
    assert run_local(tmp_path).returncode == 0
    r = run_local(tmp_path)
    assert r.returncode == 2 and "already holds a run" in r.stderr
    assert run_local(tmp_path, "--resume").returncode == 0
    assert os.readlink(tmp_path / "toy/logs/latest") == "attempt_1"
