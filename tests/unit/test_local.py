"""Local mode (`prl submit --local`) in probe mode: same wiring contract, supervision and teardown
as the batch script, on this machine."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prl.run.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_local(tmp_path, *overrides):
    args = [sys.executable, "-m", "prl.control.cli", "submit", str(ROOT / "configs/toy.yaml"), "--local",
            f"run.output_dir={tmp_path}", "run.mode=probe", f"inference.port={free_port()}", *overrides]
    return subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def pids(stdout):
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"started (\w+) \(pid (\d+)\)", stdout)}


def test_local_probe_run_completes_and_leaves_nothing_behind(tmp_path):
    r = run_local(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "run complete" in r.stdout
    # Where the logs are, and the progress line (not a terminal here: one line per new step).
    assert f"logs: {tmp_path / 'toy/logs/attempt_0'}" in r.stdout and "\nstep 0/" in r.stdout
    assert (tmp_path / ".prl-last-run").read_text().strip() == str(tmp_path / "toy")  # bare `prl status` finds it
    reports = [json.loads(p.read_text()) for p in (tmp_path / "toy/logs/attempt_0/probe").glob("*.json")]
    assert sorted(x["component"] for x in reports) == ["inference", "orchestrator", "trainer"]
    trainer = next(x for x in reports if x["component"] == "trainer")
    assert trainer["world_size"] == 1 and trainer["env"]["MASTER_ADDR"] == "127.0.0.1"
    # torchrun's rendezvous on loopback at the port its node rank 0 picked and recorded (prl.run.rendezvous),
    # which torchrun hands its ranks
    rendezvous = (tmp_path / "toy/logs/attempt_0/rendezvous").read_text().strip()
    assert rendezvous == f"127.0.0.1:{trainer['env']['MASTER_PORT']}", rendezvous
    # every process, torchrun's rank processes (in sessions of their own) included, is gone
    for pid in [*pids(r.stdout).values(), *(x["pid"] for x in reports)]:
        assert not alive(pid), pid


def test_dry_run_writes_the_run_directory_and_starts_nothing(tmp_path):
    """`--local --dry-run`, as `prl submit --dry-run`: the run written, each component's command shown,
    no attempt started; the real launch afterwards is not refused as a second run."""
    r = run_local(tmp_path, "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "toy/config.yaml").exists() and not list((tmp_path / "toy/logs").iterdir())
    for name in ("inference", "trainer", "orchestrator"):
        assert re.search(rf"^{name}: .*jobs/probe\.py {name} {tmp_path / 'toy/config.yaml'}$", r.stdout, re.M), r.stdout
    assert "started" not in r.stdout and f"# dry run: wrote {tmp_path / 'toy'}" in r.stdout
    assert run_local(tmp_path).returncode == 0


def test_local_failure_names_the_component(tmp_path):
    r = run_local(tmp_path, "orchestrator.env.PRL_PROBE_EXIT=5")
    assert r.returncode == 13, r.stdout + r.stderr
    assert "orchestrator failed with exit status 5" in r.stderr
    assert (tmp_path / "toy/logs/attempt_0/failed").read_text().startswith("orchestrator failed")
    assert not alive(pids(r.stdout)["inference"])


def test_interrupt_reaches_the_ranks_and_leaves_nothing_behind(tmp_path):
    """SIGHUP to prl (its terminal closed), which it takes as SIGTERM (the same handler; SIGTERM itself:
    tests/integration/test_e2e_local.py): USR1 reaches the training ranks, which torchrun starts in
    sessions of their own; they report a checkpoint and every process ends. What prl still says goes
    to the attempt's job.log: the terminal is gone."""
    args = [sys.executable, "-m", "prl.control.cli", "submit", str(ROOT / "configs/toy.yaml"), "--local",
            f"run.output_dir={tmp_path}", "run.mode=probe", f"inference.port={free_port()}", "trainer.env.PRL_PROBE_HOLD=300"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    probe_dir = tmp_path / "toy/logs/attempt_0/probe"
    deadline = time.monotonic() + 120
    while not list(probe_dir.glob("trainer-ready-*")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    time.sleep(0.5)  # the ready file is written just before the hold starts
    rank_pid = int(next(probe_dir.glob("trainer-ready-*")).read_text())
    proc.send_signal(signal.SIGHUP)
    out, _ = proc.communicate(timeout=120)
    job_log = tmp_path / "toy/logs/attempt_0/job.log"
    assert proc.returncode == 130, out + (job_log.read_text() if job_log.exists() else "")
    assert (tmp_path / "toy/logs/attempt_0/preempted").exists(), out
    assert not alive(rank_pid)
    assert not any(alive(pid) for pid in pids(out).values())
    assert "interrupted: the trainer checkpoints" in job_log.read_text() and "interrupted" not in out


def test_second_launch_is_a_new_attempt(tmp_path):
    assert run_local(tmp_path).returncode == 0
    r = run_local(tmp_path)
    assert r.returncode == 2 and "already holds a run" in r.stderr
    assert run_local(tmp_path, "--resume").returncode == 0
    assert os.readlink(tmp_path / "toy/logs/latest") == "attempt_1"


def gpu_config(inference_gpus: int, trainer_gpus: int):
    from prl.config import load_config

    return load_config(ROOT / "configs/toy.yaml", [f"inference.gpus_per_node={inference_gpus}",
                                                     f"trainer.gpus_per_node={trainer_gpus}",
                                                     "orchestrator.batch_size=64"])


def ids(count: int) -> list[str]:
    return [str(i) for i in range(count)]


def test_gpu_assignment_gives_each_component_its_own_gpus_when_there_are_enough():
    from prl.control.local import gpu_assignment

    assert gpu_assignment(gpu_config(1, 1), ids(2)) == {"inference": "0", "trainer": "1"}
    assert gpu_assignment(gpu_config(1, 2), ids(8)) == {"inference": "0", "trainer": "1,2"}
    assert gpu_assignment(gpu_config(0, 0), ids(0)) == {}


def test_gpu_assignment_shares_when_each_fits_but_not_both(capsys):
    from prl.control.local import gpu_assignment

    assert gpu_assignment(gpu_config(1, 1), ids(1)) == {"inference": "0", "trainer": "0"}
    assert "share GPU(s) 0" in capsys.readouterr().out
    assert gpu_assignment(gpu_config(1, 2), ids(2)) == {"inference": "0", "trainer": "0,1"}


def test_local_mode_keeps_to_the_gpus_cuda_visible_devices_lists():
    """CUDA_VISIBLE_DEVICES=2,3 on a 4-GPU workstation: the run gets GPUs 2 and 3, not 0 and 1."""
    from prl.control.local import gpu_assignment, visible_gpus

    assert visible_gpus({}, 4) == ["0", "1", "2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, 4) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": " GPU-8f1e, GPU-77aa ,"}, 2) == ["GPU-8f1e", "GPU-77aa"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, 4) == []  # CUDA hides every GPU
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, 4) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, 4) == ["1"]  # CUDA stops at the first invalid one
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0"}, 0) == []  # a left-over value on a machine without GPUs
    assert gpu_assignment(gpu_config(1, 1), visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, 4)) == {
        "inference": "2", "trainer": "3"}


