"""The environment and the data order.

The examples of batch n are a pure function of (seed, n): each epoch is a fresh permutation of the
dataset seeded by (seed, epoch), and batch n takes positions [n*k, (n+1)*k) of the endless sequence of
epochs (k = examples per step). A resumed orchestrator therefore regenerates batch n from the same
prompts without any saved data state, and the trainer's checkpoint step alone says where to go on.

Sampling is seeded the same way: every rollout input carries its own seed, a function of (seed, n,
group, rollout), from which each of its requests gets a vLLM per-request seed (`client.RolloutClient`).
vLLM's server-wide sampler draws in arrival order, so without it a rollout's tokens would depend on
which other requests happened to share its forward passes.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import random
from typing import Any

from prl.config import ConfigError, EnvironmentConfig

SEED_KEY = "prl_seed"
"""The rollout input's field with its sampling seed (verifiers keeps unknown fields in state["input"])."""


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


def derive_seed(*parts: int) -> int:
    """A seed in [0, 2**63) from integers: vLLM takes a signed 64-bit seed; hash() of a tuple is
    not stable across Python versions, blake2b is."""
    digest = hashlib.blake2b(repr(tuple(int(p) for p in parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def rollout_groups(
    dataset: Any, indices: list[int], rollouts_per_example: int, seed: int, step: int
) -> list[list[dict]]:
    """verifiers RolloutInputs, one group of `rollouts_per_example` copies per example, each with
    its own sampling seed derived from (seed, step, position of the group, rollout index)."""
    groups = []
    for position, index in enumerate(indices):
        row = dict(dataset[index])
        row["example_id"] = index
        # Deep copies: an environment may mutate its input (e.g. append to the prompt).
        group = [copy.deepcopy(row) for _ in range(rollouts_per_example)]
        for rollout, item in enumerate(group):
            item[SEED_KEY] = derive_seed(seed, step, position, rollout)
        groups.append(group)
    return groups
