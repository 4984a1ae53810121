"""Online evals: held-out groups with their own seeds, eval records and metrics, which versions are due.

    pytest tests/unit/test_orchestrator_evals.py
"""

from __future__ import annotations

import json

from orchestrator_helpers import mark, two_env_config

from prl.config import EnvironmentConfig, EvalSamplingConfig
from prl.orchestrator.dataset import SEED_KEY, load_train_envs, step_parts
from prl.orchestrator.evals import OnlineEval, eval_metrics, eval_parts, make_record, weights_label, write_record
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


def test_eval_record_and_metrics(tmp_path):
    cfg, rd = two_env_config(tmp_path, interval=2), RunDir(tmp_path)
    result = {"reward_mean": 0.25, "reward_std": 0.1, "rollouts": 4, "seconds": 1.0,
              "environments": {"toy": {"reward_mean": 0.5, "rollouts": 2.0}, "rev": {"reward_mean": 0.0, "rollouts": 2.0}}}
    record = make_record(cfg, result, 4, weights_label(rd, cfg, 4), "online")
    path = write_record(rd, record)
    assert path == tmp_path / "evals" / "step_4.json"
    saved = json.loads(path.read_text())
    assert saved["policy_version"] == 4 and saved["weights"] == str(tmp_path / "weights" / "step_4")
    assert weights_label(rd, cfg, 0) == "m"  # version 0 is model.name
    assert eval_metrics(saved) == {"eval/reward_mean": 0.25, "eval/policy_version": 4.0, "eval/toy/reward_mean": 0.5,
                                   "eval/toy/rollouts": 2.0, "eval/rev/reward_mean": 0.0, "eval/rev/rollouts": 2.0}
    # Every rollout of an environment errored: no mean, written as null (JSON has no NaN).
    nan = float("nan")
    errored = make_record(cfg, {**result, "reward_mean": nan, "environments": {"toy": {"reward_mean": nan}}}, 5, "w", "online")
    assert '"reward_mean": null' in write_record(rd, errored).read_text()
    assert json.loads((tmp_path / "evals/step_5.json").read_text())["environments"] == {"toy": {"reward_mean": None}}
    (tmp_path / "evals/step_5.json").unlink()
    online = OnlineEval(cfg, rd, [])
    assert [v for v in range(7) if online.due(v)] == [0, 2, 6]  # 4 has its file already
    assert online.remaining(newest_loaded=2, first_step=0) == [6, 8, 10, 12, 14, 16, 18, 20]  # the final one too
    # Relaunched at step 12: versions before it come back only if their weights are still there.
    mark(tmp_path / "weights" / "step_8")
    assert online.remaining(newest_loaded=2, first_step=12) == [8, 12, 14, 16, 18, 20]
