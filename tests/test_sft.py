"""The SFT job end to end on the tiny model: `prl submit configs/sft_toy.yaml --local` (the trainer
alone), an RL run started from its weights, and the same job on the Slurm test cluster preempted by
USR1, requeued and resumed to the same losses.

    pytest -m slow tests/test_sft.py
"""

import json
from pathlib import Path

import pytest

from helpers import ROOT, final_state, job_log, losses, losses_by_attempt, metrics, prl, submitted_job, wait_for

from prl.control import slurm

SFT = ROOT / "configs/sft_toy.yaml"
STEPS = 12
# One thread a rank in both modes: the same arithmetic locally and on the cluster (whose nodes share
# this machine's cores), so the losses can be compared exactly.
COMMON = [f"model.name={ROOT / '.cache/tiny-qwen2'}", f"run.max_steps={STEPS}", "trainer.checkpoint.interval=4",
          "trainer.env.OMP_NUM_THREADS=1"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("sft")
    r = prl("submit", str(SFT), "--local", f"run.output_dir={base}", *COMMON, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return base / "sft-toy"


def test_sft_learns_the_answers_and_writes_weights_an_rl_config_can_name(sft_run):
    steps = metrics(sft_run, 0)
    assert [m["step"] for m in steps] == list(range(STEPS))
    loss = [m["train/loss"] for m in steps]
    print(f"\nSFT loss per step: {[round(x, 3) for x in loss]}")
    assert sum(loss[-3:]) / 3 < 0.6 * sum(loss[:3]) / 3
    assert all(m["train/loss_tokens"] > 0 and m["sft/truncated"] == 0 for m in steps)
    assert steps[-1]["sft/epoch"] == STEPS * 32 / 256
    assert sorted(p.parent.name for p in sft_run.glob("checkpoints/step_*/COMPLETE")) == ["step_12", "step_8"]  # keep_last 2
    weights = sft_run / f"weights/step_{STEPS}"
    assert (weights / "COMPLETE").exists() and (weights / "tokenizer.json").exists()
    assert sorted(p.name for p in (sft_run / "logs/attempt_0").iterdir() if p.is_dir()) == ["trainer"]
    status = prl("status", str(sft_run))
    assert status.returncode == 0 and "loss:" in status.stdout and f"step {STEPS}/{STEPS}" in status.stdout, status.stdout
    shown = prl("watch", str(sft_run), "--once")  # one pane: the trainer's
    assert "trainer" in shown.stdout and "inference" not in shown.stdout and "orchestrator" not in shown.stdout
    refused = prl("eval", str(sft_run), "--local")  # no orchestrator.eval: it says so instead of failing later
    assert refused.returncode == 2 and "is an SFT job" in refused.stderr, refused.stderr


@pytest.mark.vllm
def test_an_rl_run_starts_from_the_sft_weights(sft_run, tmp_path):
    """The toy RL run with model.name = the SFT job's last weights: its first rollouts already answer
    in vowels (the base model's score about 0.27 at step 0, tests/test_e2e_local.py)."""
    from test_e2e_local import prl_local, finish

    weights = sft_run / f"weights/step_{STEPS}"
    proc = prl_local(tmp_path, f"model.name={weights}", "run.max_steps=1", "orchestrator.batch_size=16")
    rc, out = finish(proc)
    assert rc == 0, out
    first = metrics(tmp_path / "toy", 0)[0]
    rows = [json.loads(line) for line in (tmp_path / "toy/rollouts/step_0.completions.jsonl").read_text().splitlines()]
    print(f"\nRL from SFT weights: step 0 reward {first['rollout/reward_mean']:.3f}; e.g. {rows[0]['completion']!r}")
    assert first["rollout/reward_mean"] > 0.6


@pytest.mark.slurm
def test_an_sft_job_preempted_on_the_cluster_requeues_and_resumes_to_the_same_losses(sft_run, tmp_path, slurm_cluster):
    r = prl("submit", str(SFT), f"run.output_dir={tmp_path}", *COMMON, "slurm.time=00:10:00", cwd=tmp_path)
    job_id, run = submitted_job(r), tmp_path / "sft-toy"
    wait_for(lambda: len(metrics(run, 0)) >= 2, 300, "two SFT steps")
    slurm.scancel([job_id], signal="USR1", batch=True)
    st = final_state(job_id)
    assert st.state == "COMPLETED", job_log(run, 1) if (run / "logs/attempt_1").exists() else job_log(run)
    assert "requeueing job" in job_log(run, 0)
    done = losses_by_attempt(run)
    assert set(done) == {0, 1} and min(done[1]) == max(done[0]) + 1, done  # resumed at the step boundary
    assert losses(run) == losses(sft_run)  # exact: the data order is a function of the step
    assert (run / f"weights/step_{STEPS}/COMPLETE").exists()