def test_a_run_asking_for_more_gpus_than_cuda_visible_devices_leaves_is_refused(monkeypatch):
    import pytest

    from prl.config import ConfigError
    from prl.control.local import gpu_assignment

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError, match=r"; 1 visible here \(CUDA_VISIBLE_DEVICES='3'\)"):
        gpu_assignment(gpu_config(1, 2), ["3"])


def test_a_broadcast_between_components_on_one_gpu_goes_by_gloo():
    """NCCL refuses two ranks on one device: where local mode shares GPUs, the weight broadcast
    (inference.weight_transfer: broadcast) is told to use gloo; on GPUs of their own, NCCL."""
    from prl.control.local import gpu_assignment, shared_gpus

    assert shared_gpus(gpu_assignment(gpu_config(1, 1), ids(1)))
    assert shared_gpus(gpu_assignment(gpu_config(1, 2), ids(2)))
    assert not shared_gpus(gpu_assignment(gpu_config(1, 1), ids(2)))
    assert not shared_gpus(gpu_assignment(gpu_config(0, 0), ids(0)))


def test_gpu_assignment_refuses_a_component_larger_than_the_machine():
    import pytest

    from prl.config import ConfigError
    from prl.control.local import gpu_assignment

    with pytest.raises(ConfigError, match="needs 1 \\+ 2 GPUs"):
        gpu_assignment(gpu_config(1, 2), ids(1))


def test_local_probe_run_with_an_environment_server_ends_it_with_the_run(tmp_path):
    """An entry's server_workers adds the envserver: its probe runs until the run is complete, then ends
    with the others (a server's exit before that would fail the run)."""
    args = [sys.executable, "-m", "prl.control.cli", "submit", str(ROOT / "configs/toy_v1.yaml"), "--local",
            f"run.output_dir={tmp_path}", "run.mode=probe", f"inference.port={free_port()}",
            "orchestrator.environment.server_workers=1"]
    if not (ROOT / ".venv-v1/bin/python").exists() and os.environ.get("CI") != "true":
        pytest.skip("needs .venv-v1 (tools/setup.sh), where prl submit checks the v1 package")
    r = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "run complete" in r.stdout, r.stdout + r.stderr
    reports = [json.loads(p.read_text()) for p in (tmp_path / "toy_v1/logs/attempt_0/probe").glob("*.json")]
    assert sorted(x["component"] for x in reports) == ["envserver", "inference", "orchestrator", "trainer"]
    for pid in [*pids(r.stdout).values(), *(x["pid"] for x in reports)]:
        assert not alive(pid), pid
