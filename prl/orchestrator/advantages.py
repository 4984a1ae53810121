"""Group-relative advantages (GRPO): each rollout's reward minus the mean reward of its prompt's group."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean, pstdev


def group_advantages(
    rewards: Sequence[float], group_size: int, normalize_std: bool = False, eps: float = 1e-6
) -> list[float]:
    """Advantages for rewards laid out as consecutive groups of `group_size` (one prompt each).

    Without std normalisation (the default, as in Dr. GRPO) a group whose rewards barely differ gets
    tiny advantages instead of amplified noise; with it, every group contributes on the same scale.
    A group with equal rewards gets zeros either way (eps keeps 0/0 out).
    """
    if group_size <= 0 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not form groups of {group_size}")
    advantages: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = fmean(group)
        scale = pstdev(group) + eps if normalize_std else 1.0
        advantages += [(r - mean) / scale for r in group]
    return advantages
