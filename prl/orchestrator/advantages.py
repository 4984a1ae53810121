"""Group-relative advantages (GRPO): each rollout's reward minus the mean reward of its prompt's group."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean, pstdev


def group_advantages(
    rewards: Sequence[float | None], group_size: int | Sequence[int], normalize_std: bool = False, eps: float = 1e-6,
    seats: Sequence[str | None] | None = None,
) -> list[float | None]:
    """Advantages for rewards laid out as consecutive groups (one prompt each) of `group_size` rewards,
    or of the sizes it lists, group by group (a step that mixes environments of different seat counts:
    each group is rollouts_per_example x its environment's seats).

    A reward of None marks a rollout that errored: it has no advantage (None) and stays out of its
    group's mean and std, so an infrastructure failure is not taken for a bad answer ([1, 0, None]
    -> [0.5, -0.5, None], as prime-rl). A group where every rollout errored has no advantages.

    Without std normalisation (the default, as in Dr. GRPO) a group whose rewards barely differ gets
    tiny advantages instead of amplified noise; with it, every group contributes on the same scale.
    A group with equal rewards gets zeros either way (eps keeps 0/0 out).

    `seats` (one per reward): in an episode of several agents each seat's trace is a rollout, and a
    seat's baseline is taken over that seat's rollouts of the group alone (a writer's reward is not
    comparable with an editor's); None everywhere is one seat.
    """
    seats = [None] * len(rewards) if seats is None else seats
    advantages: list[float | None] = [None] * len(rewards)
    for start, end in group_bounds(len(rewards), group_size):
        by_seat: dict[str | None, list[int]] = {}
        for i in range(start, end):
            by_seat.setdefault(seats[i], []).append(i)
        for members in by_seat.values():
            for i, advantage in zip(members, _baseline([rewards[i] for i in members], normalize_std, eps)):
                advantages[i] = advantage
    return advantages


def group_bounds(count: int, group_size: int | Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of each group of `count` items laid out in groups of `group_size`, or of the listed sizes."""
    if isinstance(group_size, int):
        if group_size <= 0 or count % group_size:
            raise ValueError(f"{count} rewards do not form groups of {group_size}")
        group_size = [group_size] * (count // group_size)
    if any(size <= 0 for size in group_size) or sum(group_size) != count:
        raise ValueError(f"{count} rewards do not form groups of sizes {list(group_size)}")
    bounds, start = [], 0
    for size in group_size:
        bounds.append((start, start + size))
        start += size
    return bounds


def _baseline(group: list[float | None], normalize_std: bool, eps: float) -> list[float | None]:
    scored = [r for r in group if r is not None]
    if not scored:
        return [None] * len(group)
    mean = fmean(scored)
    scale = pstdev(scored) + eps if normalize_std else 1.0
    return [None if r is None else (r - mean) / scale for r in group]
