"""Two attempts never write one run (prl.run.fence): a launch takes the run over, and an older attempt
still running (a zombie after a requeue) commits nothing: no checkpoint, COMPLETE, version, prune or
batch. Removing a step directory takes its COMPLETE first, so a crash midway never leaves one over
half a checkpoint."""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch

from prl.run import fence, launches
from prl.run.attempt import Attempt
from prl.run.batch import write_batch
from prl.run.protocol import COMPLETE
from prl.orchestrator.resume import write_completions
from prl.run.rundir import RunDir, is_complete, mark_complete
from prl.trainer.ckpt import prune_checkpoints, save_checkpoint
from prl.trainer.export import prune_weights, write_weights
from prl.trainer.samples import synthetic_batch


def tree(rd: RunDir) -> dict[str, bytes | None]:
    """Every path of the run but the attempts' own logs, with its content (None: a directory)."""
    return {str(p.relative_to(rd.path)): None if p.is_dir() else p.read_bytes()
            for p in sorted(rd.path.rglob("*")) if not p.is_relative_to(rd.logs)}


def launch(rd: RunDir, monkeypatch, **environ: str) -> str:
    """A launch takes the run over; this process is then one of its components."""
    _, attempt_dir = launches.start_attempt(rd, environ=environ)
    identity = fence.identity(Attempt(attempt_dir))
    monkeypatch.setenv(fence.ENV, identity)
    return identity


@pytest.fixture
def run(tmp_path) -> tuple[RunDir, Path]:
    rd, source = RunDir(tmp_path / "run"), tmp_path / "model"
    rd.create("{}\n", "#!/bin/bash\n")
    source.mkdir()
    (source / "config.json").write_text("{}")
    return rd, source


def checkpoint(rd: RunDir, step: int, files: int = 3) -> Path:
    """A complete checkpoint as the trainer leaves one (without torch's own files; not fsynced)."""
    path = rd.checkpoint_dir(step)
    (path / "trainer").mkdir(parents=True)
    for i in range(files):
        (path / "trainer" / f"shard_{i}.distcp").write_bytes(bytes([i]) * 64)
    mark_complete(path, durable=False, fence=lambda: fence.check(rd, f"COMPLETE of {path.name}"))
    return path


def test_a_second_attempt_takes_over_and_the_first_commits_nothing(run, monkeypatch):
    rd, source = run
    first = launch(rd, monkeypatch)
    for step in (1, 2, 3):
        write_weights({"w": torch.ones(2)}, source, rd, step)
    checkpoint(rd, 1), checkpoint(rd, 2)
    assert (rd.weights_dir(3) / COMPLETE).read_text() == (rd.checkpoint_dir(2) / COMPLETE).read_text() == first + "\n"
    assert first.startswith("job=local restart=0 attempt=0 nonce=")
    second = launch(rd, monkeypatch, SLURM_JOB_ID="7", SLURM_RESTART_COUNT="1")
    assert fence.current(rd) == second and second.startswith("job=7 restart=1 attempt=1 nonce=")
    partial = rd.checkpoint_dir(4)  # a checkpoint the old trainer is about to mark
    (partial / "trainer").mkdir(parents=True)
    before = tree(rd)
    monkeypatch.setenv(fence.ENV, first)  # the zombie
    for write in (lambda: write_weights({"w": torch.zeros(2)}, source, rd, 3),
                  lambda: write_weights({"w": torch.zeros(2)}, source, rd, 4),
                  lambda: prune_weights(rd, newest=9, keep=1),
                  lambda: prune_checkpoints(rd, keep_last=1),
                  lambda: mark_complete(partial, fence=lambda: fence.check(rd, "COMPLETE")),
                  lambda: write_completions(rd, 2, [{"completion": "x"}]),
                  lambda: write_batch(rd, synthetic_batch(2, 1, 1, 1, 4, 16))):
        with pytest.raises(SystemExit, match=f"no longer the run's writer \\({second} took it over\\)"):
            write()
        assert tree(rd) == before
    monkeypatch.setenv(fence.ENV, second)  # the current attempt writes as before
    write_weights({"w": torch.zeros(2)}, source, rd, 3)
    prune_checkpoints(rd, keep_last=1)
    assert (rd.weights_dir(3) / COMPLETE).read_text() == second + "\n"
    assert sorted(p.name for p in rd.checkpoints.iterdir()) == ["step_2", "step_4"]


