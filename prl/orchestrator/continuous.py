"""orchestrator.continuous: requests in flight across batches, each policy version loaded into the
servers as soon as the trainer publishes it, while requests run.

    prl submit configs/X.yaml orchestrator.continuous=true      # needs run.async_level >= 1

The default loop (loop.generate_batches) waits for a batch's last group before the next batch's
first one starts, and loads a version only between batches. Here three tasks share the servers:
- the feeder starts the groups of batch n's data (data.step_parts, the default mode's data order)
  once the servers hold version n - async_level, keeping max_concurrent // group size groups running;
- the follower loads version v + 1 as soon as it exists, in flight: running requests pause, are
  recomputed under the new weights and go on (prl/inference/reload.py); an online eval of a due
  version runs before the next version loads, so the eval sees that version alone;
- the batch loop (generate_continuously) gives batch n the first groups to finish, per environment
  its share of a step. A group that started before version n - async_level (a slow one, overtaken)
  is dropped as stale and counted (`stale_groups`), and its prompts run again once the servers hold
  version n - async_level: every group of data is trained on once, and the batches to come are not
  a group short (the feeder starts only a step's groups per step, so a lost group would leave the
  last batches waiting for a group that never starts).

So no batch holds a group older than in the default mode, and the orchestrator is never more than
async_level + 1 batches ahead (a group of batch n's data waits for version n - async_level, which
the trainer writes after consuming batch n - async_level - 1). What differs: one sample may hold
tokens of several versions, each with vLLM's logprob of the version that drew it (the importance
ratio's behaviour policy, hence trainer.behaviour_logprobs=inference), and a batch depends on timing:
a resumed run goes on from its checkpoint, feeding from that step's data, but cannot regenerate the
interrupted run's batches.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from statistics import fmean

from loguru import logger

from prl.orchestrator.dataset import EnvGroups, step_parts
from prl.orchestrator.policy import Launch
from prl.orchestrator.rollouts import run_group, score_groups, write_step


Work = tuple[int, EnvGroups, list[dict]]
"""A group to run: (environment index, its part of the step, the group's rollout inputs)."""


@dataclass
class Finished:
    """One group's verifiers outputs, the versions the servers held when it started and ended, and
    the work it ran (run again if it is dropped as stale)."""

    outputs: list[dict]
    started: int
    ended: int
    work: Work


def interleaved(parts: list[EnvGroups]) -> list[Work]:
    """A step's groups as (environment index, part, group), the environments mixed evenly through
    the step, so each one's share of a batch finishes at about the same time."""
    order = sorted(((j + 0.5) / len(p.groups), i, j) for i, p in enumerate(parts) for j in range(len(p.groups)))
    return [(i, parts[i], parts[i].groups[j]) for _, i, j in order]


def take_fresh(queues: list[deque[Finished]], counts: list[int], chosen: list[list[Finished]],
               oldest: int) -> list[Finished]:
    """Move finished groups, oldest first, from each environment's queue into `chosen` until it holds
    that environment's count; those that started before version `oldest` are dropped, and returned."""
    stale = []
    for queue, count, taken in zip(queues, counts, chosen):
        while queue and len(taken) < count:
            group = queue.popleft()
            (stale if group.started < oldest else taken).append(group)
    return stale


class Flow:
    """The groups in flight and finished, as the version the servers hold (launch.policy) goes up."""

    def __init__(self, launch: Launch):
        self.launch = launch
        self.changed = asyncio.Condition()
        self.done: list[deque[Finished]] = [deque() for _ in launch.envs]
        self.error: BaseException | None = None
        group_size = launch.cfg.orchestrator.rollouts_per_example
        self.slots = asyncio.Semaphore(max(1, launch.cfg.orchestrator.max_concurrent // group_size))
        self.running: set[asyncio.Task] = set()
        self.groups_started = 0
        self.update_s: list[float] = []
        """Seconds of the versions loaded since the last batch."""
        self.eval_metrics: dict[str, float] = {}

    @property
    def version(self) -> int:
        """The version every server holds (Policy.version; `changed` is notified when it goes up)."""
        return self.launch.policy.version

    async def guard(self, work: Awaitable[None]) -> None:
        """Run `work`; an error it raises ends the flow: the batch loop raises it."""
        try:
            await work
        except Exception as e:
            async with self.changed:
                self.error = self.error or e
                self.changed.notify_all()

    async def wait_for_version(self, version: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.version >= version or self.error is not None)

    async def feed(self) -> None:
        cfg = self.launch.cfg
        for step in itertools.count(self.launch.start):
            await self.wait_for_version(self.launch.policy.required(step))
            parts = step_parts(self.launch.envs, self.launch.sampling, cfg.orchestrator.rollouts_per_example,
                               cfg.run.seed, step)
            for work in interleaved(parts):
                await self.slots.acquire()
                self.start(self.run_group(work))

    def start(self, work: Awaitable[None]) -> None:
        task = asyncio.create_task(self.guard(work))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def run_again(self, work: Work, oldest: int) -> None:
        """A stale group's prompts, once more, from version `oldest` (its batch's) on."""
        await self.wait_for_version(oldest)
        await self.slots.acquire()
        await self.run_group(work)

    async def run_group(self, work: Work) -> None:
        """Run `work` on a slot already taken; released here."""
        env_index, part, group = work
        started, index = self.version, self.groups_started
        self.groups_started += 1
        try:
            outputs = await self.generate(part, index, group)
        finally:
            self.slots.release()
        async with self.changed:
            self.done[env_index].append(Finished(outputs, started, self.version, work))
            self.changed.notify_all()

    async def generate(self, part: EnvGroups, index: int, group: list[dict]) -> list[dict]:
        """One group's verifiers outputs, on the server `index` picks (round robin)."""
        return await run_group(part.env, self.launch.servers, index, group, self.launch.model, part.sampling)

    async def follow(self, last: int) -> None:
        """Load every version after the current one up to `last` (batch max_steps - 1's)."""
        await self.evaluate_if_due()
        while self.version < last:
            seconds = await self.launch.policy.advance()
            async with self.changed:
                self.update_s.append(seconds)
                self.changed.notify_all()
            await self.evaluate_if_due()

    async def evaluate_if_due(self) -> None:
        online, launch = self.launch.online, self.launch
        if online and online.due(self.version):
            self.eval_metrics = await online.run(self.version, launch.servers, launch.model)

    async def take(self, step: int) -> tuple[list[list[Finished]], int]:
        """Batch `step`'s groups per environment, the first to finish that started at version
        step - async_level or later; and how many were dropped as stale (each one runs again)."""
        launch = self.launch
        oldest = launch.policy.required(step)
        counts = [env.count for env in launch.envs]
        chosen: list[list[Finished]] = [[] for _ in counts]
        stale = 0
        async with self.changed:
            while True:
                if self.error is not None:
                    raise self.error
                for group in take_fresh(self.done, counts, chosen, oldest):
                    stale += 1
                    self.start(self.run_again(group.work, oldest))
                if all(len(taken) == count for taken, count in zip(chosen, counts)):
                    return chosen, stale
                await self.changed.wait()

    def batch_metrics(self, step: int, chosen: list[list[Finished]], stale: int) -> dict[str, float]:
        groups = [group for taken in chosen for group in taken]
        oldest = min(group.started for group in groups)
        metrics = {"policy_version": float(oldest), "off_policy_steps": float(step - oldest),
                   "stale_groups": float(stale), "mixed_version_frac": fmean(g.ended > g.started for g in groups),
                   "weight_update_s": sum(self.update_s)} | self.eval_metrics
        self.update_s, self.eval_metrics = [], {}
        return metrics

    async def stop(self, tasks: list[asyncio.Task]) -> None:
        """Cancel the feeder and every group still running (their requests are aborted on the servers)."""
        for task in [*tasks, *self.running]:
            task.cancel()
        await asyncio.gather(*tasks, *self.running, return_exceptions=True)


async def generate_continuously(launch: Launch) -> None:
    """Batches start..max_steps-1 from the flow."""
    cfg, watchdog, orch, policy = launch.cfg, launch.watchdog, launch.cfg.orchestrator, launch.policy
    watchdog.expect(f"policy version {policy.required(launch.start)} for batch {launch.start}", 2 * watchdog.window())
    await policy.ensure(launch.start)
    flow = Flow(launch)
    follower = asyncio.create_task(flow.guard(flow.follow(policy.required(cfg.run.max_steps - 1))))
    feeder = asyncio.create_task(flow.guard(flow.feed()))
    try:
        began = time.perf_counter()
        for step in range(launch.start, cfg.run.max_steps):
            watchdog.expect(f"batch {step}: rollouts from policy version {policy.required(step)} on",
                            2 * watchdog.window())
            chosen, stale = await flow.take(step)
            if stale:
                logger.warning(f"batch {step}: {stale} group(s) dropped as stale: they started before policy "
                               f"version {policy.required(step)}; their prompts run again")
            taken = time.perf_counter()
            result = score_groups([e.name for e in launch.envs], [[g.outputs for g in c] for c in chosen],
                                  taken - began, orch.normalize_advantage_std, orch.filter_zero_advantage,
                                  [e.overlong for e in launch.envs])
            if launch.teacher is not None:  # the teacher's logprobs of every sample's tokens, into the batch
                await launch.teacher.score_batch(step, result, watchdog)
            metrics = flow.batch_metrics(step, chosen, stale) | launch.startup_metrics(step)
            write_step(cfg, launch.rd, step, result, metrics, began, launch.data_order(step + 1))
            watchdog.progress(f"batch {step + 1}")
            began = taken
        await flow.stop([feeder])
        # The follower has loaded the last version (the last batch needed it); an eval of it may run.
        await follower
    finally:
        await flow.stop([feeder, follower])
    if flow.error is not None:
        raise flow.error
