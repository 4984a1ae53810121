"""Helpers shared by the orchestrator tests (test_orchestrator_data.py, _evals.py, _rundir.py): a config
with two training environments, and a directory marked complete."""

from __future__ import annotations

from pathlib import Path

from prl.config import Config, EnvironmentConfig, EvalConfig, ModelConfig, OrchestratorConfig, RunConfig


def two_env_config(tmp_path: Path, **eval_kw) -> Config:
    envs = [EnvironmentConfig(id="prl.envs.toy", args={"num_examples": 8}, ratio=3),
            EnvironmentConfig(id="prl.envs.reverse_text", name="rev")]
    return Config(run=RunConfig(name="r", output_dir=str(tmp_path), seed=3), model=ModelConfig(name="m"),
                  orchestrator=OrchestratorConfig(environments=envs, batch_size=16, rollouts_per_example=2,
                                                  eval=EvalConfig(**eval_kw)))


def mark(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "COMPLETE").touch()
