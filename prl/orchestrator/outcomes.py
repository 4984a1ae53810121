"""What a step's or an eval's rollouts scored, without any training view: reward, counts, the rubric's
own metrics, and each seat's of a multi-agent episode (docs/monitoring.md). prl.orchestrator.rollouts
adds what the trainer was given (rollout/*); prl.orchestrator.evals reports these per environment.
"""

from __future__ import annotations

from statistics import fmean, pstdev


def outcome_metrics(group_outputs: list[list[dict]]) -> dict[str, float]:
    """What the rollouts scored, without any training view (per environment, and evals): reward
    mean and spread over scored (not errored) rollouts, counts, and the rubric's own metrics."""
    flat = [output for group in group_outputs for output in group]
    rewards = [float(output.get("reward") or 0.0) for output in flat if output.get("error") is None]
    metrics = {
        "reward_mean": fmean(rewards) if rewards else float("nan"),
        "reward_std": pstdev(rewards) if rewards else float("nan"),
        "rollouts": float(len(flat)),
        "error_frac": fmean(output.get("error") is not None for output in flat),
        "truncated_frac": fmean(bool(output.get("is_truncated")) for output in flat),
    }
    return metrics | rubric_metrics(flat) | seat_metrics(flat)


def seat_metrics(flat: list[dict]) -> dict[str, float]:
    """An episode of several agents (a v1 env's seats): each seat's reward mean over its scored traces and its
    error share, seat/NAME/...; the seats' rewards are not comparable, so the overall mean alone hides them."""
    seats = sorted({output["seat"] for output in flat if output.get("seat") is not None})
    metrics = {}
    for seat in seats:
        mine = [output for output in flat if output.get("seat") == seat]
        rewards = [float(output.get("reward") or 0.0) for output in mine if output.get("error") is None]
        metrics[f"seat/{seat}/reward_mean"] = fmean(rewards) if rewards else float("nan")
        metrics[f"seat/{seat}/error_frac"] = fmean(output.get("error") is not None for output in mine)
    return metrics


def rubric_metrics(outputs: list[dict]) -> dict[str, float]:
    """The rubric's individual reward functions and metrics, each averaged over the outputs that have a
    value of it (metric/correct_answer, ...)."""
    values: dict[str, list[float]] = {}
    for output in outputs:
        for name, value in (output.get("metrics") or {}).items():
            if value is not None:
                values.setdefault(name, []).append(float(value))
    return {f"metric/{name}": fmean(values[name]) for name in sorted(values)}
