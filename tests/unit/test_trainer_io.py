"""What the trainer reads and leaves on disk: batch checks, step directories, pruning, W&B run id."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from prl.config import Config, EnvironmentConfig, ModelConfig, OrchestratorConfig, RunConfig, WandbConfig
from prl.run.batch import read_batch, write_batch
from prl.run.rundir import RunDir
from prl.trainer.ckpt import complete_steps, newest_complete, prune_checkpoints
from prl.trainer.export import BackgroundWriter, make_durable, prune_weights, write_weights
from prl.trainer.metrics import NullSink, StepReporter
from prl.trainer.samples import synthetic_batch


def step_dir(parent: Path, step: int, complete: bool, trainer: bool = True) -> Path:
    path = parent / f"step_{step}"
    (path / "trainer" if trainer else path).mkdir(parents=True)
    if complete:
        (path / "COMPLETE").touch()
    return path


def test_synthetic_batch_follows_the_format(tmp_path):
    batch = synthetic_batch(3, world_size=2, micro_batches_per_rank=2, samples_per_micro_batch=3, seq_len=50, vocab_size=100)
    path = write_batch(RunDir(tmp_path), batch)
    assert path == tmp_path / "rollouts/step_3.pt" and not list(path.parent.glob(".*"))
    loaded = read_batch(RunDir(tmp_path), step=3, world_size=2)
    mb = loaded.micro_batches[1][0]
    assert mb["input_ids"].shape == mb["position_ids"].shape == mb["loss_mask"].shape == (1, 50)
    assert (mb["position_ids"][0] == 0).sum() == mb["num_samples"] == 3
    assert mb["loss_mask"].dtype == torch.bool
    assert (mb["behaviour_logprobs"][~mb["loss_mask"]] == 0).all()


@pytest.mark.parametrize(
    "step, world_size, edit, message",
    [
        (4, 2, None, "holds step 3, expected 4"),
        (3, 4, None, "micro-batches for 2 ranks, the trainer has 4"),
        (3, 2, lambda b: b.micro_batches[0].pop(), "different numbers of micro-batches"),
        (3, 2, lambda b: b.micro_batches[1][0].pop("advantages"), "without ['advantages']"),
    ],
)
def test_a_batch_that_breaks_the_contract_fails_on_load(tmp_path, step, world_size, edit, message):
    batch = synthetic_batch(3, 2, 2, 2, 16, 50)
    if edit:
        edit(batch)
    path = write_batch(RunDir(tmp_path), batch)
    path.rename(path.with_name(f"step_{step}.pt"))  # step 4: a file of step 3 in step 4's place
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_batch(RunDir(tmp_path), step, world_size)


def test_checkpoint_without_marker_does_not_exist(tmp_path):
    ckpts = tmp_path / "checkpoints"
    step_dir(ckpts, 2, complete=True)
    step_dir(ckpts, 4, complete=False)  # interrupted save
    step_dir(ckpts, 6, complete=False, trainer=False)  # a directory without the trainer's state
    assert complete_steps(RunDir(tmp_path)) == [2]
    assert newest_complete(RunDir(tmp_path)) == 2
    assert newest_complete(RunDir(tmp_path / "nowhere")) is None


def test_prune_checkpoints_keeps_the_newest_complete(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step in (1, 2, 3, 5):
        step_dir(ckpts, step, complete=True)
    step_dir(ckpts, 4, complete=False)
    step_dir(ckpts, 6, complete=False)  # a save in progress: never touched
    prune_checkpoints(RunDir(tmp_path), keep_last=2)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_3", "step_5", "step_6"]


def test_prune_weights_keeps_the_window_and_drops_leftovers_above(tmp_path):
    for step in range(1, 7):
        step_dir(tmp_path / "weights", step, complete=True, trainer=False)
    prune_weights(RunDir(tmp_path), newest=4, keep=2)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step_3", "step_4"]


def test_write_weights_replaces_a_previous_version_and_copies_metadata(tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        (source / name).write_text("{}")
    stale = step_dir(tmp_path / "run/weights", 2, complete=True, trainer=False)
    (stale / "junk").touch()
    (source / "tokenizer.json").chmod(0o644)  # a model directory others may read
    before = os.umask(0o077)  # the run's (prl.run.rundir.set_umask)
    try:
        out = write_weights({"w": torch.ones(2)}, source, RunDir(tmp_path / "run"), 2)
    finally:
        os.umask(before)
    assert sorted(p.name for p in out.iterdir()) == ["COMPLETE", "config.json", "model.safetensors", "tokenizer.json"]
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o600}  # the copies too: the run's, not the model's
    assert json.loads((out / "config.json").read_text()) == {"torch_dtype": "float32"}
    assert not list((tmp_path / "run/weights").glob(".*"))


def fsynced(monkeypatch) -> list[Path]:
    """Every path os.fsync is called on from now on."""
    synced, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(Path(os.readlink(f"/proc/self/fd/{fd}"))), real(fd)))
    return synced


def test_the_loop_publishes_a_version_without_fsync_and_a_checkpoint_makes_its_window_durable(tmp_path, monkeypatch):
    """A version of the RL loop is complete (readers load it) before anything is fsynced; make_durable,
    which the trainer calls before a checkpoint of step C, fsyncs every file and directory of the
    complete versions a resume from C loads, (C - keep, C], and nothing else."""
    source, rd = tmp_path / "model", RunDir(tmp_path / "run")
    source.mkdir()
    (source / "config.json").write_text("{}")
    synced = fsynced(monkeypatch)
    for step in range(1, 6):
        assert (write_weights({"w": torch.ones(2)}, source, rd, step, durable=False) / "COMPLETE").exists()
    assert synced == []
    step_dir(rd.weights, 6, complete=False, trainer=False)  # being written
    make_durable(rd, newest=4, keep=2)
    files = {p.relative_to(rd.weights) for p in synced if p.is_relative_to(rd.weights) and p.is_file()}
    assert files == {Path(f"step_{s}/{name}") for s in (3, 4) for name in ("COMPLETE", "config.json", "model.safetensors")}
    assert {rd.weights_dir(3), rd.weights_dir(4), rd.weights} <= set(synced)  # their directories and names too
    assert not any(p.is_relative_to(rd.weights_dir(s)) for p in synced for s in (1, 2, 5, 6))


def config(tmp_path: Path, mode: str, **wandb) -> Config:
    return Config(
        run=RunConfig(name="run", output_dir=str(tmp_path), wandb=WandbConfig(mode=mode, **wandb)),
        model=ModelConfig(name="model"),
        orchestrator=OrchestratorConfig(environment=EnvironmentConfig(id="x"), batch_size=8, rollouts_per_example=4),
    )


METRICS = {"train/loss": 0.5, "train/entropy": 1.0, "train/grad_norm": 0.1, "train/mismatch_kl": 0.0,
           "train/clip_fraction": 0.0, "perf/tokens_per_s": 10.0, "train/lr": 1e-3, "perf/wait_s": 0.0}


def test_the_background_writer_times_a_write_when_the_caller_waits_for_it_not_when_it_ends():
    """perf/publish_s is the write save_weights waited for: a write that ended before then (a tiny
    model's, in CI) must not show up a step early, at the launch's first step (seen in CI at 8058fb5)."""
    writer, ended = BackgroundWriter(), threading.Event()
    writer.submit(ended.set)
    assert ended.wait(10)
    time.sleep(0.2)  # the write's thread is long done
    assert writer.last_s is None  # finished, not waited for: nothing to report yet
    writer.wait()
    first = writer.last_s
    assert first is not None and first >= 0
    writer.wait()  # nothing pending: the last timing stays
    assert writer.last_s == first
    writer.submit(time.sleep, 0.05)
    assert writer.last_s == first  # submit waits for the previous write only
    writer.wait()
    assert writer.last_s >= 0.05


def test_wandb_run_id_is_kept_and_reused_by_the_next_attempt(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    ids = []
    for attempt in (1, 2):
        monkeypatch.setenv("PRL_LOG_DIR", str(run / f"logs/attempt_{attempt}"))
        reporter = StepReporter(config(tmp_path, "offline"), RunDir(run), rank=0)
        reporter.report(attempt, METRICS)
        reporter.finish()
        ids.append(reporter.sink.run.id)
        assert json.loads((run / f"logs/attempt_{attempt}/trainer/metrics.jsonl").read_text())["step"] == attempt
    assert ids[0] == ids[1] == (run / "wandb_id").read_text().strip()
    assert any((run / "wandb").glob(f"offline-run-*-{ids[0]}"))


def test_wandb_shows_a_sample_of_what_the_model_wrote(tmp_path, monkeypatch):
    """The orchestrator's completions file of the step (written before its batch), as the table
    `completions` in the real offline W&B run: 4 of 16 rollouts, over groups and positions."""
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    monkeypatch.setenv("PRL_LOG_DIR", str(run / "logs/attempt_0"))
    records = [{"step": 3, "example_id": 10 + i // 4, "group": i // 4, "rollout": i % 4,
                "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{i}"}],
                "completion": [{"role": "assistant", "content": f"a{i} é"}], "reward": None if i == 5 else 1.0,
                "advantage": None if i == 5 else 0.5, "metrics": {}, "error": "E: x" if i == 5 else None,
                "trained": i != 5, "dropped": "errored" if i == 5 else None} for i in range(16)]
    (run / "rollouts/step_3.completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    reporter = StepReporter(config(tmp_path, "offline", completions_per_step=4), RunDir(run), rank=0)
    reporter.report(3, METRICS)
    reporter.report(4, METRICS)  # no completions file: no table
    reporter.finish()
    (table,) = run.glob("wandb/offline-run-*/files/media/table/completions_*.table.json")
    logged = json.loads(table.read_text())
    assert logged["columns"] == ["step", "example_id", "group", "rollout", "prompt", "completion", "reward",
                                 "advantage", "trained", "dropped", "error"]
    assert [(row[2], row[3]) for row in logged["data"]] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert logged["data"][0][4:6] == ["[system] Be brief.\n\n[user] q0", "[assistant] a0 é"]
    assert logged["data"][1][6:] == [None, None, False, "errored", "E: x"]


def test_disabled_wandb_and_other_ranks_log_nothing(tmp_path):
    assert isinstance(StepReporter(config(tmp_path, "disabled"), RunDir(tmp_path), rank=0).sink, NullSink)
    assert isinstance(StepReporter(config(tmp_path, "offline"), RunDir(tmp_path), rank=1).sink, NullSink)
    assert not (tmp_path / "wandb_id").exists()


class _Planted:
    """What a writable checkpoint directory could be given: an object whose unpickling runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_rng_files_load_weights_only_old_and_new_and_refuse_code(tmp_path):
    import pickle
    import random

    import numpy as np

    from prl.trainer.ckpt import load_rng_file, rng_state, set_rng_state

    np.random.seed(5)
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(old, tmp_path / "old.pt")  # numpy's state as an array: rng files before this format
    torch.save(rng_state(), tmp_path / "new.pt")
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    for name in ("old.pt", "new.pt"):
        set_rng_state(load_rng_file(tmp_path / name))
        assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == first
    torch.save({"python": _Planted(tmp_path / "ran")}, tmp_path / "planted.pt")
    with pytest.raises(pickle.UnpicklingError):
        load_rng_file(tmp_path / "planted.pt")
    assert not (tmp_path / "ran").exists()
