"""A verifiers v1 environment's worker as the orchestrator sees it (prl.orchestrator.v1env), against a fake
worker at the subprocess boundary (a script in place of the worker's Python): answers reach their requests
in any event loop, the secret travels by environment only, and a worker that dies is an error naming the
environment, for the request waiting and every later one. The real worker: tests/integration/test_v1_envs.py.

    pytest tests/unit/test_v1env.py
"""

import asyncio
import re
import sys
from types import SimpleNamespace

import pytest

from helpers import ROOT

from prl.config import ConfigError, EnvironmentConfig, load_config
from prl.orchestrator.v1env import KEY_VAR, V1Env

FAKE_WORKER = f"""#!{sys.executable}
import json, os, sys
setup = json.loads(sys.stdin.readline())
if setup["taskset"].get("fail_at_start"):
    sys.exit(5)
print(json.dumps({{"ready": {{"train": 3, "eval": 1}}, "sampling_args": {{"top_k": -1}}}}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    if request["task"] == 2:
        sys.exit(3)
    rollouts = [{{"reward": seed, "secret": os.environ["{KEY_VAR}"], "argv": sys.argv}} for seed in request["seeds"]]
    print(json.dumps({{"id": request["id"], "rollouts": rollouts}}), flush=True)
"""
CLIENT = SimpleNamespace(client=SimpleNamespace(base_url="http://127.0.0.1:1/v1"))


def worker(tmp_path, **args) -> V1Env:
    python = tmp_path / "python"
    python.write_text(FAKE_WORKER)
    python.chmod(0o700)
    cfg = EnvironmentConfig(id="fake_v1", api="v1", python=str(python), args=args)
    return V1Env(cfg, "orchestrator.environment", "model", "s3cret", "seed")


def group(task: int) -> list[dict]:
    return [{"task": task, "seed": 10 + i, "example_id": task} for i in range(2)]


def test_answers_reach_their_requests_in_any_loop_and_the_secret_comes_by_environment(tmp_path):
    env = worker(tmp_path)
    assert [row["task"] for row in env.get_dataset()] == [0, 1, 2] and len(env.get_eval_dataset(n=5)) == 1
    assert env.sampling_args == {"top_k": -1}  # the taskset's own, as the worker reported them

    async def both() -> list[list[dict]]:
        return await asyncio.gather(*(env.run_group(group(t), CLIENT, "model", {}) for t in (0, 1)))

    for _ in range(2):  # a second asyncio.run, as an eval after the batches
        first, second = asyncio.run(both())
        assert [r["reward"] for r in first + second] == [10, 11, 10, 11]
        assert [r["example_id"] for r in first + second] == [0, 0, 1, 1]
    assert first[0]["secret"] == "s3cret" and "s3cret" not in " ".join(first[0]["argv"])
    env.close()
    assert env.proc.returncode == 0


def test_a_worker_that_dies_fails_the_waiting_request_and_every_later_one(tmp_path):
    env = worker(tmp_path)
    with pytest.raises(RuntimeError, match=r"orchestrator.environment: the environment worker exited with 3"):
        asyncio.run(env.run_group(group(2), CLIENT, "model", {}))
    with pytest.raises(RuntimeError, match="exited with 3"):
        asyncio.run(env.run_group(group(0), CLIENT, "model", {}))


def test_a_worker_that_exits_before_it_is_ready_is_named(tmp_path):
    with pytest.raises(RuntimeError, match=r"orchestrator.environment: the environment worker of fake_v1 .* exited with 5"):
        worker(tmp_path, fail_at_start=True)


@pytest.mark.parametrize("override,key", [
    ("orchestrator.environment.renderer={name: qwen3}", "orchestrator.environment.renderer:"),  # a classic env
    ("orchestrator.environment.renderer={enable_thinking: false}", "orchestrator.environment.renderer.name:"),
])
def test_a_renderer_only_for_v1_and_only_by_name(override, key):
    overrides = [override] if "name: qwen3" in override else [override, "orchestrator.environment.api=v1",
                                                                "orchestrator.environment.id=prl_toy_v1"]
    with pytest.raises(ConfigError, match=f"^{re.escape(key)}"):
        load_config(ROOT / "configs/toy.yaml", overrides)


def test_the_workers_envs_start_serving_side_by_side_and_a_failure_leaves_none_running():
    """prl.orchestrator.v1worker.enter_all: the managers are entered at once (each env's tool servers
    start together), and when one fails the ones that entered are left again."""
    import contextlib

    from prl.orchestrator.v1worker import enter_all

    events = []

    @contextlib.asynccontextmanager
    async def serving(name: str, fail: bool = False):
        events.append(f"start {name}")
        await asyncio.sleep(0.05)
        if fail:
            raise RuntimeError(f"{name} failed")
        events.append(f"up {name}")
        try:
            yield
        finally:
            events.append(f"down {name}")

    async def run(*managers) -> None:
        async with contextlib.AsyncExitStack() as stack:
            await enter_all(stack, list(managers))
            events.append("ready")

    asyncio.run(run(serving("train"), serving("eval")))
    assert events == ["start train", "start eval", "up train", "up eval", "ready", "down eval", "down train"]
    events.clear()
    with pytest.raises(RuntimeError, match="eval failed"):
        asyncio.run(run(serving("train"), serving("eval", fail=True)))
    assert events == ["start train", "start eval", "up train", "down train"]
