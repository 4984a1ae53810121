"""Run-directory helpers that the CLI tests do not reach: Lustre striping and attempt numbering."""

import os
import subprocess
import sys

from prl.run.rundir import RunDir, set_lustre_striping, step_of

MOUNTS = "/dev/sda1 / ext4 rw 0 0\n10.0.0.1@o2ib:/scratch /scratch lustre rw 0 0\n"


def test_lustre_striping_only_on_lustre(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "lfs.argv"
    (bin_dir / "lfs").write_text(f'#!/bin/bash\necho "$@" >> {calls}\n')
    (bin_dir / "lfs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    lustre_mounts = MOUNTS + f"x@tcp:/fs {tmp_path} lustre rw 0 0\n"
    assert set_lustre_striping(tmp_path / "ckpt", mounts=lustre_mounts)
    assert calls.read_text().split() == ["setstripe", "-c", "-1", str(tmp_path / "ckpt")]
    calls.unlink()
    assert not set_lustre_striping(tmp_path / "ckpt", mounts=MOUNTS)  # ext4: quietly nothing
    assert not calls.exists()


def test_step_of_parses_step_names_only(tmp_path):
    assert step_of(tmp_path / "weights" / "step_12") == 12 and step_of("step_0") == 0
    assert [step_of(n) for n in ("step_3.pt", "step_x", "step_", ".step_3.tmp", "attempt_3")] == [None] * 5
    assert step_of("step_3.completions.jsonl", suffixed=True) == 3
    assert step_of(".step_3.tmp", suffixed=True) is None


def test_attempts_are_numbered_and_latest_follows(tmp_path):
    rd = RunDir(tmp_path / "run")
    assert [rd.new_attempt()[0] for _ in range(3)] == [0, 1, 2]
    assert os.readlink(rd.logs / "latest") == "attempt_2"
    assert rd.attempts() == [0, 1, 2]


def test_programs_do_not_import_the_renderer():
    """Layers point one way: the programs read run-protocol facts from prl.run.protocol/prl.run.rundir."""
    code = ("import sys, prl.trainer.train, prl.orchestrator.loop;"
            "print([m for m in ('prl.control.render', 'prl.control.submit') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"


def test_rewind_takes_each_steps_completions_with_its_batch(tmp_path):
    """A resumed run regenerates batch N and what the model wrote in it; interrupted writes go too."""
    rd = RunDir(tmp_path / "run")
    rd.rollouts.mkdir(parents=True)
    for step in range(4):
        rd.rollout_path(step).write_bytes(b"x")
        rd.completions_path(step).write_text("{}\n")
    (rd.rollouts / "step_3.completions.jsonl.tmp123").write_text("{")
    rd.rewind(2)
    assert sorted(p.name for p in rd.rollouts.iterdir()) == [
        "step_0.completions.jsonl", "step_0.pt", "step_1.completions.jsonl", "step_1.pt"]
