"""How far a run is, from its run directory alone: steps done of run.max_steps, the median seconds
per step, an ETA, how long ago the last step ended, the newest reward, the trainer's idle share and
GPU memory peak.

    Progress.of(RunDir(path)).line()   # "step 12/20 | reward 0.412 | 4.1 s/step | trainer idle 9% | ETA 33s | last step 5s ago"

Read by `prl status`, `prl runs` and the local run's live line (prl.control.local). Sources: the per-step
records trainer rank 0 appends to logs/attempt_N/trainer/metrics.jsonl (prl.trainer.metrics).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from prl.run import launches
from prl.run.rundir import RunDir, step_of

RECENT = 20
"""Steps the median step time is taken over: recent enough to follow a slowdown, many enough that
one slow step (a checkpoint, a weight reload) does not move it."""


def metrics_by_attempt(rd: RunDir) -> dict[int, list[dict]]:
    """Each attempt's per-step records, in the order they were written."""
    out = {}
    for n in launches.attempts(rd):
        path = rd.attempt(n).metrics
        out[n] = [rec for line in _lines(path) if (rec := _record(line)) is not None]
    return out


def read_metrics(rd: RunDir) -> list[dict]:
    """One record per step over every attempt, ascending; a step trained again after a resume: the
    newest attempt's record wins."""
    by_step = {int(rec["step"]): rec for recs in metrics_by_attempt(rd).values() for rec in recs}
    return [by_step[k] for k in sorted(by_step)]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def _record(line: str) -> dict | None:
    try:
        rec = json.loads(line)
        int(rec["step"])
        return rec
    except (ValueError, KeyError, TypeError):
        return None  # a line cut short by a kill


def _number(value) -> bool:
    """A finite number as metrics.jsonl holds them (not a bool, not NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def max_steps(rd: RunDir) -> int | None:
    """run.max_steps from the resolved config (yaml alone: no config classes needed to read one int)."""
    import yaml

    try:
        return int(yaml.safe_load(rd.config.read_text())["run"]["max_steps"])
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None


def _last_step_time(rd: RunDir, records: list[dict]) -> float | None:
    """When the newest step ended: its record's time, else (records written before the trainer stamped
    them) the newest metrics file's mtime."""
    if not records:
        return None
    if isinstance(records[-1].get("time"), (int, float)):
        return float(records[-1]["time"])
    files = [f for f in (rd.attempt(n).metrics for n in launches.attempts(rd)) if f.is_file()]
    return max((f.stat().st_mtime for f in files), default=None)


