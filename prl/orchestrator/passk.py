"""pass@k and avg@k of an eval, per environment, from the rollouts drawn for each example.

With n rollouts of an example, c of them passing, the unbiased estimator of pass@k (the chance that
at least one of k rollouts passes; Chen et al. 2021, "Evaluating Large Language Models Trained on
Code") is 1 - C(n-c, k) / C(n, k): the share of the k-subsets of the n rollouts that hold a passing
one, counted without listing them. avg@k, the expected mean reward of k rollouts, is estimated
without bias by the mean over all n. Both are averaged over the examples.

A rollout passes when its reward is at least `orchestrator.eval.pass_threshold` (1.0: a correct
answer of a 0/1 rubric); an errored rollout counts as a failure with reward 0 (it drew no answer).
"""

from __future__ import annotations

from math import comb
from statistics import fmean


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): of n rollouts with c passing, the share of k-subsets with a pass."""
    if not 1 <= k <= n:
        raise ValueError(f"k={k} needs 1 <= k <= n={n}")
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def scores(group: list[dict]) -> list[float]:
    """Each rollout's reward; 0 for an errored one."""
    return [0.0 if output.get("error") is not None else float(output.get("reward") or 0.0) for output in group]


def k_metrics(groups: list[list[dict]], ks: list[int], threshold: float) -> dict[str, float]:
    """{"pass@k": ..., "avg@k": ...} for each k, averaged over the groups (one example each)."""
    metrics: dict[str, float] = {}
    rewards = [scores(group) for group in groups]
    for k in ks:
        metrics[f"pass@{k}"] = fmean(pass_at_k(len(r), sum(x >= threshold for x in r), k) for r in rewards)
        metrics[f"avg@{k}"] = fmean(fmean(r) for r in rewards)
    return metrics
