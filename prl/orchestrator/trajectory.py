"""A verifiers trajectory -> one training sample (prl.run.packing.Sample), or why it cannot be one."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from prl.run.packing import NO_ROUTE, Sample

DROP_REASONS = ("no_tokens", "prompt_mismatch", "empty_completion")
"""Why a rollout may not become a sample; each is counted per step as `rollout/dropped/<reason>`."""


@dataclass(frozen=True)
class Dropped:
    """A rollout that cannot be trained on as one token sequence."""

    reason: str
    """One of DROP_REASONS."""
    detail: str
    """What exactly, for the log (which turn, which token)."""


def sample_from_trajectory(trajectory: list[dict], advantage: float) -> Sample | Dropped:
    """Join a verifiers trajectory's turns into one token sequence, or say why it cannot be done.

    A later turn's prompt must extend everything before it (prompt + completion of the previous
    turn, then the environment's reply): only then is the whole rollout one sequence. A chat
    template that re-renders history differently breaks that, and such rollouts are dropped.
    """
    if not trajectory:
        return Dropped("no_tokens", "the trajectory has no turns")
    ids: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    for number, turn in enumerate(trajectory, start=1):
        tokens = turn.get("tokens")
        if tokens is None:
            return Dropped("no_tokens", f"turn {number} has no token ids")
        if tokens["prompt_ids"][: len(ids)] != ids:
            where = _first_difference(ids, tokens["prompt_ids"])
            return Dropped("prompt_mismatch", f"turn {number}'s prompt does not extend turns 1..{number - 1} ({where})")
        new_prompt = tokens["prompt_ids"][len(ids) :]
        ids += new_prompt
        mask += [False] * len(new_prompt)
        logprobs += [0.0] * len(new_prompt)
        ids += tokens["completion_ids"]
        mask += [bool(m) for m in tokens["completion_mask"]]
        logprobs += [float(lp) if m else 0.0 for lp, m in zip(tokens["completion_logprobs"], tokens["completion_mask"])]
    if not any(mask):
        return Dropped("empty_completion", f"no token in the loss mask ({len(ids)} tokens in {len(trajectory)} turns)")
    return Sample(ids, mask, logprobs, advantage, routed_experts=routing_of(trajectory, len(ids)))


def routing_of(trajectory: list[dict], length: int) -> np.ndarray | None:
    """The experts vLLM routed each of the sample's `length` positions to, uint8 [length, layers, top_k]
    (trainer.routing_replay), from the turns' payloads (verifiers' RoutedExpertsPayload, rows from
    position `start`); NO_ROUTE where no turn recorded one (the last token, which vLLM never runs).
    A position two turns recorded keeps the first: the turn that sampled the tokens after it routed it so
    (a later turn's prefill of the same prefix runs other kernels). None: no turn has a payload."""
    out = None
    for turn in trajectory:
        payload = turn["tokens"].get("routed_experts")
        if payload is None:
            continue
        rows = np.frombuffer(base64.b64decode(payload["data"]), dtype=payload["dtype"]).reshape(payload["shape"])
        if out is None:
            out = np.full((length, *rows.shape[1:]), NO_ROUTE, dtype=np.uint8)
        start = payload["start"]
        span = out[start : start + len(rows)]
        free = span[:, 0, 0] == NO_ROUTE
        span[free] = rows[: len(span)][free]
    return out


def _first_difference(before: list[int], prompt: list[int]) -> str:
    for i, (a, b) in enumerate(zip(before, prompt)):
        if a != b:
            return f"first difference at token {i}: {a} became {b}"
    return f"the prompt has {len(prompt)} tokens, the turns before it {len(before)}"
