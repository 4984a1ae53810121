"""A verifiers v1 environment (`api: v1`, docs/environments.md) through a whole local run: the toy task
as a v1 package (environments/prl_toy_v1) under .venv-v1, played by an episode of two agents
(prl_toy_duo: a writer who answers a scripted user twice, an editor who rewrites the writer's reply),
sampled by the tiny Qwen3 through verifiers' TrainClient (renderers' Qwen3 renderer) and vLLM's
/inference/v1/generate, each seat's trace a sample with its seat's baseline, trained on. The run trains
on two entries of it: `worker` plays its episodes in the environment worker, `served` in verifiers v1's
environment server (server_workers: 2, the run's `envserver` component); and, in the same steps, on a v1
environment of one seat with a tool (environments/prl_calc_v1, docs/tools.md: its MCP server in the
worker's Python, the calls parsed from the sampled tokens by the renderer), whose groups are half the
duo's size. The same run's online evals play the calculator's held-out split. A second, shorter run
kills the server with SIGKILL: the run ends, naming it, and leaves no process and no socket behind.

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
from helpers import NO_WANDB, ROOT, metrics, tiny_model_dir

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
            NO_WANDB, *overrides]
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
    # The calculator trains beside the duo (groups of 4 rollouts beside the duo's 4 x 2 seats: 2 examples
    # each of 6 a step) and is the evals' environment (the same entry: its worker serves both). Its prompt (the tool's schema in Qwen3's system
    # block) is ~490 tokens; a call ~52, hence its own max_tokens of 64; the duo's turns keep the run's 16.
    calc = (f"{{id: prl_calc_v1, api: v1, name: calc, python: {v1_python}, max_tokens: 64, "
            f"args: {{hermes_format: {tiny_model_dir('qwen3')}}}, renderer: {{name: qwen3, enable_thinking: false}}}}")
    return v1_local(tmp_path_factory.mktemp("toy_v1"), v1_python, f"run.max_steps={STEPS}", "orchestrator.batch_size=24",
                    "orchestrator.rollouts_per_example=4", "orchestrator.max_concurrent=24",
                    "orchestrator.environment=null", "orchestrator.sampling.max_tokens=16",
                    f"orchestrator.environments=[{duo('worker', v1_python)},{duo('served', v1_python, 2)},{calc}]",
                    "model.max_model_len=1024",
                    f"orchestrator.eval.interval={STEPS}", f"orchestrator.eval.environments=[{calc}]",
                    "orchestrator.eval.num_examples=8", "orchestrator.eval.rollouts_per_example=2")


def test_a_v1_environment_trains_on_its_sampled_tokens(v1_run):
    """Every step completes on rollouts the worker ran: almost none errored, none dropped for tokens
    that do not continue the prompt (the renderer bridged the scripted user's turn onto the sampled
    ids: each trace one token sequence), a sample per seat's trace, each seat's advantages centred on
    that seat's own rewards in its group."""
    steps = metrics(v1_run, 0)
    assert [m["step"] for m in steps] == list(range(STEPS))
    for m in steps:  # the duo's 4 examples x 4 episodes x 2 seats, the calculator's 2 x 4 rollouts
        assert m["rollout/rollouts"] == 40 and m["rollout/error_frac"] <= 2 / 40, m
        assert m["rollout/dropped/prompt_mismatch"] == 0 and m["rollout/dropped/no_tokens"] == 0, m
        assert m["rollout/samples"] >= 28 and m["rollout/completion_len_mean"] > 0, m
        for name in ("worker", "served"):  # 2 examples each
            assert 0.0 <= m[f"env/{name}/reward_mean"] <= 1.0 and m[f"env/{name}/rollouts"] == 16, m
            assert all(0.0 <= m[f"env/{name}/seat/{seat}/reward_mean"] <= 1.0 for seat in ("writer", "editor")), m
        assert math.isfinite(m["train/loss"]), m
    rows = [json.loads(line) for line in (v1_run / "rollouts/step_0.completions.jsonl").read_text().splitlines()]
    assert len(rows) == 40 and sum(row["error"] is not None for row in rows) <= 2, rows[:2]
    assert [row["environment"] for row in rows] == ["worker"] * 16 + ["served"] * 16 + ["calc"] * 8, rows[:2]
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
    for group in {row["group"] for row in writer}:
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


