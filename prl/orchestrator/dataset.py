"""The environments and the data order.

The examples of batch n are a pure function of (seed, n): each epoch is a fresh permutation of the
dataset seeded by (seed, epoch), and batch n takes positions [n*k, (n+1)*k) of the endless sequence of
epochs (k = examples per step). A resumed orchestrator therefore regenerates batch n from the same
prompts without any saved data state, and the trainer's checkpoint step alone says where to go on.

With several environments (orchestrator.environments) each step holds k_i examples of environment i,
the same split every step (prl.config.split_examples), each drawn from that environment's own
sequence of epochs as above with its own data seed (env_seed); batch n lists environment 0's groups
first, then environment 1's, and so on. Prompts drawn to refill a step's left-out groups
(orchestrator.refill_max_prompts, prl.orchestrator.refill) come from a stream of their own per
(environment, step), so they move no data position.

Sampling is seeded the same way: every rollout input carries its own seed, a function of (seed, n,
group, rollout), from which each of its requests gets a vLLM per-request seed (`client.RolloutClient`).
vLLM's server-wide sampler draws in arrival order, so without it a rollout's tokens would depend on
which other requests happened to share its forward passes.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from prl.config import Config, ConfigError, EnvironmentConfig, envref
from prl.envs.common import EnvArgError
from prl.orchestrator.overlong import Overlong

REFILL = 0x7265666C
"""Mixed into the seed of a step's refill stream ("refl" in ASCII): a stream of its own."""
SEED_KEY = "prl_seed"
"""The rollout input's field with its sampling seed (verifiers keeps unknown fields in state["input"])."""


def load_env(cfg: EnvironmentConfig, path: str = "orchestrator.environment", run: Config | None = None,
             served: bool = False) -> Any:
    """`load_environment(**args)` of the module `cfg.id` (a verifiers Environment); `path` is the
    entry's place in the config, which errors name. An `api: v1` entry is its environment worker
    (prl.orchestrator.v1env), which needs the `run`'s model and secret; `served`: the launch runs the
    envserver component, and an entry with server_workers plays its episodes there (`prl eval`: not)."""
    if cfg.api == "v1":
        from prl.orchestrator.v1env import V1Env
        from prl.run.secret import server_key

        server = served and cfg.server_workers > 0 and run.watchdog.ready_timeout_s
        return V1Env(cfg, path, run.model.name, server_key(run), SEED_KEY, server_timeout_s=server or None)
    try:
        module = importlib.import_module(cfg.id)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{path}.id: cannot import {cfg.id!r} ({e})") from None
    load = getattr(module, "load_environment", None)
    if load is None:
        raise ConfigError(f"{path}.id: {cfg.id} has no load_environment()")
    try:
        return load(**envref.resolve_args(cfg.args, os.environ, f"{path}.args"))
    except EnvArgError as e:
        raise ConfigError(f"{path}.args.{e.arg}: {e.message}") from None
    except TypeError as e:
        # e.g. "load_environment() got an unexpected keyword argument 'foo'": names the argument.
        raise ConfigError(f"{path}.args: {cfg.id}.{e}") from None


def env_seed(seed: int, index: int) -> int:
    """The data seed of training environment `index`; the first keeps the run's seed, so a
    one-environment run orders its data as it always did."""
    return seed if index == 0 else derive_seed(seed, index)


def epoch_order(seed: int, epoch: int, num_examples: int) -> list[int]:
    order = list(range(num_examples))
    # Integer seeds: random.Random is stable across Python versions and runs for ints.
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def example_indices(seed: int, step: int, per_step: int, num_examples: int) -> list[int]:
    """Dataset indices of the `per_step` examples of batch `step`."""
    return stream_indices(seed, step * per_step, per_step, num_examples)


def stream_indices(seed: int, first: int, count: int, num_examples: int) -> list[int]:
    """Dataset indices at positions first..first+count-1 of the endless sequence of epochs seeded by `seed`."""
    if num_examples <= 0:
        raise ValueError("the environment's dataset is empty")
    indices, orders = [], {}
    for position in range(first, first + count):
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
    dataset: Any, indices: list[int], rollouts_per_example: int, seed: int, step: int, first_position: int = 0
) -> list[list[dict]]:
    """verifiers RolloutInputs, one group of `rollouts_per_example` copies per example, each with
    its own sampling seed derived from (seed, step, position of the group in the batch, rollout
    index); this environment's groups start at `first_position` of the batch."""
    groups = []
    for position, index in enumerate(indices, start=first_position):
        row = dict(dataset[index])
        row["example_id"] = index
        # Deep copies: an environment may mutate its input (e.g. append to the prompt).
        group = [copy.deepcopy(row) for _ in range(rollouts_per_example)]
        for rollout, item in enumerate(group):
            item[SEED_KEY] = derive_seed(seed, step, position, rollout)
        groups.append(group)
    return groups


