"""Samples -> the trainer's micro-batches (format: docs/architecture.md, "Batch file format"): the
orchestrator packs its rollouts with these, and an SFT job (prl.trainer.sft) its conversations.

Each micro-batch packs samples into one row [1, T] with position_ids restarting at 0 per sample, so
the trainer's attention sees sample boundaries and no padding is computed: up to `micro_batch_size`
samples, or, with a token budget (`trainer.micro_batch_tokens`), as many as fit in that many tokens,
so that a micro-batch's memory is bounded whatever the lengths. Every rank gets the same number of
micro-batches: FSDP's collectives pair up forward and backward passes across ranks, so a rank with
fewer would hang the others. Short ranks are topped up with one-token micro-batches whose loss mask
is all False.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from loguru import logger

NO_ROUTE = 255
"""In `routed_experts` (uint8 expert ids): no expert recorded at this position; the trainer's router picks
(prl.trainer.replay). Submit refuses routing replay for a model of 255 experts or more."""


@dataclass
class Sample:
    """One sequence as tokens: a rollout (prompt and environment turns unmasked, sampled tokens in
    loss_mask), or an SFT conversation (its assistant tokens in loss_mask)."""

    input_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    """vLLM's logprob of each token (0.0 where loss_mask is False, and in SFT), aligned with input_ids."""
    advantage: float
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: the teacher's logprob of each token (0.0 where loss_mask is False),
    aligned with input_ids (prl.orchestrator.distill); None without a teacher."""
    routed_experts: np.ndarray | None = None
    """Routing replay: the experts vLLM routed each position to, uint8 [len, layers, top_k], NO_ROUTE where
    none was recorded (prl.orchestrator.trajectory.routing_of); None: not asked for, or none returned."""

    def __len__(self) -> int:
        return len(self.input_ids)


def assign_to_ranks(items: list, world_size: int, tokens: Callable[[Any], int] = len) -> list[list]:
    """Deal samples (or micro-batches: `tokens` counts theirs) to ranks: equal counts (+-1), token
    totals balanced greedily, longest first.

    Deterministic (stable sort, ties to the lowest rank) so a regenerated batch is laid out alike.
    """
    per_rank = math.ceil(len(items) / world_size)
    ranks: list[list] = [[] for _ in range(world_size)]
    totals = [0] * world_size
    for item in sorted(items, key=tokens, reverse=True):
        open_ranks = [r for r in range(world_size) if len(ranks[r]) < per_rank]
        rank = min(open_ranks, key=lambda r: totals[r])
        ranks[rank].append(item)
        totals[rank] += tokens(item)
    return ranks


def micro_batch(samples: list[Sample]) -> dict:
    """Pack samples into one [1, T] row; a sample's advantage sits on its loss tokens, 0 elsewhere."""
    ids = [t for s in samples for t in s.input_ids]
    positions = [p for s in samples for p in range(len(s))]
    mask = [m for s in samples for m in s.loss_mask]
    advantages = [s.advantage if m else 0.0 for s in samples for m in s.loss_mask]
    logprobs = [lp for s in samples for lp in s.logprobs]
    teacher = {}
    if any(s.teacher_logprobs is not None for s in samples):
        if any(s.teacher_logprobs is None or len(s.teacher_logprobs) != len(s) for s in samples):
            raise ValueError("a micro-batch mixes samples with and without the teacher's logprobs of every token")
        teacher["teacher_logprobs"] = torch.tensor([[lp for s in samples for lp in s.teacher_logprobs]],
                                                   dtype=torch.float32)
    return teacher | routed_experts(samples) | {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "loss_mask": torch.tensor([mask], dtype=torch.bool),
        "advantages": torch.tensor([advantages], dtype=torch.float32),
        "behaviour_logprobs": torch.tensor([logprobs], dtype=torch.float32),
        "num_samples": len(samples),
    }


def routed_experts(samples: list[Sample]) -> dict:
    """{"routed_experts": uint8 [1, T, layers, top_k]} where any sample has them (a sample without: NO_ROUTE
    throughout), else {}."""
    known = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not known:
        return {}
    shape = known[0].shape[1:]
    rows = [s.routed_experts if s.routed_experts is not None else np.full((len(s), *shape), NO_ROUTE, np.uint8)
            for s in samples]
    return {"routed_experts": torch.from_numpy(np.concatenate(rows))[None]}


def empty_micro_batch(teacher: bool = False) -> dict:
    """A one-token micro-batch that contributes no loss (keeps ranks in step); `teacher`: with the
    teacher_logprobs key, as the batch's others."""
    return micro_batch([Sample([0], [False], [0.0], 0.0, [0.0] if teacher else None)]) | {"num_samples": 0}


def by_count(samples: list[Sample], size: int) -> list[list[Sample]]:
    """Consecutive runs of at most `size` samples."""
    return [samples[i : i + size] for i in range(0, len(samples), size)]


def by_tokens(samples: list[Sample], budget: int) -> list[list[Sample]]:
    """First fit, longest first: each sample goes into the first micro-batch it fits in (at most
    `budget` tokens), a new one if none. Deterministic: a stable sort, micro-batches in opening order."""
    bins: list[list[Sample]] = []
    room: list[int] = []
    for sample in sorted(samples, key=len, reverse=True):
        if len(sample) > budget:
            raise ValueError(f"a sample of {len(sample)} tokens exceeds the micro-batch budget of {budget} (see over_budget)")
        i = next((i for i, free in enumerate(room) if len(sample) <= free), len(bins))
        if i == len(bins):
            bins.append([])
            room.append(budget)
        bins[i].append(sample)
        room[i] -= len(sample)
    return bins


def over_budget(samples: list[Sample], budget: int | None, step: int) -> tuple[list[Sample], int]:
    """(the samples that fit in a micro-batch of `budget` tokens, how many did not), each of those
    logged. The config keeps the budget >= model.max_model_len, so only a server started with a
    longer --max-model-len (in inference.extra_args) can return a longer sample; a sample cannot be
    split over micro-batches, and truncating it would train a prefix on the whole rollout's reward."""
    if budget is None:
        return samples, 0
    kept = [s for s in samples if len(s) <= budget]
    for s in samples:
        if len(s) > budget:
            logger.warning(f"batch {step}: a sample of {len(s)} tokens exceeds trainer.micro_batch_tokens={budget}; "
                           "not trained")
    return kept, len(samples) - len(kept)


def pack_batch(samples: list[Sample], world_size: int, micro_batch_size: int,
               micro_batch_tokens: int | None = None) -> list[list[dict]]:
    """micro_batches[rank] = list of micro-batch dicts, the same number on every rank.

    By count: samples dealt to ranks, then cut into runs of micro_batch_size. By tokens (every
    sample must fit: over_budget): the whole batch packed first, the micro-batches then dealt to
    ranks, so each rank runs ceil(micro-batches / ranks) forward passes, not one more because its
    share of samples happened to pack worse.
    """
    if micro_batch_tokens is None:
        chunks = [by_count(rank_samples, micro_batch_size) for rank_samples in assign_to_ranks(samples, world_size)]
    else:
        chunks = assign_to_ranks(by_tokens(samples, micro_batch_tokens), world_size, tokens=lambda mb: sum(map(len, mb)))
    per_rank = [[micro_batch(chunk) for chunk in rank_chunks] for rank_chunks in chunks]
    count = max(1, max(len(mbs) for mbs in per_rank))
    teacher = any(s.teacher_logprobs is not None for s in samples)
    return [mbs + [empty_micro_batch(teacher) for _ in range(count - len(mbs))] for mbs in per_rank]
