"""A verifiers v1 environment (`api: v1`, docs/environments.md) through a whole local run: the toy task
as a v1 package (environments/prl_toy_v1) in its environment worker under .venv-v1, two turns of a
scripted user, sampled by the tiny Qwen3 through verifiers' TrainClient (renderers' Qwen3 renderer) and
vLLM's /inference/v1/generate, trained on by the trainer.

    pytest tests/integration/test_v1_envs.py

Needs .venv-v1 (bash tools/setup.sh): skipped without it on a contributor's machine, failed in CI.
"""

import json
import math
import os
import subprocess
import sys

import pytest
from helpers import ROOT, metrics, tiny_model_dir

from prl.run.home import env_worker_python
from prl.run.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOY_V1 = ROOT / "configs/toy_v1.yaml"
STEPS = 2


@pytest.fixture(scope="module")
def v1_python() -> str:
    python = env_worker_python(".venv-v1/bin/python")
    if not os.access(python, os.X_OK):
        message = f"{python} is missing: bash tools/setup.sh makes .venv-v1"
        if os.environ.get("CI") == "true":  # .ci/run: a missing venv is setup's failure, not a reason to skip
            pytest.fail(message)
        pytest.skip(message)
    return python


def v1_local(base, python: str, *overrides: str):
    """`prl submit configs/toy_v1.yaml --local` in `base` on the tiny model; its run directory."""
    args = [sys.executable, "-m", "prl.control.cli", "submit", str(TOY_V1), "--local", f"run.output_dir={base}",
            f"model.name={tiny_model_dir('qwen3')}", f"inference.port={free_port()}", "trainer.checkpoint.interval=0",
            f"orchestrator.environment.python={python}", *overrides]
    proc = subprocess.Popen(args, cwd=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # SIGTERM: `prl submit --local` takes its components down with it
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"the run did not end within 300 s:\n{out[-8000:]}")
    assert proc.returncode == 0, out[-8000:]
    return base / "toy_v1"


@pytest.fixture(scope="module")
def v1_run(tmp_path_factory, v1_python):
    return v1_local(tmp_path_factory.mktemp("toy_v1"), v1_python, f"run.max_steps={STEPS}", "orchestrator.batch_size=16",
                    "orchestrator.rollouts_per_example=4", "orchestrator.max_concurrent=16")


def test_a_v1_environment_trains_on_its_sampled_tokens(v1_run):
    """Every step completes on rollouts the worker ran: almost none errored, none dropped for tokens
    that do not continue the prompt (the renderer bridged the scripted user's turn onto the sampled
    ids: each episode one token sequence), rewards per environment."""
    steps = metrics(v1_run, 0)
    assert [m["step"] for m in steps] == list(range(STEPS))
    for m in steps:
        assert m["rollout/rollouts"] == 16 and m["rollout/error_frac"] <= 1 / 16, m
        assert m["rollout/dropped/prompt_mismatch"] == 0 and m["rollout/dropped/no_tokens"] == 0, m
        assert m["rollout/samples"] >= 15 and m["rollout/completion_len_mean"] > 0, m
        assert 0.0 <= m["env/prl_toy_v1/reward_mean"] <= 1.0 and m["env/prl_toy_v1/rollouts"] == 16, m
        assert math.isfinite(m["train/loss"]), m
    lines = (v1_run / "rollouts/step_0.completions.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 16 and all(row["error"] is None for row in rows), rows[:2]
    assert all(row["prompt"][-1] == {"role": "user", "content": f"Write some text. ({row['example_id']})"}
               for row in rows), rows[:2]
    # Two turns: the reply, the scripted user's follow-up, the second reply (an episode whose first reply
    # ended at the length limit ends there).
    two = [row for row in rows if [m["role"] for m in row["completion"]] == ["assistant", "user", "assistant"]]
    assert len(two) >= 8 and all(row["completion"][1]["content"] == "Write some more." for row in two), rows[:2]
    assert sum(bool(row["completion"][-1]["content"]) for row in rows) >= 12, rows
