"""Dynamic sampling with refill (DAPO): a step's left-out groups replaced by more prompts.

Groups whose rollouts are all left out (equal rewards under filter_zero_advantage, every rollout
errored or dropped) leave a hole in the batch; late in training most groups are solved and a step
would train on a sliver. With orchestrator.refill_max_prompts > 0 each training environment draws
more prompts, in rounds, until it holds as many trained groups as its share of the step, or until
it has drawn that many extra prompts. A round draws the shortfall divided by the share of groups
kept so far (at least a quarter), so a mostly-solved task does not take one round per missing group.

Determinism: the extra prompts of step n come from a stream of their own, seeded by (data seed, n)
(prl.orchestrator.dataset.refill_groups), their rollouts seeded by their place after the step's own
groups; how many rounds a step takes depends on the rewards alone. So batch n is still a function of
the config, the seed, n and the policy version: a requeued or resumed run regenerates it bit for bit
on CPU, and the data position after batch n stays n x the step's share (the refill stream moves no
position). Once an environment holds its share, groups past it (the last round's surplus) are dropped
unused, counted in `refill_surplus`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prl.orchestrator.dataset import EnvGroups

MIN_KEEP_RATE = 0.25
"""A round assumes at least this share of new groups is kept: at most 4x the shortfall per round."""

Groups = list[list[dict]]


@dataclass
class Filled:
    """One environment's groups of a step, refilled."""

    groups: Groups
    """In batch order: the step's own, then the refills up to the one that filled the share."""
    extra: int = 0
    """Prompts drawn beyond the step's own."""
    surplus: int = 0
    """Drawn in the last round past the one that filled the share: generated, not used."""


async def fill(part: EnvGroups, first: Groups, run: Callable[[Groups], Awaitable[Groups]],
               keeps: Callable[[list[dict]], bool]) -> Filled:
    """`first` (the outputs of part.groups), refilled while fewer than len(part.groups) groups are
    kept and fewer than part.refill_max extra prompts were drawn; `run` generates groups' outputs,
    `keeps` says whether a finished group has a rollout to train on."""
    target, outputs, extra = len(part.groups), list(first), 0
    kept = sum(map(keeps, outputs))
    while kept < target and extra < part.refill_max and part.refill is not None:
        rate = max(kept / len(outputs), MIN_KEEP_RATE)
        count = min(part.refill_max - extra, math.ceil((target - kept) / rate))
        more = await run(part.refill(extra, count))
        extra += count
        outputs += more
        kept += sum(map(keeps, more))
    used = cut_after(outputs, keeps, target)
    return Filled(outputs[:used], extra, len(outputs) - used)


def cut_after(outputs: Groups, keeps: Callable[[list[dict]], bool], target: int) -> int:
    """How many groups to use: up to the target-th kept one (all of them if there are fewer)."""
    kept = 0
    for i, group in enumerate(outputs):
        kept += keeps(group)
        if kept == target:
            return i + 1
    return len(outputs)


def refill_metrics(parts: list[EnvGroups], filled: list[Filled]) -> dict[str, float]:
    """prompts_drawn (the step's own and the refills), refill_prompts, refill_surplus; per environment too."""
    metrics = {"prompts_drawn": float(sum(len(p.groups) + f.extra for p, f in zip(parts, filled))),
               "refill_prompts": float(sum(f.extra for f in filled)),
               "refill_surplus": float(sum(f.surplus for f in filled))}
    for p, f in zip(parts, filled):
        metrics |= {f"env/{p.name}/prompts_drawn": float(len(p.groups) + f.extra),
                    f"env/{p.name}/refill_prompts": float(f.extra)}
    return metrics