def test_a_zombie_trainer_is_fenced_at_its_checkpoints_commit(run, monkeypatch, process_group):
    """Taken over while its ranks write the shards: the old trainer renames nothing and marks
    nothing; a zombie that starts a checkpoint after the takeover writes nothing at all."""
    rd, _ = run
    launch(rd, monkeypatch)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    checkpoint(rd, 1)
    monkeypatch.setenv("PRL_FAULT_CHECKPOINT_DELAY_S", "0.5")  # the writes start 0.5 s after the save
    takeover = threading.Timer(0.1, launches.start_attempt, (rd,), {"environ": {}})
    takeover.start()
    with pytest.raises(SystemExit, match="not writing checkpoint step_2"):
        save_checkpoint(rd, 2, model, optimizer, scheduler, keep_last=1)
    takeover.join()
    assert not (rd.checkpoint_dir(2) / "trainer").exists() and not is_complete(rd.checkpoint_dir(2))
    assert is_complete(rd.checkpoint_dir(1))  # not pruned
    monkeypatch.setenv("PRL_FAULT_CHECKPOINT_DELAY_S", "0")
    before = tree(rd)
    with pytest.raises(SystemExit, match="not writing checkpoint step_3"):
        save_checkpoint(rd, 3, model, optimizer, scheduler, keep_last=1)
    assert tree(rd) == before


def crash_at(n: int, work) -> int:
    """Run `work` in a forked child that dies (SIGKILL-like, os._exit) at its `n`-th removal of a file
    or directory (an audit hook, before the call); the child's exit status (9: it died there)."""
    pid = os.fork()
    if pid == 0:
        try:
            count = [0]

            def hook(event, args):
                if event in ("os.remove", "os.rmdir"):
                    count[0] += 1
                    if count[0] == n:
                        os._exit(9)

            sys.addaudithook(hook)
            work()
        finally:
            os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.parametrize("prune", ["checkpoints", "weights"])
def test_a_crash_at_any_point_of_a_prune_leaves_no_complete_over_a_partial_directory(run, monkeypatch, prune):
    rd, source = run
    monkeypatch.delenv(fence.ENV, raising=False)
    crashed = 0
    for n in range(1, 20):
        for parent in (rd.checkpoints, rd.weights):
            for p in parent.iterdir():
                shutil.rmtree(p)
        for step in (1, 2):
            if prune == "checkpoints":
                checkpoint(rd, step, files=6)
            else:
                write_weights({f"w{i}": torch.ones(2) for i in range(6)}, source, rd, step, durable=False)
                for i in range(5):
                    (rd.weights_dir(step) / f"tokenizer_{i}.json").write_text("{}")
        full = {p: sorted(q.name for q in p.rglob("*")) for p in (rd.checkpoint_dir(1), rd.weights_dir(1))}
        work = (lambda: prune_checkpoints(rd, keep_last=1)) if prune == "checkpoints" else \
            (lambda: prune_weights(rd, newest=2, keep=1))
        status = crash_at(n, work)
        crashed += status == 9
        for path, names in full.items():
            if is_complete(path):  # what a COMPLETE vouches for is all there
                assert sorted(q.name for q in path.rglob("*")) == names, (n, path)
        if status == 0:
            break
    assert crashed >= 5 and status == 0  # it crashed at every removal, then ran to its end
    assert not is_complete(rd.checkpoint_dir(1) if prune == "checkpoints" else rd.weights_dir(1))
