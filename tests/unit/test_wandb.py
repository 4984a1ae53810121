"""What the trainer hands W&B: the whole resolved config (env values hidden), run.name, entity,
group and tags, and one run id for every attempt. `wandb` is replaced by a recorder of its init
calls (the real offline W&B run is exercised in tests/unit/test_trainer_io.py)."""

import dataclasses
import sys
import types

from prl.config import Config, EnvironmentConfig, ModelConfig, OrchestratorConfig, RunConfig, WandbConfig
from prl.run.rundir import RunDir
from prl.trainer.metrics import WandbSink


def fake_wandb(monkeypatch) -> list[dict]:
    calls = []
    module = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or types.SimpleNamespace(id=kw["id"]))
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def config(tmp_path, **wandb) -> Config:
    return Config(
        run=RunConfig(name="my-run", output_dir=str(tmp_path), max_steps=7, wandb=WandbConfig(**wandb)),
        model=ModelConfig(name="model"),
        orchestrator=OrchestratorConfig(environment=EnvironmentConfig(id="x"), batch_size=8, rollouts_per_example=4),
        env={"HF_TOKEN": "secret-token"},
    )


def test_whole_config_name_entity_group_tags_and_one_id_for_every_attempt(tmp_path, monkeypatch):
    calls = fake_wandb(monkeypatch)
    cfg = config(tmp_path, entity="team", group="ablation-1", tags=["gsm8k", "async2"])
    for _attempt in range(2):  # each attempt's trainer makes its own sink
        WandbSink(cfg, RunDir(tmp_path))
    first, second = calls
    assert first["id"] == second["id"] == (tmp_path / "wandb_id").read_text().strip() and first["resume"] == "allow"
    assert (first["name"], first["entity"], first["group"], first["tags"]) == ("my-run", "team", "ablation-1", ["gsm8k", "async2"])
    logged = first["config"]
    assert set(logged) == {f.name for f in dataclasses.fields(Config)}  # every section
    assert logged["run"]["max_steps"] == 7 and logged["orchestrator"]["batch_size"] == 8
    assert logged["env"] == {"HF_TOKEN": "<hidden>"} and "secret-token" not in repr(logged)


def test_defaults_leave_entity_group_tags_to_wandb(tmp_path, monkeypatch):
    calls = fake_wandb(monkeypatch)
    WandbSink(config(tmp_path), RunDir(tmp_path))
    assert (calls[0]["entity"], calls[0]["group"], calls[0]["tags"]) == (None, None, None)
