"""`prl submit NEW.yaml --from RUN[:STEP]`: a new run that starts from another run's checkpoint.

    prl submit configs/toy.yaml run.name=toy-lr-low trainer.lr=1e-3 --from outputs/toy:10

The checkpoint (weights, optimizer and scheduler state, the behaviour policy, the data order it was
made under: everything the trainer resumes from) is linked into the new run directory as its own
`checkpoints/step_STEP` (hard links where the file system allows, else copies; the source is never
written), so the new run starts as a run resumed at STEP would: the trainer loads it, the
orchestrator generates batch STEP onwards, with the new config's settings. Because prl's data order
is a function of the step, the new run also goes on at the source's data position; a fork cannot
restart the data at 0 with trained weights (name the weights as `model.name` for that: a fresh run).
`RUN/fork.json` records where it came from; `prl status` shows it. Without STEP: the newest complete
checkpoint. Bad input exits 2 naming `--from`, before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from prl.config import Config, ConfigError
from prl.run.rundir import RunDir, complete_steps

FORK_FILE = "fork.json"


@dataclass(frozen=True)
class Fork:
    source: RunDir
    step: int

    @property
    def checkpoint(self) -> Path:
        return self.source.checkpoint_dir(self.step)


def parse_from(text: str) -> tuple[Path, int | None]:
    """RUN or RUN:STEP (a path may hold ':' itself: only a numeric tail is a step)."""
    head, sep, tail = text.rpartition(":")
    if sep and tail.isdigit():
        return Path(head).expanduser().resolve(), int(tail)
    return Path(text).expanduser().resolve(), None


def plan(text: str, cfg: Config, target: RunDir) -> Fork:
    """The checkpoint `--from TEXT` names, checked: a run directory with that complete checkpoint,
    a step below the new run's max_steps, not the new run itself. Writes nothing."""
    path, step = parse_from(text)
    source = RunDir(path)
    if not source.config.is_file():
        raise ConfigError(f"--from: {path} is not a run directory (no config.yaml)")
    if path == target.path.resolve():
        raise ConfigError(f"--from: {path} is the new run's own directory; fork into a new run.name")
    steps = complete_steps(source.checkpoints)
    if not steps:
        raise ConfigError(f"--from: {path} has no complete checkpoint")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ConfigError(f"--from: {path} has no complete checkpoint {step} (it has: {', '.join(map(str, steps))})")
    if step >= cfg.run.max_steps:
        raise ConfigError(f"--from: step {step} is not below run.max_steps={cfg.run.max_steps}: nothing left to train")
    if cfg.sft is not None:
        raise ConfigError("--from: an SFT job starts from weights: name them as model.name")
    return Fork(source, step)


def apply(fork: Fork, target: RunDir) -> Path:
    """The checkpoint linked in as the new run's own, complete (its COMPLETE comes with it, and the
    directory appears under its name only once whole), and fork.json written."""
    if complete_steps(target.checkpoints):
        raise ConfigError(f"--from: {target.path} already has checkpoints; fork into a new run.name")
    dest = target.checkpoint_dir(fork.step)
    partial = dest.with_name(f".{dest.name}.fork{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(fork.checkpoint, partial, copy_function=link_or_copy)
    partial.rename(dest)
    record = {"from": str(fork.source.path), "step": fork.step, "checkpoint": str(fork.checkpoint),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (target.path / FORK_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return dest


def link_or_copy(src: str, dst: str) -> None:
    """A hard link (no bytes copied; checkpoints are never rewritten in place), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def origin(rd: RunDir) -> dict | None:
    """fork.json: the run and step this one started from; None for a run of its own."""
    path = rd.path / FORK_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
