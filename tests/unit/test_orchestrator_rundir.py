"""The orchestrator's run-directory bookkeeping: resume step, policy schedule, weights kept, data order.

    pytest tests/unit/test_orchestrator_rundir.py
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

from loguru import logger
from orchestrator_helpers import mark

from prl.config import Config, EnvironmentConfig, ModelConfig, OrchestratorConfig, RunConfig, SamplingConfig
from prl.orchestrator.policy import Policy
from prl.orchestrator.resume import check_resume, data_order_at, resume_step, stand_in_version, wait_for_weights
from prl.run.batch import policy_version, write_data_order
from prl.run.rundir import RunDir
from prl.trainer.export import prune_weights


def config(tmp_path: Path, **orch) -> Config:
    return Config(
        run=RunConfig(name="r", output_dir=str(tmp_path)),
        model=ModelConfig(name="m"),
        orchestrator=OrchestratorConfig(
            environment=EnvironmentConfig(id="prl.envs.toy"), batch_size=16, rollouts_per_example=4, **orch
        ),
    )


def test_resume_step_is_newest_complete_checkpoint(tmp_path):
    assert resume_step(RunDir(tmp_path)) == 0
    mark(tmp_path / "checkpoints" / "step_4")
    mark(tmp_path / "checkpoints" / "step_8")
    (tmp_path / "checkpoints" / "step_12").mkdir()  # being written: does not exist yet
    assert resume_step(RunDir(tmp_path)) == 8


def test_batch_n_uses_exactly_version_n_minus_async_level():
    assert [policy_version(n, 2) for n in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [policy_version(n, 0) for n in range(3)] == [0, 1, 2]


class FakeServers:
    def __init__(self):
        self.loaded: list[str] = []
        self.staged: list[str] = []

    async def stage_weights(self, path: Path) -> list[str]:
        self.staged.append(path.name)
        return ["staging", "not staged: still reading x"]

    async def update_weights(self, path: Path, in_flight: bool = False) -> list[str]:
        assert not in_flight  # batch by batch: nothing runs while a version loads
        self.loaded.append(path.name)
        return ["file"]


def with_run(cfg: Config, **run) -> Config:
    import dataclasses

    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, **run))


def run_schedule(run_dir: Path, steps: range, async_level: int) -> tuple[list[int], list[str]]:
    """Policy.ensure for each step, as the loop calls it; (versions, weight dirs loaded)."""
    servers, versions = FakeServers(), []
    policy = Policy(with_run(config(run_dir), async_level=async_level), RunDir(run_dir), servers, steps.start)

    async def main():
        for step in steps:
            await policy.ensure(step)
            versions.append(policy.version)

    asyncio.run(main())
    return versions, servers.loaded


def test_policy_schedule_ignores_newer_weights(tmp_path):
    for v in range(1, 6):  # a fast trainer: every version already there
        mark(tmp_path / "weights" / f"step_{v}")
    versions, loaded = run_schedule(tmp_path, range(6), async_level=2)
    assert versions == [0, 0, 0, 1, 2, 3] and loaded == ["step_1", "step_2", "step_3"]


def test_resumed_schedule_loads_the_checkpoints_window(tmp_path):
    for v in (2, 3, 4):  # resumed from checkpoint 4 with async_level 2: (4 - 3, 4] kept
        mark(tmp_path / "weights" / f"step_{v}")
    versions, loaded = run_schedule(tmp_path, range(4, 7), async_level=2)
    assert versions == [2, 3, 4] and loaded == ["step_2", "step_3", "step_4"]


def test_lost_version_is_replaced_by_the_next_one(tmp_path):
    # Resumed from checkpoint 4 whose window is gone (prl resume --step to an older checkpoint): only
    # version 4 comes (the trainer re-writes it); waiting for 2 and 3 would never end.
    assert stand_in_version(RunDir(tmp_path), 2, first_step=4) == 4
    mark(tmp_path / "weights" / "step_3")
    assert stand_in_version(RunDir(tmp_path), 2, first_step=4) == 3
    assert stand_in_version(RunDir(tmp_path), 3, first_step=4) == 3
    assert stand_in_version(RunDir(tmp_path), 5, first_step=4) == 5  # this launch's trainer will write it
    mark(tmp_path / "weights" / "step_4")
    versions, loaded = run_schedule(tmp_path, range(4, 7), async_level=2)
    assert versions == [3, 3, 4] and loaded == ["step_3", "step_4"]


def test_wait_for_weights_returns_once_complete(tmp_path):
    async def trainer():
        await asyncio.sleep(0.2)
        mark(tmp_path / "weights" / "step_2")  # a newer version does not end the wait
        await asyncio.sleep(0.2)
        mark(tmp_path / "weights" / "step_1")

    async def main():
        task = asyncio.create_task(trainer())
        await wait_for_weights(RunDir(tmp_path), 1, poll_s=0.05)
        assert (tmp_path / "weights" / "step_1" / "COMPLETE").exists()  # not before
        await task

    asyncio.run(main())


def test_prune_weights_keeps_every_checkpoints_window(tmp_path):
    def versions() -> list[int]:
        return sorted(int(p.name.removeprefix("step_")) for p in (tmp_path / "weights").iterdir())

    for v in range(1, 11):
        mark(tmp_path / "weights" / f"step_{v}")
    prune_weights(RunDir(tmp_path), newest=10, keep=2)
    assert versions() == [9, 10]  # no checkpoint yet

    for v in range(1, 9):
        mark(tmp_path / "weights" / f"step_{v}")
    (tmp_path / "checkpoints" / "step_6" / "trainer").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_6" / "COMPLETE").touch()
    (tmp_path / "checkpoints" / "step_8" / "trainer").mkdir(parents=True)  # being written: no window
    prune_weights(RunDir(tmp_path), newest=10, keep=2)
    # Batches 6 and 7 of a run resumed from checkpoint 6 need versions 5 and 6 (async_level 1).
    assert versions() == [5, 6, 9, 10]

    (tmp_path / "checkpoints" / "step_8" / "COMPLETE").touch()
    mark(tmp_path / "weights" / "step_11")
    prune_weights(RunDir(tmp_path), newest=11, keep=2)  # `prl resume --step 6` stays exact while 6 exists
    assert versions() == [5, 6, 10, 11]
    mark(tmp_path / "weights" / "step_8")
    prune_weights(RunDir(tmp_path), newest=11, keep=2)
    assert versions() == [5, 6, 8, 10, 11]
    shutil.rmtree(tmp_path / "checkpoints" / "step_6")  # keep_last dropped checkpoint 6: its window goes
    prune_weights(RunDir(tmp_path), newest=11, keep=2)
    assert versions() == [8, 10, 11]


def test_data_order_before_a_step(tmp_path):
    saved = data_order_at(config(tmp_path), 3, num_examples=[10])
    assert saved["step"] == 3 and saved["samples_seen"] == 48 and saved["data_position"] == [12] and saved["epoch"] == [1]
    # An environment whose episodes have 2 seats: 4 examples x 4 episodes x 2 traces a step; the data
    # position (examples) is the same.
    seated = data_order_at(config(tmp_path), 3, num_examples=[10], seats=[2])
    assert seated["samples_seen"] == 96 and seated["data_position"] == [12] and seated["fingerprint"] == saved["fingerprint"]


def test_resume_warns_when_data_order_changed(tmp_path):
    mark(tmp_path / "checkpoints" / "step_3")
    write_data_order(tmp_path / "checkpoints" / "step_3", data_order_at(config(tmp_path), 3, num_examples=[10]))
    messages = []
    sink = logger.add(messages.append, level="WARNING")
    try:
        check_resume(RunDir(tmp_path), 3, data_order_at(config(tmp_path), 3, num_examples=[10]))
        assert not messages
        check_resume(RunDir(tmp_path), 3, data_order_at(config(tmp_path, sampling=SamplingConfig()), 3, num_examples=[11]))
        assert len(messages) == 1 and "data order changed" in messages[0]
    finally:
        logger.remove(sink)


def test_a_checkpoint_of_an_older_prl_keeps_its_data_order_in_orchestrator_json(tmp_path):
    """Before prl.run.batch the orchestrator wrote checkpoints/step_N/orchestrator.json itself; a run
    resumed from such a checkpoint is still checked."""
    mark(tmp_path / "checkpoints" / "step_3")
    old = data_order_at(config(tmp_path), 3, num_examples=[10])
    (tmp_path / "checkpoints" / "step_3" / "orchestrator.json").write_text(json.dumps(old))
    messages = []
    sink = logger.add(messages.append, level="WARNING")
    try:
        check_resume(RunDir(tmp_path), 3, data_order_at(config(tmp_path), 3, num_examples=[11]))
        assert len(messages) == 1 and "data order changed" in messages[0]
    finally:
        logger.remove(sink)


def test_the_next_batchs_version_is_staged_once_written(tmp_path):
    """Policy.stage, beside batch 3 at async 2: waits for weights/step_2 (batch 4's), then stages it; not
    before it is complete, and not at all where it would be useless or is not wanted."""
    import dataclasses

    cfg = with_run(config(tmp_path), async_level=2, max_steps=6)
    servers = FakeServers()

    def holding(version: int, cfg: Config = cfg) -> Policy:
        policy = Policy(cfg, RunDir(tmp_path), servers, first_step=0)
        policy.version = version
        return policy

    async def staged_beside(step: int, version: int) -> list[str]:
        servers.staged.clear()
        task = asyncio.create_task(holding(version).stage(step))
        await asyncio.sleep(0.3)
        assert servers.staged == []  # not complete yet: nothing sent
        mark(tmp_path / "weights" / f"step_{policy_version(step, 2)}")
        await asyncio.wait_for(task, 5)
        return servers.staged

    assert asyncio.run(staged_beside(4, 1)) == ["step_2"]
    for step, version, changed in ((4, 2, {}), (6, 3, {}), (5, 2, {"stage_weights": False}),
                                   (5, 2, {"weight_transfer": "broadcast"})):
        other = dataclasses.replace(cfg, inference=dataclasses.replace(cfg.inference, **changed))
        servers.staged.clear()
        asyncio.run(asyncio.wait_for(holding(version, other).stage(step), 5))
        assert servers.staged == [], (step, version, changed)  # already held, past the end, off, by broadcast
