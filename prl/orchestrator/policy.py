"""Policy versions on the servers, and what one launch of the orchestrator holds, for both ways of
generating (loop.py: batch by batch; continuous.py: orchestrator.continuous).

A version goes to every server by broadcast if the trainer offers it before its file is complete,
else from the file (prl.orchestrator.broadcast_coordinator).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from loguru import logger

from prl.config import Config
from prl.orchestrator.broadcast_coordinator import Coordinator
from prl.orchestrator.client import Servers
from prl.orchestrator.dataset import TrainEnv
from prl.orchestrator.evals import OnlineEval
from prl.orchestrator.resume import data_order_at, stand_in_version, wait_for_weights
from prl.run.attempt import Attempt
from prl.run.batch import policy_version
from prl.run.rundir import RunDir
from prl.run.watchdog import Watchdog


@dataclass
class Launch:
    """This launch's run, servers and bookkeeping."""

    cfg: Config
    rd: RunDir
    start: int
    """The first batch this launch writes (the resumed checkpoint's step)."""
    envs: list[TrainEnv]
    sampling: list[dict]
    """Each training environment's sampling args (rollouts.sampling_args)."""
    servers: Servers
    model: str
    """The name requests must give (the served model's)."""
    coordinator: Coordinator
    online: OnlineEval | None
    watchdog: Watchdog
    servers_ready_s: float | None = None
    """When every server first answered, in seconds since the launch (Attempt.since_current_launch)."""

    def startup_metrics(self, step: int) -> dict[str, float]:
        """For the first batch of this launch: when the servers were ready and when the batch was made,
        in seconds since the launch (docs/monitoring.md, `startup/*`)."""
        if step != self.start or self.servers_ready_s is None:
            return {}  # every later batch: the marker is not read again
        now = Attempt.since_current_launch()
        return {} if now is None else {"startup/servers_ready_s": self.servers_ready_s, "startup/first_batch_s": now}

    async def load(self, version: int, in_flight: bool = False) -> tuple[float, float, str]:
        return await load_version(self.rd, self.servers, self.coordinator, version, in_flight)

    def data_order(self, step: int) -> dict:
        """The data order before batch `step`: what batch step - 1 carries (prl.run.batch.Batch.data_order)."""
        return data_order_at(self.cfg, step, [len(e.dataset) for e in self.envs])


async def ensure_policy(
    rd: RunDir, servers: Servers, step: int, async_level: int, first_step: int, version: int,
    coordinator: Coordinator | None = None,
) -> tuple[int, dict]:
    """Load batch `step`'s policy version into every server, unless they hold it already (by
    broadcast where `coordinator` can, else from the file)."""
    required = policy_version(step, async_level)
    if version >= required:  # > only after a stand-in (stand_in_version) for a lost version
        return version, {"weight_wait_s": 0.0, "weight_update_s": 0.0, "weight_staged": 0.0}
    target = stand_in_version(rd, required, first_step)
    if target != required:
        logger.warning(
            f"batch {step}: weights/step_{required} no longer exist (resumed from an older checkpoint?); "
            f"using version {target}: this batch differs from the original run's"
        )
    waited, updated, how = await load_version(rd, servers, coordinator or Coordinator(None), target)
    logger.info(f"batch {step}: servers now at policy version {target} by {how} (waited {waited:.1f}s, update {updated:.1f}s)")
    return target, {"weight_wait_s": waited, "weight_update_s": updated, "weight_staged": float(how == "staged file")}


async def load_version(rd: RunDir, servers: Servers, coordinator: Coordinator, version: int,
                       in_flight: bool = False) -> tuple[float, float, str]:
    """Load `version` into every server, by broadcast if the trainer offers it before its file is
    complete, else from the file. (seconds waited for it, seconds to load it, "broadcast", "file" or
    "staged file": every server had read the file ahead, stage_next)
    `in_flight`: running requests go on under the new weights (orchestrator.continuous)."""
    directory = rd.weights_dir(version)
    start = time.perf_counter()
    if await coordinator.offer(version, directory):
        waited = time.perf_counter() - start
        try:
            await servers.receive_weights(version, directory, in_flight)
            return waited, time.perf_counter() - start - waited, "broadcast"
        except Exception as e:  # some workers may hold part of it: the file replaces all of it
            coordinator.failed(e)
    await wait_for_weights(rd, version)
    waited = time.perf_counter() - start
    sources = await servers.update_weights(directory, in_flight)
    return waited, time.perf_counter() - start - waited, "staged file" if set(sources) == {"staged"} else "file"


async def stage_next(launch: Launch, step: int, version: int) -> None:
    """While the batch before `step` generates: once batch `step`'s version is complete on disk, have
    every server read it into host memory (inference.stage_weights, prl.inference.readahead), so that
    its update copies from there. The caller cancels this when its batch ends; it never fails a batch."""
    cfg = launch.cfg
    target = policy_version(step, cfg.run.async_level)
    if (not cfg.inference.stage_weights or cfg.inference.weight_transfer != "filesystem"
            or target <= version or step >= cfg.run.max_steps):
        return
    try:
        await wait_for_weights(launch.rd, target)
        answers = await launch.servers.stage_weights(launch.rd.weights_dir(target))
    except Exception as e:  # the update reads the file, as without staging
        logger.warning(f"batch {step}: staging policy version {target} failed: {e}")
        return
    if declined := sorted({a for a in answers if a != "staging"}):
        logger.info(f"batch {step}: policy version {target} {'; '.join(declined)} (the update reads its file)")


async def load_for_eval(launch: Launch, version: int) -> None:
    """After the last batch: wait for `version` (the trainer is still training toward it) and load it."""
    watchdog = launch.watchdog
    watchdog.expect(f"policy version {version} for its eval", 2 * watchdog.window())
    await launch.load(version)
    watchdog.expect(f"eval of policy version {version}", watchdog.window())
