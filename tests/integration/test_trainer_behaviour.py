"""trainer.behaviour_logprobs=recompute under torchrun (gloo, CPU, 2 ranks, async_level 1): the
behaviour logprobs of batch n are those of version n - 1's weights, kept by the trainer, and a run
resumed from a checkpoint recomputes them exactly (prl.trainer.behaviour). Batch 1 has no loss token
(every group filtered): its step is skipped, yet version 1, which generates batch 2, is kept."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from prl.run.batch import Batch, policy_version, write_batch
from prl.config import (
    CheckpointConfig, Config, EnvironmentConfig, LossConfig, ModelConfig, OrchestratorConfig, RunConfig,
    TrainerConfig, WandbConfig, load_config, to_yaml,
)
from prl.run.packing import pack_batch
from prl.run.protocol import PREEMPTED, RANK_EXIT_PREEMPTED, STOP_REQUEST
from prl.run.rundir import RunDir
from prl.trainer.loss import PolicyLoss
from prl.trainer.model import PolicyModel
from test_trainer_run import STEPS, finish, global_batch, metrics, start, trainer_params

ASYNC = 1


def batch(step: int) -> Batch:
    """The trainer-run batches, generated (as the orchestrator would say) by version step - 1; the
    logprobs vLLM would have sent are absent: recompute mode writes zeros. Batch 1: padding only."""
    out = dataclasses.replace(global_batch(step, 2), policy_version=policy_version(step, ASYNC))
    if step == 1:
        out.micro_batches = pack_batch([], 2, 8)
    for mbs in out.micro_batches:
        for mb in mbs:
            mb["behaviour_logprobs"] = torch.zeros_like(mb["behaviour_logprobs"])
    return out


def make_run(root: Path, model: Path, steps: range) -> Path:
    cfg = Config(
        run=RunConfig(name="run", output_dir=str(root), max_steps=STEPS, seed=3, async_level=ASYNC,
                      wandb=WandbConfig(mode="disabled")),
        model=ModelConfig(name=str(model), dtype="float32"),
        trainer=TrainerConfig(nodes=2, gpus_per_node=0, lr=1e-3, behaviour_logprobs="recompute",
                              checkpoint=CheckpointConfig(interval=2, keep_last=2)),
        orchestrator=OrchestratorConfig(environment=EnvironmentConfig(id="prl.envs.toy"), batch_size=8,
                                        rollouts_per_example=4),
    )
    run = root / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(cfg))
    for step in steps:
        write_batch(RunDir(run), batch(step))
    return run


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model) -> Path:
    run = make_run(tmp_path_factory.mktemp("recompute"), tiny_model, range(STEPS))
    rc, out = finish(start(run, 2, attempt=1))
    assert rc == 0, out
    return run


def policy(tiny_model: Path, state: dict[str, torch.Tensor]) -> PolicyModel:
    causal_lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    causal_lm.load_state_dict(state, strict=False)  # the tied LM head is not a key of its own
    return PolicyModel(causal_lm).eval()


def test_step_zero_is_on_policy_and_later_steps_use_the_previous_version(uninterrupted, tiny_model, tmp_path):
    steps = metrics(uninterrupted, 1)
    assert [m["step"] for m in steps] == list(range(STEPS))
    # Batch 0 came from version 0, the model's own weights: ratio exactly 1.
    assert steps[0]["train/mismatch_kl"] == 0.0 and steps[0]["train/clip_fraction"] == 0.0
    assert steps[1]["train/skipped"] == 1.0  # batch 1: no loss token
    # Batch 2 came from version 1, kept through the skipped step, which left it equal to version 2.
    assert steps[2]["train/mismatch_kl"] == 0.0 and steps[3]["train/mismatch_kl"] > 0
    # The recompute's share of each step that trained, timed within the step. That step 3 ran a
    # forward of its own is the loss check below; comparing its milliseconds with step 0's (a copy
    # alone, 15x shorter here) would fail whenever a loaded 2-core machine descheduled the copy.
    assert all(0 < m["perf/behaviour_s"] < m["perf/train_s"] for m in steps if not m.get("train/skipped")), steps
    # Step 3's loss from outside the trainer: version 3's logprobs (its exported weights) over
    # version 2's (checkpoint step_2), on the step's whole batch.
    current = policy(tiny_model, load_file(uninterrupted / "weights/step_3/model.safetensors"))
    previous = policy(tiny_model, trainer_params(uninterrupted, 2, tmp_path))
    loss_fn = PolicyLoss(LossConfig())
    micro_batches = [mb for mbs in batch(3).micro_batches for mb in mbs]
    total = sum(int(mb["loss_mask"].sum()) for mb in micro_batches)
    stats = 0.0
    with torch.no_grad():
        for mb in micro_batches:
            logprobs, entropy = current(mb["input_ids"], mb["position_ids"])
            old, _ = previous(mb["input_ids"], mb["position_ids"])
            stats = stats + loss_fn(logprobs, entropy, mb | {"behaviour_logprobs": old * mb["loss_mask"]}, total)[1]
    want = loss_fn.metrics(stats)
    for key in ("loss", "mismatch_kl", "entropy"):
        assert steps[3][f"train/{key}"] == pytest.approx(want[key], rel=1e-4, abs=1e-9), key


def test_a_resumed_run_recomputes_the_same_behaviour_logprobs(uninterrupted, tiny_model, tmp_path):
    """Stopped after checkpoint step 2 (the trainer waiting for batch 2), then resumed: version 1,
    which generated batch 2, comes back from the checkpoint, and steps 2 and 3 match exactly."""
    run = make_run(tmp_path, tiny_model, range(2))
    proc = start(run, 2, attempt=1)
    deadline = time.monotonic() + 180
    while not (run / "checkpoints/step_2/COMPLETE").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    (run / "logs/attempt_1" / STOP_REQUEST).write_text("test\n")
    rc, out = finish(proc)
    assert f"exitcode  : {RANK_EXIT_PREEMPTED}" in out and (run / "logs/attempt_1" / PREEMPTED).exists(), out
    for step in range(2, STEPS):
        write_batch(RunDir(run), batch(step))
    rc, out = finish(start(run, 2, attempt=2))
    assert rc == 0, out
    for got, want in zip(metrics(run, 2), metrics(uninterrupted, 1)[2:], strict=True):
        for key in ("train/loss", "train/mismatch_kl", "train/clip_fraction", "train/grad_norm"):
            assert got[key] == want[key], (got["step"], key)
    final, ref = (load_file(r / f"weights/step_{STEPS}/model.safetensors") for r in (run, uninterrupted))
    assert all(torch.equal(final[k], ref[k]) for k in ref)


def test_a_checkpoint_without_the_needed_versions_is_refused_naming_the_key(uninterrupted, tmp_path):
    """Resumed at step 4 with async_level 2, batches 4 and 5 need versions 2 and 3; the checkpoint,
    written at async_level 1, holds version 3 only."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run, ignore=shutil.ignore_patterns("logs"))
    cfg = load_config(run / "config.yaml")
    cfg.run.async_level, cfg.run.max_steps = 2, STEPS + 2
    (run / "config.yaml").write_text(to_yaml(cfg))
    rc, out = finish(start(run, 2, attempt=1))
    assert rc != 0
    assert "ValueError: step_4 holds no weights of policy versions [2]" in out, out
    assert "set trainer.behaviour_logprobs=inference to resume from it" in out, out
