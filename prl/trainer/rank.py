"""One trainer rank's life, for both loops (train.py: RL; sft.py: SFT): its deadlines, its process
group and seed, the collectives both loops use, and its one teardown.

    with Rank.start(cfg, rank_log, "rendezvous, model load and resume") as rank:
        ...                      # build, resume, steps, the last checkpoint
        return exit_code         # leaving the block is the teardown (Rank.finish)
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from loguru import logger

from prl.config import Config, TrainerConfig
from prl.run.attempt import Attempt
from prl.run.protocol import PREEMPTED, RANK_EXIT_PREEMPTED
from prl.run.watchdog import Watchdog
from prl.trainer.broadcast_sender import Sender
from prl.trainer.metrics import StepReporter
from prl.trainer.stop import StopFlag, ignore as ignore_stop_signals


def rank_number() -> int:
    """This rank's number, before the process group exists (torchrun's RANK)."""
    return int(os.environ.get("RANK", 0))


def init_distributed(cfg: TrainerConfig, timeout_s: float) -> torch.device:
    """NCCL on GPUs, gloo on CPU; torchrun provides RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*.

    `timeout_s` bounds the rendezvous and every collective (the watchdog's stall window usually
    fires first for a collective that hangs)."""
    timeout = timedelta(seconds=timeout_s)
    if cfg.gpus_per_node > 0 and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        # trainer.offload: the shards and gradients are host tensors, whose collectives (the grad
        # norm's all-reduce) NCCL cannot run: gloo takes those.
        backend = "cuda:nccl,cpu:gloo" if cfg.offload else "nccl"
        dist.init_process_group(backend, device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def seed_everything(seed: int, device: torch.device, deterministic: bool | None) -> None:
    """Same seed on every rank: all ranks initialise identically; exact resume needs determinism too
    (trainer.deterministic; None: on CPU only)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic if deterministic is not None else device.type == "cpu":
        # cuBLAS reads this when its first handle is made (the first matmul, after this).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def all_reduce(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def peak_memory(device: torch.device) -> dict[str, float]:
    """The most GPU memory any rank's tensors held (`perf/peak_memory_gib`) and its caching allocator
    reserved (`perf/peak_reserved_gib`) since the last step's report, which resets both; {} on CPU."""
    if device.type != "cuda":
        return {}
    gib = 2**30
    allocated, reserved = all_reduce([torch.cuda.max_memory_allocated(device) / gib,
                                      torch.cuda.max_memory_reserved(device) / gib], device, dist.ReduceOp.MAX)
    torch.cuda.reset_peak_memory_stats(device)
    return {"perf/peak_memory_gib": allocated, "perf/peak_reserved_gib": reserved}


def preempted(step: int, stop: StopFlag, checkpoint: Callable[[int], None]) -> int:
    """Asked to stop (`stop`) before step `step`: checkpoint `step`, where the requeued job resumes;
    the rank's exit status."""
    logger.info(f"stop requested: checkpointing step {step} and exiting {RANK_EXIT_PREEMPTED} ({stop.reason()})")
    checkpoint(step)
    mark_preempted(step)
    return RANK_EXIT_PREEMPTED


def mark_preempted(step: int) -> None:
    """`$PRL_LOG_DIR/preempted`, once the checkpoint is complete: the job script requeues on it.
    torchrun reports any failing rank as exit status 1, so the ranks' 42 does not reach the script."""
    if dist.get_rank() == 0 and (attempt := Attempt.current()) is not None:
        attempt.write(PREEMPTED, f"trainer: checkpoints/step_{step}\n")


class Rank:
    """This rank's number, device and watchdog, and what ends with it: the loops hand it their
    reporter and (RL, rank 0) weight-broadcast sender once made, and leave the rest to Rank.finish."""

    def __init__(self, watchdog: Watchdog, device: torch.device):
        self.watchdog, self.device = watchdog, device
        self.number, self.world_size = dist.get_rank(), dist.get_world_size()
        self.reporter: StepReporter | None = None
        self.sender: Sender | None = None

    @classmethod
    def start(cls, cfg: Config, rank_log: Path | None, preparing: str) -> Rank:
        """The watchdog first (its deadline for `preparing` covers the rendezvous), then the process
        group, then the seed."""
        watchdog = Watchdog.start(cfg.watchdog, "trainer", rank_number(), dump_to=rank_log)
        watchdog.expect(preparing, cfg.watchdog.ready_timeout_s)
        device = init_distributed(cfg.trainer, cfg.watchdog.ready_timeout_s)
        seed_everything(cfg.run.seed, device, cfg.trainer.deterministic)
        return cls(watchdog, device)

    def __enter__(self) -> Rank:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # The one teardown, however the loop left the block: a return (the run's end, a preemption)
        # or an exception.
        self.finish(failed=exc_type is not None)

    def finish(self, failed: bool) -> None:
        """After the last checkpoint this attempt writes: a signal can no longer kill the rank (see
        stop.ignore), the sender stops serving, the deadlines are off, the W&B run ends, the group goes.

        After an error, nothing: the rank exits with its traceback and torchrun ends the others. The
        watchdog stays to guard that exit, the W&B run is not marked finished, and destroying the
        group could wait for ranks that still sit in a collective."""
        if failed:
            return
        ignore_stop_signals()
        if self.sender is not None:
            self.sender.close()
        self.watchdog.stop()
        if self.reporter is not None:
            self.reporter.finish()
        dist.destroy_process_group()
