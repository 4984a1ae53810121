"""A verifiers v1 environment (`api: v1`, docs/environments.md) through a whole local run: the toy task
as a v1 package (environments/prl_toy_v1) in its environment worker under .venv-v1, played by an episode
of two agents (prl_toy_duo: a writer who answers a scripted user twice, an editor who rewrites the
writer's reply), sampled by the tiny Qwen3 through verifiers' TrainClient (renderers' Qwen3 renderer)
and vLLM's /inference/v1/generate, each seat's trace a sample with its seat's baseline, trained on.
The same run's online evals play a v1 environment with a tool (environments/prl_calc_v1, docs/tools.md):
its MCP server in the worker's Python, the calls parsed from the sampled tokens by the renderer.

    pytest tests/integration/test_v1_envs.py

Needs .venv-v1 (bash tools/setup.sh): skipped without it on a contributor's machine, failed in CI.
"""

import json
import math
import os
import re
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
    # The calculator is an eval environment: one seat cannot share training steps with the duo's two
    # (prl.orchestrator.dataset.load_train_envs), and a second run would cost a minute of CI. Its prompt
    # (the tool's schema in Qwen3's system block) is ~490 tokens; a call ~52.
    calc = (f"{{id: prl_calc_v1, api: v1, python: {v1_python}, args: {{hermes_format: {tiny_model_dir('qwen3')}}}, "
            "renderer: {name: qwen3, enable_thinking: false}}")
    return v1_local(tmp_path_factory.mktemp("toy_v1"), v1_python, f"run.max_steps={STEPS}", "orchestrator.batch_size=16",
                    "orchestrator.rollouts_per_example=4", "orchestrator.max_concurrent=16",
                    "orchestrator.environment.env=prl_toy_duo", "model.max_model_len=1024",
                    f"orchestrator.eval.interval={STEPS}", f"orchestrator.eval.environments=[{calc}]",
                    "orchestrator.eval.num_examples=8", "orchestrator.eval.rollouts_per_example=2",
                    "orchestrator.eval.sampling.max_tokens=64")


def test_a_v1_environment_trains_on_its_sampled_tokens(v1_run):
    """Every step completes on rollouts the worker ran: almost none errored, none dropped for tokens
    that do not continue the prompt (the renderer bridged the scripted user's turn onto the sampled
    ids: each trace one token sequence), a sample per seat's trace, each seat's advantages centred on
    that seat's own rewards in its group."""
    steps = metrics(v1_run, 0)
    assert [m["step"] for m in steps] == list(range(STEPS))
    for m in steps:  # 4 examples x 4 episodes x 2 seats
        assert m["rollout/rollouts"] == 32 and m["rollout/error_frac"] <= 2 / 32, m
        assert m["rollout/dropped/prompt_mismatch"] == 0 and m["rollout/dropped/no_tokens"] == 0, m
        assert m["rollout/samples"] >= 28 and m["rollout/completion_len_mean"] > 0, m
        assert 0.0 <= m["env/prl_toy_v1/reward_mean"] <= 1.0 and m["env/prl_toy_v1/rollouts"] == 32, m
        assert all(0.0 <= m[f"env/prl_toy_v1/seat/{seat}/reward_mean"] <= 1.0 for seat in ("writer", "editor")), m
        assert math.isfinite(m["train/loss"]), m
    rows = [json.loads(line) for line in (v1_run / "rollouts/step_0.completions.jsonl").read_text().splitlines()]
    assert len(rows) == 32 and sum(row["error"] is not None for row in rows) <= 2, rows[:2]
    writer = [row for row in rows if row["seat"] == "writer"]
    editor = [row for row in rows if row["seat"] == "editor"]
    assert len(writer) == len(editor) == 16, rows[:2]
    assert all(row["prompt"][-1] == {"role": "user", "content": f"Write some text. ({row['example_id']})"}
               for row in writer), writer[:2]
    # Two turns: the reply, the scripted user's follow-up, the second reply (an episode whose first reply
    # ended at the length limit ends there).
    two = [row for row in writer if [m["role"] for m in row["completion"]] == ["assistant", "user", "assistant"]]
    assert len(two) >= 4 and all(row["completion"][1]["content"] == "Write some more." for row in two), writer[:2]
    assert all(row["prompt"][-1]["content"].startswith("Rewrite this text:") for row in editor), editor[:2]
    for group in {row["group"] for row in rows}:
        for seat in (writer, editor):
            scored = [row for row in seat if row["group"] == group and row["error"] is None]
            mean = sum(row["reward"] for row in scored) / len(scored)
            assert all(row["advantage"] == pytest.approx(row["reward"] - mean, abs=1e-9) for row in scored), scored


CALL = re.compile(r'\{"a": (\d+), "b": (\d+)\}')


def test_a_v1_environment_with_a_tool_calls_it_and_continues_from_the_sampled_ids(v1_run):
    """The evals of versions 0 and 2 on prl_calc_v1 (each turn held to a call of calc_add or an answer):
    no episode errors, the model calls the tool, every call's result (a + b, from the toolset's MCP
    server in the worker's Python) follows it in the completions file, and the model speaks again after
    it; every trace is one token sequence (one branch: each turn continued from the ids before it,
    nothing that training would drop as prompt_mismatch)."""
    for version in (0, STEPS):
        record = json.loads((v1_run / f"evals/step_{version}.json").read_text())
        calc = record["environments"]["prl_calc_v1"]
        assert calc["rollouts"] == 16 and calc["error_frac"] == 0 and calc["metric/branches"] == 1.0, calc
        assert calc["metric/tool_calls"] >= 0.25, calc
        rows = [json.loads(line) for line in (v1_run / f"evals/step_{version}.completions.jsonl").read_text().splitlines()]
        calls = 0
        for row in rows:
            messages = row["completion"]
            # The last reply may be a call: prl_chat's max_turns (4) left no turn to show its result to.
            for i, message in enumerate(messages[:-1]):
                for call in message.get("tool_calls") or []:
                    a, b = map(int, CALL.fullmatch(call["function"]["arguments"]).groups())
                    result = messages[i + 1]
                    assert result["role"] == "tool" and result["content"] == str(a + b), row
                    calls += 1
                if message["role"] == "tool":
                    assert messages[i + 1]["role"] == "assistant", row  # the model went on
        assert calls >= 4, rows[:2]
