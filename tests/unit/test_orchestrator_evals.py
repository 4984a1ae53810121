"""Online evals: held-out groups with their own seeds, eval records and metrics, which versions are due.

    pytest tests/unit/test_orchestrator_evals.py
"""

from __future__ import annotations

import itertools
import json
from statistics import fmean

import pytest
from orchestrator_helpers import mark, two_env_config

from prl.config import ConfigError, EnvironmentConfig, EvalConfig, EvalSamplingConfig
from prl.orchestrator.dataset import SEED_KEY, EnvGroups, load_train_envs, step_parts
from prl.orchestrator.evals import (OnlineEval, eval_completions, eval_completions_path, eval_metrics, eval_parts,
                                    make_record, weights_label, write_record)
from prl.orchestrator.passk import k_metrics, pass_at_k
from prl.run.rundir import RunDir


def test_eval_groups_are_the_held_out_rows_with_their_own_seeds(tmp_path):
    cfg = two_env_config(tmp_path, num_examples=5, rollouts_per_example=2, sampling=EvalSamplingConfig(temperature=0.0))
    envs = load_train_envs(cfg)
    parts = eval_parts(cfg, {e.name: e.env for e in envs})
    assert [p.name for p in parts] == ["toy", "rev"] and parts[0].env is envs[0].env  # reused, not reloaded
    held_out = {row["question"] for row in envs[1].env.get_eval_dataset()}
    assert all(g[0]["prompt"][-1]["content"] in held_out for g in parts[1].groups)
    assert [len(p.groups) for p in parts] == [5, 5] and all(len(g) == 2 for p in parts for g in p.groups)
    assert parts[0].sampling["temperature"] == 0.0 and parts[0].sampling["max_tokens"] == 256  # the rest: training's
    seeds = {row[SEED_KEY] for p in parts for g in p.groups for row in g}
    assert len(seeds) == 20
    training = {row[SEED_KEY] for step in range(50) for p in step_parts(envs, [{}, {}], 2, 3, step) for g in p.groups for row in g}
    assert not seeds & training
    assert eval_parts(cfg)[1].groups == parts[1].groups  # the same rows and seeds whenever it runs
    other = two_env_config(tmp_path, environments=[EnvironmentConfig(id="prl.envs.toy", name="t2")])
    assert [(p.name, len(p.groups)) for p in eval_parts(other)] == [("t2", 64)]
    # An eval entry written as a training one (its ratio aside) is that environment, not a second load of
    # it; the same name with other args is loaded on its own.
    same = two_env_config(tmp_path, environments=[EnvironmentConfig(id="prl.envs.toy", args={"num_examples": 8}),
                                                  EnvironmentConfig(id="prl.envs.reverse_text", name="rev", args={"num_examples": 4})])
    toy, rev = eval_parts(same, {e.name: e.env for e in envs})
    assert toy.env is envs[0].env and rev.env is not envs[1].env


def test_an_environments_own_max_tokens_limits_its_turns_in_training_and_in_its_evals(tmp_path):
    """`max_tokens` of an entry: its training rollouts, its over-long rule and its evals use it; the other
    entry keeps orchestrator.sampling's; orchestrator.eval.sampling.max_tokens, set, wins in evals."""
    from dataclasses import replace

    from prl.orchestrator.overlong import train_rules

    cfg = two_env_config(tmp_path)
    orch = cfg.orchestrator
    orch.environments[1] = replace(orch.environments[1], max_tokens=32)
    assert [orch.max_tokens_of(env) for env in orch.train_environments] == [256, 32]
    assert [rule.max_tokens for rule in train_rules(cfg)] == [256, 32]
    assert [envs.overlong.max_tokens for envs in load_train_envs(cfg)] == [256, 32]
    assert [part.sampling["max_tokens"] for part in eval_parts(cfg)] == [256, 32]
    cfg.orchestrator.eval = EvalConfig(sampling=EvalSamplingConfig(max_tokens=8))
    assert [part.sampling["max_tokens"] for part in eval_parts(cfg)] == [8, 8]