@dataclass
class EnvGroups:
    """One environment's share of a step (or of an eval): its groups, run with its own rubric and
    sampling args; `name` labels its metrics."""

    name: str
    env: Any
    groups: list[list[dict]]
    sampling: dict
    overlong: Overlong = Overlong()
    """Its over-long completions' rule (training)."""
    refill: Callable[[int, int], list[list[dict]]] | None = None
    """(first, count) -> the groups at those places of the step's refill stream (refill_groups); None: no refill."""
    refill_max_prompts: int = 0
    """Extra prompts it may draw this step (orchestrator.refill_max_prompts)."""


@dataclass
class TrainEnv:
    name: str
    env: Any
    """The loaded verifiers Environment."""
    dataset: Any
    count: int
    """Examples per step (groups; a group is rollouts_per_example x its seats rollouts: seats_of)."""
    seed: int
    """Data seed (env_seed)."""
    overlong: Overlong = Overlong()
    """Its over-long completions' rule."""


def load_train_envs(cfg: Config) -> list[TrainEnv]:
    """The training environments, loaded, with their share of each step."""
    orch, envs = cfg.orchestrator, []
    for i, (env_cfg, path) in enumerate(zip(orch.train_environments, orch.environment_paths)):
        env = load_env(env_cfg, path, cfg, served=True)
        count, seed = orch.examples_per_env[i], env_seed(cfg.run.seed, i)
        rule = Overlong.of(env_cfg.overlong, orch.max_tokens_of(env_cfg))
        envs.append(TrainEnv(env_cfg.label, env, env.get_dataset(), count, seed, rule))
    return envs


def seats_of(env: Any) -> int:
    """Rollouts per episode of `env`: a v1 env of several agents gives one per seat's trace, else one."""
    return len(getattr(env, "seats", None) or [None])


def require_tool_parser(cfg: Config, envs: list[Any]) -> None:
    """An environment that gives the model tools (verifiers' `tool_defs`; `oai_tools` in older
    releases) needs the servers' parser of its tool calls: without one the servers answer 400 to every
    request that carries tools. `envs`: anything with its `name` and `env` (TrainEnv, EnvGroups: the
    training and the eval environments). Refused at start, before the servers are waited for, naming the
    key (`prl submit` refuses what the environment's source shows: prl.control.envchecks.check_tools_have_parser)."""
    needing = [e.name for e in envs if getattr(e.env, "tool_defs", None) or getattr(e.env, "oai_tools", None)]
    if needing and not cfg.inference.parses_tool_calls:
        raise ConfigError(f"inference.tool_call_parser: environment {needing[0]} gives the model tools, and the "
                          "servers have no parser of tool calls: set vLLM's parser of the model family "
                          "(e.g. inference.tool_call_parser=hermes for Qwen2.5)")


def step_parts(
    envs: list[TrainEnv], sampling: list[dict], rollouts_per_example: int, seed: int, step: int,
    refill_max_prompts: int = 0,
) -> list[EnvGroups]:
    """Batch `step`'s groups, environment by environment (`sampling`: each one's sampling args);
    each may draw up to `refill_max_prompts` more (prl.orchestrator.refill)."""
    parts, position, per_step = [], 0, sum(env.count for env in envs)
    for i, (env, args) in enumerate(zip(envs, sampling)):
        indices = example_indices(env.seed, step, env.count, len(env.dataset))
        groups = rollout_groups(env.dataset, indices, rollouts_per_example, seed, step, position)
        # Refill groups are placed after the step's own, each environment's in a range of its own.
        refill = (partial(refill_groups, env, rollouts_per_example, seed, step, per_step + i * refill_max_prompts)
                  if refill_max_prompts else None)
        parts.append(EnvGroups(env.name, env.env, groups, args, env.overlong, refill, refill_max_prompts))
        position += env.count
    return parts


def refill_groups(env: TrainEnv, rollouts_per_example: int, seed: int, step: int, position: int,
                  first: int, count: int) -> list[list[dict]]:
    """Groups first..first+count-1 of batch `step`'s refill stream of `env`: its examples in an order
    seeded by (env.seed, step) alone, its rollouts seeded by their places from `position` on."""
    indices = stream_indices(derive_seed(env.seed, REFILL, step), first, count, len(env.dataset))
    return rollout_groups(env.dataset, indices, rollouts_per_example, seed, step, position + first)
