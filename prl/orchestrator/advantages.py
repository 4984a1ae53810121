"""Group-relative advantages (GRPO): each rollout's reward minus the mean reward of its prompt's group."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean, pstdev


def group_advantages(
    rewards: Sequence[float | None], group_size: int, normalize_std: bool = False, eps: float = 1e-6
) -> list[float | None]:
    """Advantages for rewards laid out as consecutive groups of `group_size` (one prompt each).

    A reward of None marks a rollout that errored: it has no advantage (None) and stays out of its
    group's mean and std, so an infrastructure failure is not taken for a bad answer ([1, 0, None]
    -> [0.5, -0.5, None], as prime-rl). A group where every rollout errored has no advantages.

    Without std normalisation (the default, as in Dr. GRPO) a group whose rewards barely differ gets
    tiny advantages instead of amplified noise; with it, every group contributes on the same scale.
    A group with equal rewards gets zeros either way (eps keeps 0/0 out).
    """
    if group_size <= 0 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not form groups of {group_size}")
    advantages: list[float | None] = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        scored = [r for r in group if r is not None]
        if not scored:
            advantages += [None] * len(group)
            continue
        mean = fmean(scored)
        scale = pstdev(scored) + eps if normalize_std else 1.0
        advantages += [None if r is None else (r - mean) / scale for r in group]
    return advantages