@dataclass(frozen=True)
class Progress:
    steps_done: int
    """Steps completed (the newest recorded step + 1)."""
    max_steps: int | None
    """run.max_steps."""
    median_step_s: float | None
    """Median seconds per step over the last RECENT steps."""
    last_step_age_s: float | None
    """Seconds since the newest step ended (at the time of reading)."""
    reward: float | None
    """The newest step's rollout/reward_mean."""
    trainer_idle: float | None = None
    """Median share of a step the trainer spent waiting for its batch (perf/wait_s / perf/step_s) over
    the last RECENT steps: well above 0 means inference is the bound (give it more GPUs)."""
    peak_memory_gib: float | None = None
    """The most GPU memory a trainer rank held in the last RECENT steps (perf/peak_memory_gib; GPU only)."""
    loss: float | None = None
    """The newest step's train/loss: what the line shows of an SFT job, which has no reward."""

    @classmethod
    def of(cls, rd: RunDir, now: float | None = None) -> Progress:
        records = read_metrics(rd)
        recent = records[-RECENT:]
        times = [float(r["perf/step_s"]) for r in recent if _number(r.get("perf/step_s"))]
        idle = [r["perf/wait_s"] / r["perf/step_s"] for r in recent
                if _number(r.get("perf/wait_s")) and _number(r.get("perf/step_s")) and r["perf/step_s"] > 0]
        peaks = [float(r["perf/peak_memory_gib"]) for r in recent if _number(r.get("perf/peak_memory_gib"))]
        last = _last_step_time(rd, records)
        return cls(steps_done=int(records[-1]["step"]) + 1 if records else 0, max_steps=max_steps(rd),
                   median_step_s=statistics.median(times) if times else None,
                   last_step_age_s=None if last is None else max(0.0, (now or time.time()) - last),
                   reward=records[-1].get("rollout/reward_mean") if records else None,
                   trainer_idle=statistics.median(idle) if idle else None, peak_memory_gib=max(peaks, default=None),
                   loss=records[-1].get("train/loss") if records else None)

    @classmethod
    def from_dict(cls, d: dict) -> Progress:
        # (a record written before a field existed lacks it: its default)
        return cls(**{f: d[f] for f in cls.__dataclass_fields__ if f in d})

    @property
    def eta_s(self) -> float | None:
        if self.max_steps is None or self.median_step_s is None:
            return None
        return max(0, self.max_steps - self.steps_done) * self.median_step_s

    @property
    def stalled(self) -> bool:
        """No step for five times the usual step time (and at least a minute): worth a look."""
        age, usual = self.last_step_age_s, self.median_step_s
        return age is not None and usual is not None and age > max(5 * usual, 60)

    def fields(self, live: bool = True) -> list[str]:
        """The line's parts; `live`: the run is running, so the ETA and a stall mean something."""
        out = [f"step {self.steps_done}/{self.max_steps if self.max_steps is not None else '?'}"]
        if self.reward is not None:
            out.append(f"reward {self.reward:.3f}")
        elif _number(self.loss):
            out.append(f"loss {self.loss:.3f}")
        if self.median_step_s is not None:
            out.append(f"{self.median_step_s:.1f} s/step")
        if self.trainer_idle is not None:
            out.append(f"trainer idle {self.trainer_idle:.0%}")
        if self.peak_memory_gib is not None:
            out.append(f"trainer GPU peak {self.peak_memory_gib:.1f} GiB")
        if live and self.eta_s is not None and self.steps_done < (self.max_steps or 0):
            out.append(f"ETA {duration(self.eta_s)}")
        if self.last_step_age_s is not None:
            out.append(f"last step {duration(self.last_step_age_s)} ago" + (" (stalled?)" if live and self.stalled else ""))
        return out

    def line(self, live: bool = True) -> str:
        return " | ".join(self.fields(live))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"eta_s": self.eta_s, "stalled": self.stalled}


def duration(seconds: float) -> str:
    """4s, 3m05s, 2h07m: short enough for one status line."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class LiveLine:
    """The local run's progress while it runs: on a terminal one line redrawn in place (like a
    progress bar); elsewhere (a log file, CI) one line per new step, so nothing is overwritten."""

    def __init__(self, rd: RunDir, stream=None, every_s: float = 1.0):
        self.rd, self.stream, self.every_s = rd, stream or sys.stdout, every_s
        self.tty = self.stream.isatty()
        self._shown, self._next, self._done = False, 0.0, -1

    def update(self, now: float | None = None) -> None:
        now = now or time.time()
        if now < self._next:
            return
        self._next = now + self.every_s
        p = Progress.of(self.rd, now)
        if self.tty:
            waiting = "" if p.steps_done else " | waiting for the first step"
            self.stream.write(f"\r\x1b[K{p.line()}{waiting}")
            self._shown = True
        elif p.steps_done != self._done:
            self.stream.write(p.line() + "\n")
        self._done = p.steps_done
        self.stream.flush()

    def clear(self) -> None:
        """Before any other output: the in-place line would otherwise run into it."""
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False


def eval_records(rd: RunDir) -> list[dict]:
    """evals/step_N.json, by step, each with its `step`; a file being written or not ours is skipped."""
    out = []
    for path in rd.evals.glob("step_*.json"):
        step = step_of(path.stem)
        try:
            rec = json.loads(path.read_text())
        except (ValueError, OSError):
            continue
        if step is not None and isinstance(rec, dict):
            out.append(rec | {"step": step})
    return sorted(out, key=lambda r: r["step"])
