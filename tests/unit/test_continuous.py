"""orchestrator.continuous's scheduling: which finished groups a batch takes, the feeding order, and
the flow of groups through versions with groups whose finishing the test decides (the environments
are real, the requests are not sent). Against real vLLM:
tests/integration/test_orchestrator_vllm.py::test_continuous_mode_loads_versions_while_requests_run."""

from __future__ import annotations

import asyncio
from collections import deque

from orchestrator_helpers import two_env_config
from prl.orchestrator.continuous import Finished, Flow, interleaved, take_fresh
from prl.orchestrator.dataset import EnvGroups, load_train_envs, step_parts
from prl.orchestrator.policy import Launch, Policy
from prl.run.rundir import RunDir


def finished(*started: int) -> deque[Finished]:
    return deque(Finished([{"id": i}], s, s, (0, None, [])) for i, s in enumerate(started))


def test_a_batch_takes_the_first_fresh_groups_per_environment_and_drops_stale_ones():
    queues = [finished(1, 0, 2, 2, 3), finished(2, 1)]
    chosen = [[], []]
    stale = take_fresh(queues, [3, 2], chosen, oldest=2)
    assert [g.started for g in stale] == [1, 0, 1]  # env 0's groups from v1 and v0, env 1's from v1
    assert [g.started for g in chosen[0]] == [2, 2, 3] and [g.started for g in chosen[1]] == [2]
    assert not queues[0] and not queues[1]  # env 1 still lacks one: the batch waits for it
    queues[1].extend(finished(0, 4, 5))
    assert len(take_fresh(queues, [3, 2], chosen, oldest=2)) == 1
    assert [g.started for g in chosen[1]] == [2, 4] and [g.started for g in queues[1]] == [5]  # left for the next


def test_a_step_feeds_its_environments_evenly_mixed():
    parts = [EnvGroups("a", None, [["a"]] * 6, {}), EnvGroups("b", None, [["b"]] * 2, {})]
    order = [i for i, _, _ in interleaved(parts)]
    assert order == [0, 0, 1, 0, 0, 0, 1, 0] and len(order) == 8
    assert [group for _, _, group in interleaved(parts)].count(["b"]) == 2


def test_a_stale_group_runs_again_and_no_later_batch_is_short(tmp_path):
    """The first group (of batch 0's data) finishes only once version 2 is loaded: batch 2 drops it as
    stale and its prompts run again, from version 1 on. Every batch is whole. (Before, nothing ran it
    again. The feeder starts a step's groups only, and the servers end at the last batch's version
    (2): no group of batch 4's data ever starts, so the last batch waited for a group for ever. An
    e2e run on a loaded machine hung so; in a long run, every lost group shortens the lead of
    async_level steps of groups until a batch in the middle waits too.)"""
    cfg = two_env_config(tmp_path)  # 16 rollouts in groups of 2 a step: 6 toy groups, 2 of rev
    cfg.run.async_level, cfg.orchestrator.max_concurrent = 1, 4
    envs = load_train_envs(cfg)
    launch = Launch(cfg, RunDir(tmp_path), envs, [{} for _ in envs], "m", Policy(cfg, RunDir(tmp_path), None, 0),
                    None, None)

    class Scripted(Flow):
        async def generate(self, part, index, group):
            if index == 0:  # overtaken by the rest
                await self.wait_for_version(2)
            await asyncio.sleep(0.001)
            return [dict(item) for item in group]

    async def run() -> list:
        flow = Scripted(launch)
        feeder = asyncio.create_task(flow.guard(flow.feed()))
        batches = []
        for step in range(4):
            batches.append(await asyncio.wait_for(flow.take(step), 10))
            async with flow.changed:  # the trainer took batch `step`; the follower loads its version,
                launch.policy.version = min(step + 1, 2)  # up to the last batch's (3 - async_level)
                flow.changed.notify_all()
        await flow.stop([feeder])
        return batches

    batches = asyncio.run(run())
    parts = step_parts(envs, launch.sampling, cfg.orchestrator.rollouts_per_example, cfg.run.seed, 0)
    env_index, _, first = interleaved(parts)[0]  # the overtaken group
    assert [stale for _, stale in batches] == [0, 0, 1, 0]
    for step, (chosen, _) in enumerate(batches):
        assert [len(groups) for groups in chosen] == [6, 2]
        assert all(g.started >= step - 1 for groups in chosen for g in groups)
    again = [g for chosen, _ in batches for g in chosen[env_index] if g.work[2] == first]
    assert len(again) == 1 and again[0].started >= 1 and again[0].outputs == first
