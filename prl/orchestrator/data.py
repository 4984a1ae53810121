"""The environment and the data order.

The examples of batch n are a pure function of (seed, n): each epoch is a fresh permutation of the
dataset seeded by (seed, epoch), and batch n takes positions [n*k, (n+1)*k) of the endless sequence of
epochs (k = examples per step). A resumed orchestrator therefore regenerates batch n from the same
prompts without any saved data state, and the trainer's checkpoint step alone says where to go on.
"""

from __future__ import annotations

import copy
import importlib
import random
from typing import Any

from prl.config import ConfigError, EnvironmentConfig


def load_env(cfg: EnvironmentConfig) -> Any:
    """`load_environment(**args)` of the module `cfg.id` (a verifiers Environment)."""
    try:
        module = importlib.import_module(cfg.id)
    except ModuleNotFoundError as e:
        raise ConfigError(f"orchestrator.environment.id: cannot import {cfg.id!r} ({e})") from None
    load = getattr(module, "load_environment", None)
    if load is None:
        raise ConfigError(f"orchestrator.environment.id: {cfg.id} has no load_environment()")
    try:
        return load(**cfg.args)
    except TypeError as e:
        # e.g. "load_environment() got an unexpected keyword argument 'foo'": names the argument.
        raise ConfigError(f"orchestrator.environment.args: {cfg.id}.{e}") from None


def epoch_order(seed: int, epoch: int, num_examples: int) -> list[int]:
    order = list(range(num_examples))
    # Integer seeds: random.Random is stable across Python versions and runs for ints.
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def example_indices(seed: int, step: int, per_step: int, num_examples: int) -> list[int]:
    """Dataset indices of the `per_step` examples of batch `step`."""
    if num_examples <= 0:
        raise ValueError("the environment's dataset is empty")
    indices, orders = [], {}
    for position in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(position, num_examples)
        if epoch not in orders:
            orders[epoch] = epoch_order(seed, epoch, num_examples)
        indices.append(orders[epoch][offset])
    return indices


def rollout_groups(dataset: Any, indices: list[int], rollouts_per_example: int) -> list[list[dict]]:
    """verifiers RolloutInputs, one group of `rollouts_per_example` copies per example."""
    groups = []
    for index in indices:
        row = dict(dataset[index])
        row["example_id"] = index
        # Deep copies: an environment may mutate its input (e.g. append to the prompt).
        groups.append([copy.deepcopy(row) for _ in range(rollouts_per_example)])
    return groups
