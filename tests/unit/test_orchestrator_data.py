"""The orchestrator's data order: examples per step, rollout groups and their seeds, several environments.

    pytest tests/unit/test_orchestrator_data.py
"""

from __future__ import annotations

import pytest
from orchestrator_helpers import two_env_config

from prl.config import EnvironmentConfig
from prl.orchestrator.dataset import (
    SEED_KEY, EnvGroups, TrainEnv, derive_seed, example_indices, load_env, load_train_envs, require_tool_parser, rollout_groups,
    step_parts,
)


def test_data_order_is_a_pure_function_of_seed_and_step():
    assert example_indices(0, 3, 4, 10) == example_indices(0, 3, 4, 10)
    # Pinned: a change here silently changes what resumed runs train on.
    assert example_indices(0, 3, 4, 10) == [9, 7, 5, 3]
    assert example_indices(1, 3, 4, 10) != example_indices(0, 3, 4, 10)


def test_each_epoch_visits_every_example_once():
    per_step, n = 4, 12
    seen = [i for step in range(6) for i in example_indices(7, step, per_step, n)]
    assert sorted(seen[:12]) == list(range(12)) and sorted(seen[12:]) == list(range(12))
    assert seen[:12] != seen[12:]  # reshuffled per epoch


def test_epoch_boundary_inside_a_batch():
    batch = example_indices(0, 2, 4, 10)  # positions 8..11: two of epoch 0, two of epoch 1
    assert len(batch) == 4 and all(0 <= i < 10 for i in batch)


def test_rollout_groups_copy_the_row_per_rollout():
    env = load_env(EnvironmentConfig(id="prl.envs.toy", args={"num_examples": 8}))
    groups = rollout_groups(env.get_dataset(), [5, 2], rollouts_per_example=3, seed=0, step=0)
    assert [len(g) for g in groups] == [3, 3]
    assert [g[0]["example_id"] for g in groups] == [5, 2]
    assert groups[0][0]["prompt"][-1]["content"] == "Write some text. (5)"
    groups[0][0]["prompt"].append("x")
    assert len(groups[0][1]["prompt"]) == 1  # copies, not one shared row


def test_every_rollout_has_its_own_reproducible_seed():
    dataset = load_env(EnvironmentConfig(id="prl.envs.toy", args={"num_examples": 8})).get_dataset()

    def seeds(seed: int, step: int) -> list[int]:
        return [row[SEED_KEY] for group in rollout_groups(dataset, [3, 3], 4, seed, step) for row in group]

    assert seeds(0, 5) == seeds(0, 5)
    assert len(set(seeds(0, 5))) == 8  # also for the same example twice in a batch (epoch boundary)
    assert not set(seeds(0, 5)) & set(seeds(0, 6)) and not set(seeds(0, 5)) & set(seeds(1, 5))
    assert seeds(0, 5)[1] == derive_seed(0, 5, 0, 1)  # (seed, step, group position, rollout index)
    # Pinned: a change here silently changes what resumed runs sample.
    assert derive_seed(0, 5, 0, 1) == 6361671458874452847
    assert all(0 <= s < 2**63 for s in seeds(3, 7))  # vLLM's seed is a signed 64-bit integer


def test_several_environments_share_each_batch_by_ratio(tmp_path):
    cfg = two_env_config(tmp_path)
    envs = load_train_envs(cfg)
    assert [(e.name, e.count, len(e.dataset)) for e in envs] == [("toy", 6, 8), ("rev", 2, 160)]
    assert envs[0].seed == 3 and envs[1].seed == derive_seed(3, 1)  # the first keeps the run's seed
    parts = step_parts(envs, [{"e": 0}, {"e": 1}], 2, cfg.run.seed, step=4)
    assert [(p.name, len(p.groups), p.sampling) for p in parts] == [("toy", 6, {"e": 0}), ("rev", 2, {"e": 1})]
    assert parts[1].groups[0][0]["prompt"][-1]["content"] in {row["question"] for row in envs[1].dataset}
    # Each environment walks its own data order; group positions run on across environments.
    toy_groups = rollout_groups(envs[0].dataset, example_indices(3, 4, 6, 8), 2, 3, 4)
    assert parts[0].groups == toy_groups  # = the one-environment batch of old
    assert [g[0]["example_id"] for g in parts[1].groups] == example_indices(derive_seed(3, 1), 4, 2, 160)
    assert parts[1].groups[1][1][SEED_KEY] == derive_seed(3, 4, 7, 1)
    seeds = [row[SEED_KEY] for p in parts for g in p.groups for row in g]
    assert len(set(seeds)) == 16
    again = step_parts(load_train_envs(cfg), [{}, {}], 2, cfg.run.seed, step=4)
    assert [p.groups for p in again] == [p.groups for p in parts]  # a pure function of seed and step


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def test_an_environment_with_tools_needs_the_servers_tool_call_parser(tmp_path):
    """verifiers' own ToolEnv: refused naming inference.tool_call_parser unless a parser is set (the
    key, or vLLM's flag in inference.extra_args); environments without tools need none."""
    import dataclasses

    import verifiers as vf
    from datasets import Dataset

    from prl.config import ConfigError

    data = Dataset.from_list([{"question": "1 + 2?", "answer": "3"}])
    tools = TrainEnv("adder", vf.ToolEnv(dataset=data, tools=[add], max_turns=3), data, 1, 0)
    cfg = two_env_config(tmp_path)
    plain = load_train_envs(cfg)
    require_tool_parser(cfg, plain)
    with pytest.raises(ConfigError, match=r"^inference\.tool_call_parser: environment adder gives the model tools"):
        require_tool_parser(cfg, [*plain, tools])
    # An eval environment's groups (EnvGroups) are checked alike.
    with pytest.raises(ConfigError, match=r"^inference\.tool_call_parser: environment eval-adder gives the model tools"):
        require_tool_parser(cfg, [*plain, EnvGroups("eval-adder", tools.env, [], {})])
    for inference in (dataclasses.replace(cfg.inference, tool_call_parser="hermes"),
                      dataclasses.replace(cfg.inference, extra_args=["--tool-call-parser", "hermes"])):
        require_tool_parser(dataclasses.replace(cfg, inference=inference), [tools])
