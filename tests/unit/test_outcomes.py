"""What rollouts scored without a training view (prl.orchestrator.outcomes): per environment and for evals."""

from __future__ import annotations

import pytest

from prl.orchestrator.outcomes import outcome_metrics


def test_outcome_metrics_need_no_tokens():
    groups = [[{"reward": 1.0, "metrics": {"f": 1.0, "g": None}}, {"reward": 0.0, "error": "boom", "is_truncated": True}],
              [{"reward": None}, {"reward": 0.5, "metrics": {"f": 0.0, "g": None}}]]
    m = outcome_metrics(groups)
    assert "metric/g" not in m  # no rollout has a value of it
    assert m["reward_mean"] == 0.5 and m["rollouts"] == 4 and m["error_frac"] == 0.25  # errored: not scored
    assert m["truncated_frac"] == 0.25 and m["metric/f"] == 0.5  # averaged over the rollouts that report it
    assert m["reward_std"] == pytest.approx(0.4082482905)
    assert not any(k.startswith("seat/") for k in m)  # one seat: nothing per seat


def test_outcome_metrics_per_seat_of_a_multi_agent_episode():
    """A writer's reward and an editor's are not comparable: each seat's mean over its scored traces."""
    groups = [[{"seat": "writer", "reward": 1.0}, {"seat": "writer", "reward": 0.0, "error": "boom"},
               {"seat": "editor", "reward": 0.25}, {"seat": "editor", "reward": 0.75}]]
    m = outcome_metrics(groups)
    assert m["reward_mean"] == 2 / 3
    assert {k: v for k, v in m.items() if k.startswith("seat/")} == {
        "seat/editor/reward_mean": 0.5, "seat/editor/error_frac": 0.0,
        "seat/writer/reward_mean": 1.0, "seat/writer/error_frac": 0.5}
