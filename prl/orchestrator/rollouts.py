"""One step's rollouts: run the groups through the environment, score them, turn them into samples.

The environment drives each rollout (prompt -> vLLM -> maybe more turns) and scores every group
with its rubric; vLLM returns the sampled token ids and their logprobs with each response
(`logprobs` and `return_token_ids`), which verifiers keeps in the trajectory. The tokens the trainer
sees are exactly the tokens vLLM sampled: no re-tokenisation of text.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from statistics import fmean, pstdev
from typing import Any

from prl.config import SamplingConfig
from prl.orchestrator.advantages import group_advantages
from prl.orchestrator.client import Servers
from prl.orchestrator.data import EnvGroups
from prl.orchestrator.packing import Sample, sample_from_trajectory


def sampling_args(cfg: SamplingConfig, env: Any) -> dict:
    """The environment's own sampling args, overridden by the config, plus what the trainer needs."""
    args = {k: v for k, v in env.sampling_args.items() if k != "extra_body"}
    args |= {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens, "logprobs": True}
    # vLLM's extension: prompt_token_ids on the response and token_ids on each choice.
    extra = {**env.sampling_args.get("extra_body", {}), **cfg.extra_body}
    args["extra_body"] = {**extra, "return_token_ids": True}
    return args


async def run_groups(
    env: Any, servers: Servers, groups: list[list[dict]], model: str, sampling: dict, max_concurrent: int
) -> list[list[dict]]:
    """Outputs (verifiers RolloutOutputs with the trajectory) of every group, in input order.

    A group stays on one server (its rollouts share the prompt's KV cache); groups go round-robin.
    At most `max_concurrent` requests are in flight: max_concurrent // group size groups at a time.
    """
    gate = asyncio.Semaphore(max(1, max_concurrent // max(1, len(groups[0]))))

    async def run(i: int, group: list[dict]) -> list[dict]:
        async with gate:
            client = servers.clients[i % len(servers.clients)]
            return await env.run_group(group, client, model, sampling, state_columns=["trajectory"])

    return await asyncio.gather(*(run(i, group) for i, group in enumerate(groups)))


@dataclass
class StepRollouts:
    samples: list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)


async def run_parts(
    parts: list[EnvGroups], servers: Servers, model: str, max_concurrent: int
) -> list[list[list[dict]]]:
    """Every environment's group outputs at once; each gets its share of `max_concurrent` by groups."""
    total = sum(len(p.groups) for p in parts)
    return await asyncio.gather(*(
        run_groups(p.env, servers, p.groups, model, p.sampling, max(1, max_concurrent * len(p.groups) // total))
        for p in parts
    ))


async def generate_step(
    parts: list[EnvGroups],
    servers: Servers,
    model: str,
    max_concurrent: int,
    normalize_std: bool = False,
) -> StepRollouts:
    """Samples of the step's groups, in part order; metrics overall and per environment (env/NAME/...)."""
    start = time.perf_counter()
    per_env = await run_parts(parts, servers, model, max_concurrent)
    generation_s = time.perf_counter() - start
    outputs = [group for groups in per_env for group in groups]
    result = to_samples(outputs, normalize_std)
    for part, groups in zip(parts, per_env):
        result.metrics |= {f"env/{part.name}/{k}": v for k, v in outcome_metrics(groups).items()}
    completion_tokens = sum(sum(s.loss_mask) for s in result.samples)
    result.metrics["generation_s"] = generation_s
    result.metrics["rollout_tokens_per_s"] = completion_tokens / max(generation_s, 1e-9)
    return result


def to_samples(group_outputs: list[list[dict]], normalize_std: bool = False) -> StepRollouts:
    """Advantages per group, samples for every rollout that has tokens, and the step's metrics."""
    flat = [output for group in group_outputs for output in group]
    rewards = [float(output.get("reward") or 0.0) for output in flat]
    group_size = len(group_outputs[0])
    advantages = group_advantages(rewards, group_size, normalize_std)
    samples = []
    for output, advantage in zip(flat, advantages):
        sample = sample_from_trajectory(output.get("trajectory") or [], advantage)
        if sample is not None:
            samples.append(sample)
    return StepRollouts(samples, rollout_metrics(flat, rewards, advantages, samples, group_size))


def rollout_metrics(
    outputs: list[dict], rewards: list[float], advantages: list[float], samples: list[Sample], group_size: int
) -> dict[str, float]:
    groups = [advantages[i : i + group_size] for i in range(0, len(advantages), group_size)]
    metrics = {
        "reward_mean": fmean(rewards),
        "reward_std": pstdev(rewards),
        "rollouts": float(len(outputs)),
        "samples": float(len(samples)),
        "dropped_frac": 1.0 - len(samples) / len(outputs),
        "error_frac": fmean(output.get("error") is not None for output in outputs),
        "truncated_frac": fmean(bool(output.get("is_truncated")) for output in outputs),
        "zero_advantage_group_frac": fmean(all(a == 0.0 for a in g) for g in groups),
    }
    if samples:
        metrics["seq_len_mean"] = fmean(len(s) for s in samples)
        metrics["seq_len_max"] = float(max(len(s) for s in samples))
        metrics["completion_len_mean"] = fmean(sum(s.loss_mask) for s in samples)
    # The rubric's individual reward functions / metrics, averaged (e.g. metric/correct_answer).
    names = {name for output in outputs for name in (output.get("metrics") or {})}
    for name in sorted(names):
        values = [(output.get("metrics") or {}).get(name) for output in outputs]
        metrics[f"metric/{name}"] = fmean(float(v) for v in values if v is not None)
    return metrics


def outcome_metrics(group_outputs: list[list[dict]]) -> dict[str, float]:
    """What the rollouts scored, without any training view (per environment, and evals): reward
    mean and spread, counts, and the rubric's own metrics."""
    flat = [output for group in group_outputs for output in group]
    rewards = [float(output.get("reward") or 0.0) for output in flat]
    metrics = {
        "reward_mean": fmean(rewards),
        "reward_std": pstdev(rewards),
        "rollouts": float(len(flat)),
        "error_frac": fmean(output.get("error") is not None for output in flat),
        "truncated_frac": fmean(bool(output.get("is_truncated")) for output in flat),
    }
    names = {name for output in flat for name in (output.get("metrics") or {})}
    for name in sorted(names):
        values = [(output.get("metrics") or {}).get(name) for output in flat]
        metrics[f"metric/{name}"] = fmean(float(v) for v in values if v is not None)
    return metrics
