"""Run-directory helpers that the CLI tests do not reach: Lustre striping and attempt numbering."""

import errno
import os
import subprocess
import sys
from pathlib import Path

from prl.run import launches, rewind
from prl.run.files import write_failure
from prl.run.rundir import RunDir, is_complete, mark_complete, set_lustre_striping, step_of

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
    assert [launches.new_attempt(rd)[0] for _ in range(3)] == [0, 1, 2]
    assert os.readlink(rd.logs / "latest") == "attempt_2"
    assert launches.attempts(rd) == [0, 1, 2]


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
    rewind.rewind(rd, 2)
    assert sorted(p.name for p in rd.rollouts.iterdir()) == [
        "step_0.completions.jsonl", "step_0.pt", "step_1.completions.jsonl", "step_1.pt"]


def test_the_unfinished_writes_of_every_kind_go_at_the_next_launch(tmp_path):
    """Step directories without COMPLETE, the trainer's hidden `.step_N.tmp` and write_atomic's
    temporaries (also of steps before the checkpoint) are unfinished; complete ones are not."""
    rd = RunDir(tmp_path / "run")
    for parent in (rd.weights, rd.checkpoints, rd.rollouts):
        parent.mkdir(parents=True)
    for step in (1, 2):
        mark_complete(_made(rd.checkpoint_dir(step)))
        mark_complete(_made(rd.weights_dir(step)))
    partial = [_made(rd.checkpoint_dir(4) / ".trainer.tmp").parent, _made(rd.weights_dir(3)),
               _made(rd.weights / ".step_4.tmp"), rd.rollouts / "step_1.pt.tmp77", rd.weights / ".x.tmp9"]
    for p in partial[3:]:
        p.write_bytes(b"x")
    assert sorted(rewind.unfinished(rd)) == sorted(partial)
    launches.start_attempt(rd)
    assert not rewind.unfinished(rd) and all(is_complete(rd.checkpoint_dir(s)) and is_complete(rd.weights_dir(s)) for s in (1, 2))


def _made(path):
    path.mkdir(parents=True)
    return path


def test_a_write_refused_for_want_of_room_is_found_wherever_torch_puts_it():
    """ENOSPC and EDQUOT as themselves, as the cause or context of another error, inside DCP's
    CheckpointException (rank -> (error, stack)), and torch.save's short write; other errors are not."""
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, "No space left on device", "/run/checkpoints/step_4/x.distcp")
    assert write_failure(full) == "No space left on device writing /run/checkpoints/step_4/x.distcp"
    assert write_failure(OSError(errno.EDQUOT, "Disk quota exceeded")) == "Disk quota exceeded"
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as e:
        assert write_failure(e) == write_failure(full)
    wrapped = CheckpointException("save", {0: (full, None)})
    assert write_failure(wrapped) == write_failure(full)
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert write_failure(CheckpointException("save", {1: (short, None)})) == "a write came up short (unexpected pos 704 vs 598)"
    assert write_failure(OSError(errno.EACCES, "Permission denied")) is None and write_failure(ValueError("x")) is None


def test_complete_vouches_only_for_what_is_on_the_disk(tmp_path, monkeypatch):
    """mark_complete fsyncs every file and directory of the step (and the step's parent, which holds
    its name) before COMPLETE exists, then COMPLETE itself and its directory."""
    step = tmp_path / "weights/step_3"
    (step / "sub").mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "sub/shard.distcp"):
        (step / name).write_bytes(b"x")
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        synced.append((path, (step / "COMPLETE").exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    mark_complete(step)
    before = {p for p, complete in synced if not complete}
    assert before >= {step / "model.safetensors", step / "config.json", step / "sub/shard.distcp", step / "sub", step,
                      step.parent}, synced
    assert synced[-1] == (step, True) and is_complete(step)  # the marker's rename, made durable


def test_complete_without_durable_fsyncs_nothing(tmp_path, monkeypatch):
    """durable=False (the RL loop's policy versions): COMPLETE at once, no fsync of anything."""
    step = tmp_path / "weights/step_3"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"x")
    synced = []
    monkeypatch.setattr(os, "fsync", synced.append)
    mark_complete(step, durable=False)
    assert is_complete(step) and synced == [] and sorted(p.name for p in step.iterdir()) == ["COMPLETE", "model.safetensors"]


def test_a_job_script_written_before_the_move_still_opens_its_attempt(tmp_path):
    """Job scripts written before prl.run.launches call `python -m prl.run.rundir new-attempt RUN`;
    `prl resume` resubmits them as they are."""
    (tmp_path / "config.yaml").write_text("{}\n")
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    r = subprocess.run([sys.executable, "-m", "prl.run.rundir", "new-attempt", str(tmp_path)], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "0" and (tmp_path / "logs/attempt_0").is_dir(), r.stderr
    assert [e["attempt"] for e in launches.start_records(RunDir(tmp_path))] == [0]