def test_eval_record_and_metrics(tmp_path):
    cfg, rd = two_env_config(tmp_path, interval=2), RunDir(tmp_path)
    result = {"reward_mean": 0.25, "reward_std": 0.1, "rollouts": 4, "seconds": 1.0,
              "environments": {"toy": {"reward_mean": 0.5, "rollouts": 2.0}, "rev": {"reward_mean": 0.0, "rollouts": 2.0}}}
    record = make_record(cfg, result, 4, weights_label(rd, cfg, 4), "online")
    path = write_record(rd, record, [])
    assert path == tmp_path / "evals" / "step_4.json"
    saved = json.loads(path.read_text())
    assert saved["policy_version"] == 4 and saved["weights"] == str(tmp_path / "weights" / "step_4")
    assert weights_label(rd, cfg, 0) == "m"  # version 0 is model.name
    assert eval_metrics(saved) == {"eval/reward_mean": 0.25, "eval/policy_version": 4.0, "eval/toy/reward_mean": 0.5,
                                   "eval/toy/rollouts": 2.0, "eval/rev/reward_mean": 0.0, "eval/rev/rollouts": 2.0}
    # Every rollout of an environment errored: no mean, written as null (JSON has no NaN).
    nan = float("nan")
    errored = make_record(cfg, {**result, "reward_mean": nan, "environments": {"toy": {"reward_mean": nan}}}, 5, "w", "online")
    assert '"reward_mean": null' in write_record(rd, errored, []).read_text()
    assert json.loads((tmp_path / "evals/step_5.json").read_text())["environments"] == {"toy": {"reward_mean": None}}
    (tmp_path / "evals/step_5.json").unlink()
    online = OnlineEval(cfg, rd, [])
    assert [v for v in range(7) if online.due(v)] == [0, 2, 6]  # 4 has its file already
    assert online.remaining(newest_loaded=2, first_step=0) == [6, 8, 10, 12, 14, 16, 18, 20]  # the final one too
    # Relaunched at step 12: versions before it come back only if their weights are still there.
    mark(tmp_path / "weights" / "step_8")
    assert online.remaining(newest_loaded=2, first_step=12) == [8, 12, 14, 16, 18, 20]


def rollout(reward, example, error=None):
    return {"reward": reward, "example_id": example, "error": error, "prompt": [], "completion": []}


def test_pass_at_k_and_avg_at_k_match_a_brute_force_count_over_every_k_subset_of_the_saved_completions(tmp_path):
    """The estimator 1 - C(n-c, k)/C(n, k) against the count it stands for: of all k-subsets of an
    example's rollouts (read back from evals/step_V.completions.jsonl), the share holding one that
    passes; avg@k against the mean reward over all k-subsets. Errored rollouts count as failures."""
    cfg, rd = two_env_config(tmp_path, rollouts_per_example=5, pass_k=[1, 2, 3, 5], pass_threshold=0.75), RunDir(tmp_path)
    rewards = [[1, 0, 0, 0, 0], [1, 1, 0.8, 0, 0.5], [0] * 5, [1] * 5, [0.75, None, 0.2, 1, 0.1]]
    groups = [[rollout(r, i, "boom" if r is None else None) for r in group] for i, group in enumerate(rewards)]
    parts, per_env = [EnvGroups("toy", None, [], {})], [groups]
    ev = cfg.orchestrator.eval
    result = {"reward_mean": 0.0, "reward_std": 0.0, "rollouts": 25, "seconds": 0.0,
              "environments": {"toy": k_metrics(groups, ev.pass_k, ev.pass_threshold)}}
    path = write_record(rd, make_record(cfg, result, 3, "w", "online"), eval_completions(parts, per_env))
    saved = [json.loads(line) for line in eval_completions_path(path).read_text().splitlines()]
    by_example: dict[int, list[float]] = {}
    for c in saved:
        by_example.setdefault(c["example_id"], []).append(0.0 if c["error"] else c["reward"])
    record = json.loads(path.read_text())["environments"]["toy"]
    for k in ev.pass_k:
        subsets = [list(itertools.combinations(r, k)) for r in by_example.values()]
        brute_pass = fmean(fmean(any(x >= 0.75 for x in s) for s in subs) for subs in subsets)
        brute_avg = fmean(fmean(fmean(s) for s in subs) for subs in subsets)
        assert record[f"pass@{k}"] == pytest.approx(brute_pass, abs=1e-12), k
        assert record[f"avg@{k}"] == pytest.approx(brute_avg, abs=1e-12), k
    assert record["pass@1"] == pytest.approx((0.2 + 0.6 + 0 + 1 + 0.4) / 5)  # 0.8 passes, 0.5 not; the error fails
    assert record["pass@5"] == 0.8 and pass_at_k(5, 0, 5) == 0.0


@pytest.mark.parametrize("k", [0, 3])
def test_pass_k_must_fit_the_rollouts_per_example(k):
    with pytest.raises(ConfigError, match=r"orchestrator\.eval\.pass_k: k=%d must be between 1 and" % k):
        EvalConfig(rollouts_per_example=2, pass_k=[1, k])
