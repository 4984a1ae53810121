"""The `watchdog` section: deadlines for startup and progress (prl/run/watchdog.py applies them)."""

from __future__ import annotations

from dataclasses import dataclass

from prl.config.common import _check, _positive


@dataclass(kw_only=True)
class WatchdogConfig:
    stall_minutes: float = 30.0
    """A component that makes no progress (trainer: no step; orchestrator: no batch) for
    max(stall_minutes, stall_factor x its median step time) dumps every thread's stack to its
    rank log and ends the attempt with exit status 16 (`stalled` names it). 0 disables."""
    stall_factor: float = 5.0
    """See stall_minutes: multiples of the median step time, so slow steps are not taken for hangs."""
    ready_timeout_s: float = 1800.0
    """Deadline for startup: vLLM answering /health; the trainer's rendezvous, model load and resume
    (also the torch process group's timeout). The trainer's first batch may take this plus the stall
    window (the servers start, then one batch is generated)."""
    requeue: bool = False
    """Requeue the job after a stall (from the newest complete checkpoint) instead of ending it."""
    max_requeues: int = 1
    """Stall requeues allowed per run (counted apart from slurm.max_requeues)."""

    def __post_init__(self) -> None:
        _check(self.stall_minutes >= 0, "watchdog.stall_minutes", "must be >= 0")
        _check(self.stall_factor >= 1, "watchdog.stall_factor", "must be >= 1")
        _positive(self.ready_timeout_s, "watchdog.ready_timeout_s")
        _check(self.max_requeues >= 0, "watchdog.max_requeues", "must be >= 0")

