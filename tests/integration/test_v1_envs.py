"""A verifiers v1 environment (`api: v1`, docs/environments.md) through a whole local run: the toy task
as a v1 package (environments/prl_toy_v1) under .venv-v1, played by an episode of two agents
(prl_toy_duo: a writer who answers a scripted user twice, an editor who rewrites the writer's reply),
sampled by the tiny Qwen3 through verifiers' TrainClient (renderers' Qwen3 renderer) and vLLM's
/inference/v1/generate, each seat's trace a sample with its seat's baseline, trained on. The run trains
on two entries of it: `worker` plays its episodes in the environment worker, `served` in verifiers v1's
environment server (server_workers: 2, the run's `envserver` component). The same run's online evals play
a v1 environment with a tool (environments/prl_calc_v1, docs/tools.md): its MCP server in the worker's
Python, the calls parsed from the sampled tokens by the renderer. A second, shorter run kills the
server with SIGKILL: the run ends, naming it, and leaves no process and no socket behind.

    pytest tests/integration/test_v1_envs.py

Needs .venv-v1 (bash tools/setup.sh): skipped without it on a contributor's machine, failed in CI.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, metrics, tiny_model_dir

from prl.run import protocol
from prl.run.home import env_worker_python
from prl.run.ports import free_port
from prl.run.procs import alive, descendants

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


def submit(base, *overrides: str) -> subprocess.Popen:
    """`prl submit configs/toy_v1.yaml --local` in `base` on the tiny model."""
    args = [sys.executable, "-m", "prl.control.cli", "submit", str(TOY_V1), "--local", f"run.output_dir={base}",
            f"model.name={tiny_model_dir('qwen3')}", f"inference.port={free_port()}", "trainer.checkpoint.interval=0",
            *overrides]
    return subprocess.Popen(args, cwd=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def v1_local(base, python: str, *overrides: str):
    """`prl submit configs/toy_v1.yaml --local` in `base`, run to its end; its run directory."""
    proc = submit(base, f"orchestrator.environment.python={python}", *overrides)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # SIGTERM: `prl submit --local` takes its components down with it
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"the run did not end within 300 s:\n{out[-8000:]}")
    assert proc.returncode == 0, out[-8000:]
    return base / "toy_v1"


def duo(name: str, python: str, server_workers: int = 0) -> str:
    """An entry of prl_toy_duo, two turns, in flow YAML for `orchestrator.environments`."""
    return (f"{{id: prl_toy_v1, api: v1, name: {name}, env: prl_toy_duo, python: '{python}', args: {{turns: 2}}, "
            f"renderer: {{name: qwen3, enable_thinking: false}}, server_workers: {server_workers}}}")


@pytest.fixture(scope="module")
def v1_run(tmp_path_factory, v1_python):
    # The calculator is an eval environment: one seat cannot share training steps with the duo's two
    # (prl.orchestrator.dataset.load_train_envs), and a second run would cost a minute of CI. Its prompt
    # (the tool's schema in Qwen3's system block) is ~490 tokens; a call ~52.
    calc = (f"{{id: prl_calc_v1, api: v1, python: {v1_python}, args: {{hermes_format: {tiny_model_dir('qwen3')}}}, "
            "renderer: {name: qwen3, enable_thinking: false}}")
    return v1_local(tmp_path_factory.mktemp("toy_v1"), v1_python, f"run.max_steps={STEPS}", "orchestrator.batch_size=16",
                    "orchestrator.rollouts_per_example=4", "orchestrator.max_concurrent=16",
                    "orchestrator.environment=null",
                    f"orchestrator.environments=[{duo('worker', v1_python)},{duo('served', v1_python, 2)}]",
                    "model.max_model_len=1024",
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
        for name in ("worker", "served"):  # 2 examples each
            assert 0.0 <= m[f"env/{name}/reward_mean"] <= 1.0 and m[f"env/{name}/rollouts"] == 16, m
            assert all(0.0 <= m[f"env/{name}/seat/{seat}/reward_mean"] <= 1.0 for seat in ("writer", "editor")), m
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
    # The `served` entry's episodes ran in the envserver, a pool of 2 workers on a socket of its own.
    for m in steps:
        assert m["env/served/error_frac"] <= 1 / 16 and m["env/worker/error_frac"] <= 1 / 16, m
    attempt = v1_run / "logs/attempt_0"
    assert list(json.loads((attempt / protocol.ENV_SERVERS).read_text())) == ["orchestrator.environments[1]"]
    log = (attempt / "envserver/local.out").read_text()
    assert "EnvServerPool up" in log and "workers=2/2" in log and "exited with 0" in log, log[-3000:]


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


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def test_a_killed_environment_server_ends_the_run_and_leaves_nothing(tmp_path, v1_python):
    """SIGKILL to the environment server (the v1 process that holds the socket) once it listens: the run
    ends with the envserver's status (18), naming it; none of the run's processes (its pool workers
    included) is left, and its socket directory is gone."""
    proc = submit(tmp_path, f"orchestrator.environment.python={v1_python}", "orchestrator.environment.server_workers=2")
    marker = tmp_path / "toy_v1/logs/attempt_0" / protocol.ENV_SERVERS
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert marker.exists(), proc.communicate(timeout=60)[0][-8000:] if proc.poll() is not None else "no env_servers"
        server = [pid for pid, _ in descendants(proc.pid) if "prl.orchestrator.v1server" in cmdline(pid)]
        assert len(server) == 1, descendants(proc.pid)
        while len([p for p, _ in descendants(server[0]) if "spawn_main" in cmdline(p)]) < 2 and proc.poll() is None:
            time.sleep(0.2)  # the pool's two workers, spawned once the server runs
        tree = descendants(proc.pid)
        os.kill(server[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=60)
    assert proc.returncode == protocol.BY_NAME["envserver"].exit_code, out[-8000:]
    attempt = tmp_path / "toy_v1/logs/attempt_0"
    assert (attempt / protocol.FAILED).read_text().startswith("envserver failed with exit status 137"), out[-3000:]
    assert len(tree) >= 8 and alive(tree) == [], (tree, alive(tree))  # vLLM, torchrun, the workers, the pool
    socket = json.loads(marker.read_text())["orchestrator.environment"].removeprefix("ipc://")
    assert not os.path.exists(os.path.dirname(socket)), socket
