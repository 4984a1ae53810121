"""One step's rollouts: run the groups through the environment, score them, turn them into samples.

The environment drives each rollout (prompt -> vLLM -> maybe more turns) and scores every group
with its rubric; each response carries the prompt ids, the sampled ids and their logprobs, which
verifiers keeps in the trajectory (prl/orchestrator/tokens.py: every turn continues from the earlier
turns' ids; with `rollout_route: chat`, vLLM's `return_token_ids`). The tokens the trainer sees are
exactly the tokens vLLM sampled: no re-tokenisation of text.

Not every rollout is trained on: errored ones, ones that do not make one token sequence and, by
default, those of groups with equal rewards are left out, each with its reason, counted per step and
recorded with what the model wrote (docs/architecture.md, "From rollouts to a batch").
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean, pstdev
from typing import Any

from loguru import logger

from prl.config import Config, SamplingConfig
from prl.config.validate import check_sampling
from prl.orchestrator.advantages import group_advantages, group_bounds
from prl.orchestrator.client import Servers
from prl.orchestrator.dataset import EnvGroups
from prl.orchestrator.overlong import Overlong
from prl.orchestrator.outcomes import outcome_metrics, rubric_metrics
from prl.orchestrator.records import error_text, plain
from prl.orchestrator.refill import Filled, fill, refill_metrics
from prl.orchestrator.trajectory import DROP_REASONS, Dropped, sample_from_trajectory
from prl.run.packing import Sample, over_budget, pack_batch
from prl.orchestrator.resume import write_completions
from prl.run.batch import Batch, write_batch
from prl.run.rundir import RunDir


def sampling_args(cfg: SamplingConfig, env: Any, max_tokens: int | None = None) -> dict:
    """The environment's own sampling args, overridden by the config (`max_tokens`: the entry's own limit,
    orchestrator.max_tokens_of), plus what the trainer needs."""
    args = {k: v for k, v in env.sampling_args.items() if k != "extra_body"}
    args |= {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": max_tokens or cfg.max_tokens,
             "logprobs": True}
    # vLLM's extension: prompt_token_ids on the response and token_ids on each choice.
    extra = {**env.sampling_args.get("extra_body", {}), **cfg.extra_body}
    args["extra_body"] = {**extra, "return_token_ids": True}
    # The config's own fields were checked at load; what is left is the environment's (e.g. a top_k).
    check_sampling(args, "environment sampling_args", cfg.temperature)
    check_sampling(args["extra_body"], "environment sampling_args.extra_body", cfg.temperature)
    if "structured_outputs" in args["extra_body"]:
        logger.warning("rollouts are constrained (structured_outputs): vLLM samples from, and reports the "
                       "logprobs of, the constrained distribution; the trainer's are the model's own, so the "
                       "importance ratios of these tokens are not the sampler's (docs/tools.md)")
    return args


async def run_groups(
    env: Any, servers: Servers, groups: list[list[dict]], model: str, sampling: dict, max_concurrent: int
) -> list[list[dict]]:
    """Outputs (verifiers RolloutOutputs with the trajectory) of every group, in input order.
    At most `max_concurrent` requests are in flight: max_concurrent // group size groups at a time."""
    gate = asyncio.Semaphore(max(1, max_concurrent // max(1, len(groups[0]))))

    async def run(i: int, group: list[dict]) -> list[dict]:
        async with gate:
            return await run_group(env, servers, i, group, model, sampling)

    return await asyncio.gather(*(run(i, group) for i, group in enumerate(groups)))


async def run_group(env: Any, servers: Servers, index: int, group: list[dict], model: str, sampling: dict) -> list[dict]:
    """The outputs of group number `index`. A group stays on one server (its rollouts share the
    prompt's KV cache); groups go round-robin by index."""
    client = servers.clients[index % len(servers.clients)]
    return await env.run_group(group, client, model, sampling, state_columns=["trajectory"])


@dataclass
class Rollout:
    """One verifiers output and what became of it."""

    output: dict
    advantage: float | None
    """None: the rollout errored (no part in its group's baseline)."""
    sample: Sample | None = None
    """Its token sequence; None when it errored or could not be made one (trajectory.Dropped)."""
    dropped: str | None = None
    """Why it is not trained on: "errored", "zero_advantage", "overlong", "over_budget" or one of
    trajectory.DROP_REASONS."""
    detail: str | None = None
    """The specifics of `dropped` (the error, the turn and token that broke the sequence)."""
    penalty: float = 0.0
    """What its environment's overlong penalty took from its reward before advantages."""


@dataclass
class StepRollouts:
    samples: list[Sample]
    """What the trainer gets: the samples of every rollout with `dropped` None."""
    rollouts: list[Rollout] = field(default_factory=list)
    """Every rollout, group by group, in batch order."""
    metrics: dict[str, float] = field(default_factory=dict)
    group_sizes: list[int] = field(default_factory=list)
    """Each group's rollouts, in batch order: rollouts_per_example x its environment's seats (a step may
    mix environments of different seat counts); empty: groups of one."""
    environments: list[str] = field(default_factory=list)
    """Each group's environment (its name in metrics), in batch order; empty: not known (to_samples alone)."""

    def places(self) -> list[tuple[int, int]]:
        """Each rollout's group in the batch and its index in that group, in batch order."""
        sizes = self.group_sizes or [1] * len(self.rollouts)
        return [(group, i - start) for group, (start, end) in enumerate(group_bounds(len(self.rollouts), sizes))
                for i in range(start, end)]

    def wheres(self) -> list[str]:
        """Each rollout's place, for the logs: its example and its position in the batch."""
        return [f"example {r.output.get('example_id')}, group {group} rollout {index}"
                for r, (group, index) in zip(self.rollouts, self.places())]


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
    filter_zero_advantage: bool = True,
) -> StepRollouts:
    """Samples of the step's groups, in part order, refilled where a part may (prl.orchestrator.refill);
    metrics overall and per environment (env/NAME/...)."""
    start = time.perf_counter()
    total = sum(len(p.groups) for p in parts)

    async def one(part: EnvGroups) -> Filled:
        share = max(1, max_concurrent * len(part.groups) // total)

        async def run(groups: list[list[dict]]) -> list[list[dict]]:
            return await run_groups(part.env, servers, groups, model, part.sampling, share)

        def keeps(group: list[dict]) -> bool:  # the same judgement as the batch's, on this group alone
            return bool(to_samples([group], normalize_std, filter_zero_advantage, [part.overlong]).samples)

        return await fill(part, await run(part.groups), run, keeps)

    filled = await asyncio.gather(*(one(p) for p in parts))
    result = score_groups([p.name for p in parts], [f.groups for f in filled], time.perf_counter() - start,
                          normalize_std, filter_zero_advantage, [p.overlong for p in parts])
    result.metrics |= refill_metrics(parts, filled)
    return result


def score_groups(names: list[str], per_env: list[list[list[dict]]], generation_s: float,
                 normalize_std: bool = False, filter_zero_advantage: bool = True,
                 rules: list[Overlong] | None = None) -> StepRollouts:
    """A batch from finished groups (per environment, in batch order) that took `generation_s` to make;
    `rules`: each environment's over-long rule (default: keep)."""
    outputs = [group for groups in per_env for group in groups]
    rules = rules or [Overlong()] * len(per_env)
    result = to_samples(outputs, normalize_std, filter_zero_advantage,
                        [rule for rule, groups in zip(rules, per_env) for _ in groups])
    result.environments = [name for name, groups in zip(names, per_env) for _ in groups]
    first = 0
    for name, groups in zip(names, per_env):
        count = sum(map(len, groups))
        mine = result.rollouts[first : first + count]
        result.metrics |= {f"env/{name}/{k}": v for k, v in (outcome_metrics(groups) | overlong_metrics(mine)).items()}
        first += count
    completion_tokens = sum(sum(r.sample.loss_mask) for r in result.rollouts if r.sample is not None)
    result.metrics["generation_s"] = generation_s
    result.metrics["rollout_tokens_per_s"] = completion_tokens / max(generation_s, 1e-9)
    return result


def to_samples(
    group_outputs: list[list[dict]], normalize_std: bool = False, filter_zero_advantage: bool = True,
    rules: list[Overlong] | None = None,
) -> StepRollouts:
    """Advantages per group, a sample for every rollout that can be trained on, the step's metrics.

    Groups may differ in size: an environment whose episodes have several seats gives
    rollouts_per_example x seats rollouts per group, and each group (each seat in it) is its own
    baseline whatever the others' sizes. Errored rollouts (verifiers' `error` set) stay out of
    baselines and training. `rules` (one per group; default keep): an overlong penalty comes off the
    reward before advantages; masked (truncated) rollouts stay in their group's baseline but out of the
    batch. With `filter_zero_advantage`, groups whose advantages are all zero (equal rewards) stay out
    of the batch, hence out of the loss and of its token denominator.
    """
    sizes = [len(group) for group in group_outputs]
    flat = [output for group in group_outputs for output in group]
    rules = rules or [Overlong()] * len(group_outputs)
    flat_rules = [rule for rule, size in zip(rules, sizes) for _ in range(size)]
    penalties = [rule.reward_penalty(output) for output, rule in zip(flat, flat_rules)]
    rewards = [None if output.get("error") is not None else reward_of(output) - penalty
               for output, penalty in zip(flat, penalties)]
    advantages = group_advantages(rewards, sizes, normalize_std, seats=[output.get("seat") for output in flat])
    rollouts = [judge(output, advantage) for output, advantage in zip(flat, advantages)]
    for rollout, rule, penalty in zip(rollouts, flat_rules, penalties):
        rollout.penalty = penalty
        if rollout.dropped is None and rule.masks(rollout.output):
            rollout.dropped, rollout.detail = "overlong", "truncated at its max_tokens (overlong.mode mask)"
    if filter_zero_advantage:
        for group in zero_advantage_groups(rollouts, sizes):
            for rollout in group:
                if rollout.dropped is None:
                    rollout.dropped, rollout.detail = "zero_advantage", "every reward of its group is equal"
    samples = [r.sample for r in rollouts if r.dropped is None]
    return StepRollouts(samples, rollouts, rollout_metrics(rollouts, samples, sizes), sizes)


def reward_of(output: dict) -> float:
    return float(output.get("reward") or 0.0)


def judge(output: dict, advantage: float | None) -> Rollout:
    if advantage is None:
        return Rollout(output, None, dropped="errored", detail=error_text(output["error"]))
    made = sample_from_trajectory(output.get("trajectory") or [], advantage)
    if isinstance(made, Dropped):
        return Rollout(output, advantage, dropped=made.reason, detail=made.detail)
    return Rollout(output, advantage, made)


def grouped(rollouts: list[Rollout], sizes: list[int]) -> list[list[Rollout]]:
    """The rollouts, group by group (`sizes`: each group's rollouts, in batch order)."""
    return [rollouts[start:end] for start, end in group_bounds(len(rollouts), sizes)]


def zero_advantage_groups(rollouts: list[Rollout], sizes: list[int]) -> list[list[Rollout]]:
    """Groups with a scored rollout whose advantages are all zero (all-errored groups are not)."""
    groups = grouped(rollouts, sizes)
    scored = [[r.advantage for r in group if r.advantage is not None] for group in groups]
    return [group for group, adv in zip(groups, scored) if adv and all(a == 0.0 for a in adv)]


def rollout_metrics(rollouts: list[Rollout], samples: list[Sample], sizes: list[int]) -> dict[str, float]:
    """The step's rollout/* metrics (docs/monitoring.md). Rewards are those of scored rollouts."""
    n = len(rollouts)
    scored = [r.output for r in rollouts if r.advantage is not None]
    rewards = [reward_of(output) for output in scored]
    uniform_groups = zero_advantage_groups(rollouts, sizes)
    uniform = [r.sample for group in uniform_groups for r in group if r.sample is not None]
    metrics = {
        "reward_mean": fmean(rewards) if rewards else math.nan,
        "reward_std": pstdev(rewards) if rewards else math.nan,
        "rollouts": float(n),
        "samples": float(len(samples)),
        "errored": float(n - len(scored)),
        "error_frac": (n - len(scored)) / n,
        "dropped_frac": sum(r.dropped in DROP_REASONS for r in rollouts) / n,
        **{f"dropped/{reason}": float(sum(r.dropped == reason for r in rollouts)) for reason in DROP_REASONS},
        "truncated_frac": fmean(bool(r.output.get("is_truncated")) for r in rollouts),
        "zero_advantage_group_frac": len(uniform_groups) / len(sizes),
        "zero_advantage_samples": float(len(uniform)),
        "zero_advantage_loss_tokens": float(sum(sum(s.loss_mask) for s in uniform)),
        "groups_trained": float(sum(any(r.dropped is None for r in group) for group in grouped(rollouts, sizes))),
        **overlong_metrics(rollouts),
    }
    if samples:
        metrics["seq_len_mean"] = fmean(len(s) for s in samples)
        metrics["seq_len_max"] = float(max(len(s) for s in samples))
        metrics["completion_len_mean"] = fmean(sum(s.loss_mask) for s in samples)
    return metrics | rubric_metrics(scored)


def overlong_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """Rollouts masked as over-long, and the mean overlong penalty over scored rollouts."""
    scored = [r.penalty for r in rollouts if r.advantage is not None]
    return {"overlong_masked": float(sum(r.dropped == "overlong" for r in rollouts)),
            "overlong_penalty_mean": fmean(scored) if scored else 0.0}


def log_exclusions(step: int, result: StepRollouts) -> None:
    """One warning per rollout dropped for its tokens, one per distinct error of errored ones."""
    errors: dict[str, list[str]] = {}
    for rollout, where in zip(result.rollouts, result.wheres()):
        if rollout.dropped == "errored":
            errors.setdefault(rollout.detail or "", []).append(where)
        elif rollout.dropped in DROP_REASONS:
            logger.warning(f"batch {step}: rollout dropped ({rollout.dropped}; {where}): {rollout.detail}")
    for text, places in errors.items():
        logger.warning(
            f"batch {step}: {len(places)} rollout(s) errored, left out of baselines and training "
            f"({'; '.join(places[:4])}{'; ...' if len(places) > 4 else ''}): {text}"
        )


def set_aside_over_budget(step: int, result: StepRollouts, budget: int | None) -> None:
    """Take the samples longer than `trainer.micro_batch_tokens` out of the batch (prl.run.packing.over_budget
    logs each), mark their rollouts and count them in `over_budget`."""
    kept, count = over_budget(result.samples, budget, step)
    kept_ids = {id(sample) for sample in kept}
    for rollout in result.rollouts:
        if rollout.dropped is None and id(rollout.sample) not in kept_ids:
            rollout.dropped = "over_budget"
            rollout.detail = f"{len(rollout.sample)} tokens > trainer.micro_batch_tokens={budget}"
    result.samples = kept
    result.metrics["over_budget"] = float(count)
    result.metrics["samples"] = float(len(kept))


def check_trainable(step: int, result: StepRollouts) -> None:
    """A step without samples: fails when no rollout came back usable (errored, or no tokens: the
    environment or the servers are broken, and a run of empty steps would hide it); when every
    usable rollout was in a zero-advantage group or masked as over-long it is a legitimate step (a
    task too hard or too easy for now), trained as an empty batch: the trainer leaves the weights as they are."""
    m = result.metrics
    counts = f"{m['errored']:.0f} errored, " + ", ".join(f"{m[f'dropped/{r}']:.0f} {r}" for r in DROP_REASONS)
    counts += f", {m.get('over_budget', 0):.0f} over_budget, {m.get('overlong_masked', 0):.0f} overlong"
    if not any(r.sample is not None and r.dropped != "over_budget" for r in result.rollouts):
        raise RuntimeError(f"batch {step}: no rollout came back usable ({m['rollouts']:.0f} rollouts: {counts})")
    logger.warning(
        f"batch {step}: nothing to train on: every group with usable rollouts has equal rewards or was masked as over-long "
        f"(reward_mean {m['reward_mean']:.3f}; {counts}); writing an empty batch, the trainer skips this "
        "step's optimizer step"
    )


def write_step(cfg: Config, rd: RunDir, step: int, result: StepRollouts, metrics: dict[str, float],
               began: float, data_order: dict) -> Path:
    """Batch `step` -> RUN/rollouts/step_N.pt: over-budget samples set aside, exclusions logged, what
    the model wrote on disk first (also for a step that fails here), the samples packed, `metrics`
    (versions, timings; "policy_version" among them) beside the rollouts' own. `began`: when the step
    began (perf_counter); `data_order`: the data order after this batch (Launch.data_order(step + 1))."""
    set_aside_over_budget(step, result, cfg.trainer.micro_batch_tokens)
    log_exclusions(step, result)
    write_completions(rd, step, completion_records(step, result))
    if not result.samples:
        check_trainable(step, result)  # raises unless every group was legitimately uniform
    micro_batches = pack_batch(result.samples, cfg.trainer.world_size, cfg.trainer.micro_batch_size,
                               cfg.trainer.micro_batch_tokens)
    metrics = result.metrics | metrics | {"orchestrator_step_s": time.perf_counter() - began}
    version = int(metrics["policy_version"])
    path = write_batch(rd, Batch(step=step, policy_version=version, micro_batches=micro_batches,
                                 metrics=metrics, data_order=data_order))
    logger.info(f"batch {step}: {summary(metrics)}, policy v{version} -> {path.name}")
    return path


def summary(m: dict[str, float]) -> str:
    """The batch's log line: reward, what was trained on and what was left out."""
    left_out = f"{m['errored']:.0f} errored, {m['dropped_frac'] * m['rollouts']:.0f} dropped"
    left_out += f", {m['zero_advantage_group_frac']:.0%} of groups uniform ({m['zero_advantage_samples']:.0f} samples)"
    seq = f", seq len {m['seq_len_mean']:.0f}" if "seq_len_mean" in m else ""
    return (
        f"reward {m['reward_mean']:.3f} +- {m['reward_std']:.3f}, {m['samples']:.0f} samples{seq} "
        f"({left_out}), {m['rollout_tokens_per_s']:.0f} tok/s"
    )


def completion_records(step: int, result: StepRollouts) -> list[dict]:
    """What the model wrote, one JSON-able dict per rollout (RUN/rollouts/step_N.completions.jsonl):
    text and scores, no token ids. No timings either: a resumed run writes the same file again."""
    records = []
    for rollout, (group, index) in zip(result.rollouts, result.places()):
        output = rollout.output
        error = output.get("error")
        records.append({
            "step": step,
            "environment": result.environments[group] if result.environments else None,
            "example_id": output.get("example_id"),
            "group": group,
            "rollout": index,
            **({"seat": output["seat"]} if output.get("seat") is not None else {}),
            "prompt": plain(output.get("prompt")),
            "completion": plain(output.get("completion")),
            "answer": output.get("answer"),
            "reward": output.get("reward"),
            "advantage": rollout.advantage,
            "overlong_penalty": rollout.penalty,
            "metrics": output.get("metrics") or {},
            "truncated": bool(output.get("is_truncated")),
            "error": None if error is None else error_text(error),
            "trained": rollout.dropped is None,
            "dropped": rollout.dropped,
            "dropped_detail": rollout.detail,
        })
    return records
