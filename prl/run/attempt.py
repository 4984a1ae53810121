"""One launch of a run: the directory `logs/attempt_N`, and the only place that spells a path in it.

    from prl.run.attempt import Attempt
    att = Attempt.current()                 # the launch this process belongs to ($PRL_LOG_DIR), or None
    att.marker(protocol.PREEMPTED)          # logs/attempt_N/preempted
    att.rank_log("trainer", 0)              # logs/attempt_N/trainer/rank_0.log

Every launch (first start, requeue, a job sbatch'ed by hand, a local run) gets a fresh one (prl.run.launches
creates it). What is in it: `job.log` (the batch script's and the supervisor's output), the marker files
of prl.run.protocol (their presence is the message), one directory per component with its per-rank logs
and its nodes' srun output, the trainer's `metrics.jsonl`, and the probes' reports.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from prl.run.files import write_atomic
from prl.run.protocol import LAUNCHED

LOG_DIR_ENV = "PRL_LOG_DIR"
"""The attempt directory, exported to every component by the batch script or local mode."""


@dataclass(frozen=True)
class Attempt:
    dir: Path

    @classmethod
    def current(cls) -> Attempt | None:
        """The attempt of this process ($PRL_LOG_DIR), None outside a launch (a test, a tool)."""
        log_dir = os.environ.get(LOG_DIR_ENV)
        return cls(Path(log_dir)) if log_dir else None

    @classmethod
    def since_current_launch(cls) -> float | None:
        """Seconds since this process's attempt was launched; None outside a launch or before its marker."""
        attempt = cls.current()
        return attempt.since_launch() if attempt is not None else None

    @property
    def run_dir(self) -> Path:
        """The run directory this attempt belongs to (RUN/logs/attempt_N)."""
        return self.dir.parent.parent

    @property
    def number(self) -> int:
        return int(self.dir.name.removeprefix("attempt_"))

    @property
    def job_log(self) -> Path:
        """The batch script's and the supervisor's output (local mode: the supervisor's)."""
        return self.dir / "job.log"

    def marker(self, name: str) -> Path:
        """A marker file of prl.run.protocol (PREEMPTED, STALLED, FAILED, ENDED, ...)."""
        return self.dir / name

    def has(self, name: str) -> bool:
        return self.marker(name).exists()

    def read(self, name: str) -> str | None:
        """A marker's text, None when it is not there (or not readable)."""
        try:
            return self.marker(name).read_text()
        except OSError:
            return None

    def write(self, name: str, text: str) -> None:
        """A marker written whole (tmp + rename): a reader sees all of it or none."""
        write_atomic(self.marker(name), text)

    def since_launch(self) -> float | None:
        """Seconds since the supervisor started this attempt's components (the LAUNCHED marker);
        None when it has not written one (a component started by hand)."""
        try:
            return time.time() - float(self.read(LAUNCHED) or "")
        except ValueError:
            return None

    def component_dir(self, component: str) -> Path:
        """Per-rank logs and the nodes' srun output of one component."""
        return self.dir / component

    def rank_log(self, component: str, rank: int | str) -> Path:
        return self.component_dir(component) / f"rank_{rank}.log"

    def node_output(self, component: str, node: str = "%N") -> Path:
        """srun's --output of a component's task on one node (%N: srun puts in the node's name);
        local mode: `local.out`."""
        return self.component_dir(component) / f"{node}.out"

    @property
    def metrics(self) -> Path:
        """Trainer rank 0's per-step records (prl.trainer.metrics)."""
        return self.component_dir("trainer") / "metrics.jsonl"

    @property
    def probe_dir(self) -> Path:
        """The probe stand-ins' reports (run.mode=probe, jobs/probe.py)."""
        return self.dir / "probe"
