"""The orchestrator's side of the run directory: where to resume, which weights to load, what to record.

State: everything the orchestrator knows at batch n (samples seen, data position) is a function of
n and the config, because the data order is (prl.orchestrator.dataset). So resuming needs only the
trainer's checkpoint step. Each batch carries the data order after it, with a fingerprint of what
decides it (`data_order_at`, as prl.run.batch.Batch.data_order), and the trainer keeps it in its
checkpoint; on resume (`check_resume`, reading, never writing, the trainer's checkpoint) a
differing fingerprint is reported: the batches after the checkpoint will not be the ones the original
run would have seen.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from loguru import logger

from prl.config import Config
from prl.run import fence
from prl.run.batch import read_data_order
from prl.run.files import write_atomic
from prl.run.rundir import RunDir, complete_steps, is_complete


def resume_step(rd: RunDir) -> int:
    """The newest complete trainer checkpoint (the batch to generate first), else 0."""
    steps = complete_steps(rd.checkpoints)
    return steps[-1] if steps else 0


def fingerprint(cfg: Config, num_examples: list[int]) -> dict:
    """What decides which prompts batch n holds (`num_examples`: each training environment's dataset size)."""
    orch = cfg.orchestrator
    envs = zip(orch.train_environments, orch.examples_per_env)
    return {
        "seed": cfg.run.seed,
        "batch_size": orch.batch_size,
        "rollouts_per_example": orch.rollouts_per_example,
        "environments": [{"id": e.id, "args": dict(e.args), "examples_per_step": k} for e, k in envs],
        "num_examples": list(num_examples),
        # Only when set: runs without refill keep the fingerprints their checkpoints hold.
        **({"refill_max_prompts": orch.refill_max_prompts} if orch.refill_max_prompts else {}),
    }


def data_order_at(cfg: Config, step: int, num_examples: list[int], seats: list[int] | None = None) -> dict:
    """The orchestrator's state just before generating batch `step` (Batch.data_order of batch
    step - 1); data position and epoch per training environment. `seats`: each one's rollouts per
    episode (prl.orchestrator.dataset.seats_of; default 1 each): samples_seen counts every seat's trace."""
    orch = cfg.orchestrator
    positions = [step * k for k in orch.examples_per_env]
    seats = seats or [1] * len(positions)
    per_step = orch.rollouts_per_example * sum(k * s for k, s in zip(orch.examples_per_env, seats))
    return {
        "step": step,
        "samples_seen": step * per_step,
        "data_position": positions,
        "epoch": [position // n for position, n in zip(positions, num_examples)],
        "fingerprint": fingerprint(cfg, num_examples),
    }


def check_resume(rd: RunDir, step: int, expected: dict) -> None:
    """Warn when checkpoint `step` was made under a different data order (read only: the checkpoint
    is the trainer's)."""
    saved = read_data_order(rd, step)
    if saved is not None and saved.get("fingerprint") != expected["fingerprint"]:
        logger.warning(f"{rd.checkpoint_dir(step)}: data order changed since this checkpoint "
                       f"(was {saved.get('fingerprint')}, now {expected['fingerprint']})")


def stand_in_version(rd: RunDir, version: int, first_step: int) -> int:
    """`version`, unless the run can never produce it again: then the closest newer one.

    This launch's trainer writes every version >= first_step (on resume it re-writes version
    first_step). An older one exists only if an earlier attempt left it behind; the trainer keeps
    those of its newest checkpoint, but after a resume from an older one (`prl resume --step`)
    they may be gone, and waiting for them would wait forever.
    """
    if version >= first_step or is_complete(rd.weights_dir(version)):
        return version
    newer = [v for v in complete_steps(rd.weights) if version < v < first_step]
    return newer[0] if newer else first_step


async def wait_for_weights(rd: RunDir, version: int, poll_s: float = 0.1) -> None:
    """Block until weights/step_{version}/COMPLETE exists, looking every poll_s (a stat, cheap on a
    shared file system): a version's load, and so the trainer's wait for its batch, starts up to
    poll_s after the trainer has written it."""
    marker = rd.weights_dir(version)
    last_note = time.monotonic()
    while not is_complete(marker):
        if time.monotonic() - last_note > 60:
            logger.info(f"waiting for {marker}")
            last_note = time.monotonic()
        await asyncio.sleep(poll_s)


def write_completions(rd: RunDir, step: int, records: list[dict]) -> Path:
    """rollouts/step_N.completions.jsonl (prl.orchestrator.rollouts.completion_records), whole or absent."""
    text = "".join(json.dumps(record, ensure_ascii=False, default=str) + "\n" for record in records)
    # A lone surrogate (possible in decoded JSON) becomes its JSON escape \udXXX: the file stays UTF-8.
    data = text.encode("utf-8", errors="backslashreplace")
    fence.check(rd, f"completions of batch {step}")  # as its batch (prl.run.batch.write_batch)
    return write_atomic(rd.completions_path(step), data, hidden=False)