def batch_samples(run: Path, step: int) -> list[tuple[list[int], list[bool]]]:
    """Batch `step`'s samples as the trainer reads them: (token ids, loss mask) each, cut from the packed
    micro-batches where the positions start again at 0."""
    from prl.run.batch import read_batch
    from prl.run.rundir import RunDir

    samples = []
    for rank in read_batch(RunDir(run), step).micro_batches:
        for mb in rank:
            if not mb["num_samples"]:
                continue
            ids, mask, positions = (mb[k][0].tolist() for k in ("input_ids", "loss_mask", "position_ids"))
            starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
            samples += [(ids[a:b], mask[a:b]) for a, b in zip(starts, starts[1:])]
    return samples


def contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_a_one_seat_environment_with_a_tool_trains_beside_the_two_seat_one(v1_run):
    """The calculator's groups (4 rollouts of one seat) share each step with the duo's (4 episodes x 2 seats):
    its own metrics (of its one seat too), advantages centred on its own groups; its samples are in the batches the
    trainer read, and those that called the tool hold, in one token sequence, the model's call (in the loss),
    the tool's result (out of it) and the model's next reply (in it): each turn continued from the ids before it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    call, response = tokenizer.convert_tokens_to_ids(["<tool_call>", "<tool_response>"])
    # The calculator's system prompt (its last token left off: it merges with the newline rendered after it).
    system = tokenizer.encode("Add the numbers; the add tool may help. Answer '= N'.", add_special_tokens=False)[:-1]
    trained = with_tool = 0
    for m in metrics(v1_run, 0):
        step = int(m["step"])
        assert m["env/calc/rollouts"] == 8 and m["env/calc/error_frac"] <= 1 / 8, m
        assert m["env/calc/metric/branches"] == 1.0 and 0.0 <= m["env/calc/reward_mean"] <= 1.0, m
        assert 0.0 <= m["env/calc/seat/agent/reward_mean"] <= 1.0, m  # its one seat: SingleAgentEnv's `agent`
        rows = [json.loads(line) for line in (v1_run / f"rollouts/step_{step}.completions.jsonl").read_text().splitlines()]
        calc = [row for row in rows if row["environment"] == "calc"]
        assert len(calc) == 8 and all(row["seat"] == "agent" for row in calc), calc[:2]
        for group in {row["group"] for row in calc}:
            scored = [row for row in calc if row["group"] == group and row["error"] is None]
            mean = sum(row["reward"] for row in scored) / len(scored)
            assert all(row["advantage"] == pytest.approx(row["reward"] - mean, abs=1e-9) for row in scored), scored
        samples = batch_samples(v1_run, step)
        assert len(samples) == m["rollout/samples"] == sum(row["trained"] for row in rows), m
        mine = [(ids, mask) for ids, mask in samples if contains(ids, system)]
        assert len(mine) == sum(row["trained"] for row in calc), (len(mine), calc[:2])
        trained += len(mine)
        for ids, mask in mine:
            results = [i for i, (t, m_) in enumerate(zip(ids, mask)) if t == response and not m_]
            if results:
                with_tool += 1
                assert any(t == call and m_ for t, m_ in zip(ids[: results[0]], mask)), ids
                assert any(mask[results[-1]:]), ids  # the model spoke after the last result
    assert trained >= 2 and with_tool >= 1, (trained, with_tool)


def test_a_v1_environment_with_a_tool_calls_it_and_continues_from_the_sampled_ids(v1_run):
    """The evals of versions 0 and 2 on prl_calc_v1 (each turn held to a call of calc_add or an answer):
    no episode errors, the model calls the tool, every call's result (a + b, from the toolset's MCP
    server in the worker's Python) follows it in the completions file, and the model speaks again after
    it; every trace is one token sequence (one branch: each turn continued from the ids before it,
    nothing that training would drop as prompt_mismatch)."""
    for version in (0, STEPS):
        record = json.loads((v1_run / f"evals/step_{version}.json").read_text())
        calc = record["environments"]["calc"]
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
