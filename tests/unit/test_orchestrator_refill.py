"""Dynamic sampling with refill (orchestrator.refill_max_prompts): which extra prompts a step draws,
how many, and that batch n stays a function of n.

    pytest tests/unit/test_orchestrator_refill.py
"""

from __future__ import annotations

import asyncio

import pytest

from prl.config import ConfigError, EnvironmentConfig, OrchestratorConfig
from prl.orchestrator.dataset import SEED_KEY, TrainEnv, step_parts
from prl.orchestrator.refill import fill, refill_metrics
from prl.orchestrator.rollouts import score_groups, to_samples


@pytest.fixture
def toy_env() -> TrainEnv:
    """40 prompts, 4 a step (rows as an environment's dataset holds them; the rubric is `answer`)."""
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": ""} for i in range(40)]
    return TrainEnv("toy", None, rows, 4, 0)


def answer(group: list[dict]) -> list[dict]:
    """A stand-in rubric's outputs, a function of the rollout's inputs: examples whose id is a multiple
    of 3 get equal rewards (left out), the others rewards that differ."""
    def one(row: dict, r: int) -> dict:
        uniform = row["example_id"] % 3 == 0
        trajectory = [{"tokens": {"prompt_ids": [1], "prompt_mask": [0], "completion_ids": [2 + r],
                                  "completion_mask": [1], "completion_logprobs": [-1.0]}}]
        return {"example_id": row["example_id"], "reward": 1.0 if uniform else r / 2, "trajectory": trajectory,
                "prl_seed": row[SEED_KEY]}
    return [one(row, r) for r, row in enumerate(group)]


def run_step(env: TrainEnv, step: int, refill_max: int, calls: list[int] | None = None):
    (part,) = step_parts([env], [{}], 2, 0, step, refill_max)

    async def run(groups):
        if calls is not None:
            calls.append(len(groups))
        return [answer(g) for g in groups]

    def keeps(group):
        return bool(to_samples([group]).samples)

    async def go():
        return await fill(part, await run(part.groups), run, keeps)
    return part, asyncio.run(go())


def kept_groups(groups) -> int:
    return sum(bool(to_samples([g]).samples) for g in groups)


def test_refill_draws_until_the_share_is_full_and_the_batch_is_a_function_of_the_step(toy_env):
    without = [kept_groups(run_step(toy_env, step, 0)[1].groups) for step in range(6)]
    assert min(without) < 4  # some steps lose groups: the batch shrinks without refill
    for step in range(6):
        calls: list[int] = []
        part, filled = run_step(toy_env, step, 16, calls)
        assert kept_groups(filled.groups) == 4, step  # full again
        assert filled.groups[:4] == [answer(g) for g in part.groups]  # the step's own groups come first, unchanged
        assert filled.extra == sum(calls[1:]) <= 16 and (filled.extra > 0) == (without[step] < 4)
        # The last group used is the one that filled the share: nothing after it.
        assert bool(to_samples([filled.groups[-1]]).samples)
        assert len(filled.groups) + filled.surplus == 4 + filled.extra
        again = run_step(toy_env, step, 16)[1]
        assert again.groups == filled.groups and again.extra == filled.extra  # requeue/resume: the same batch
    # The step's own groups, and so the data position, do not depend on refill.
    assert step_parts([toy_env], [{}], 2, 0, 3, 8)[0].groups == step_parts([toy_env], [{}], 2, 0, 3)[0].groups


def test_refill_stays_within_its_bound_and_reports_what_it_drew(toy_env):
    step = next(s for s in range(20) if kept_groups(run_step(toy_env, s, 0)[1].groups) <= 2)
    part, filled = run_step(toy_env, step, 1)
    assert filled.extra == 1 and kept_groups(filled.groups) <= 3
    m = refill_metrics([part], [filled])
    assert (m["prompts_drawn"], m["refill_prompts"], m["env/toy/prompts_drawn"]) == (5.0, 1.0, 5.0)
    assert score_groups(["toy"], [filled.groups], 1.0).metrics["groups_trained"] == kept_groups(filled.groups)


def test_refill_prompts_have_their_own_stream_and_seeds(toy_env):
    two = TrainEnv("two", toy_env.env, toy_env.dataset, 2, 5)
    a, b = step_parts([toy_env, two], [{}, {}], 2, 0, 7, 6)
    seeds = [row[SEED_KEY] for p in (a, b) for g in p.groups + p.refill(0, 6) for row in g]
    assert len(set(seeds)) == len(seeds) == (4 + 6 + 2 + 6) * 2  # no rollout shares a seed
    assert a.refill(2, 3) == a.refill(0, 5)[2:]  # a stream: rounds of any size draw the same prompts
    assert a.refill(0, 5) == step_parts([toy_env, two], [{}, {}], 2, 0, 7, 6)[0].refill(0, 5)
    assert [g[0]["example_id"] for g in a.refill(0, 5)] != [g[0]["example_id"] for g in
                                                           step_parts([toy_env], [{}], 2, 0, 8, 6)[0].refill(0, 5)]


def test_refill_is_checked_naming_the_key():
    env = EnvironmentConfig(id="prl.envs.toy")
    with pytest.raises(ConfigError, match=r"orchestrator\.refill_max_prompts: must be >= 0"):
        OrchestratorConfig(environment=env, refill_max_prompts=-1)
    with pytest.raises(ConfigError, match=r"orchestrator\.refill_max_prompts: continuous mode"):
        OrchestratorConfig(environment=env, refill_max_prompts=8, continuous=True)
