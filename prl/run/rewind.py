"""What a run continuing from a checkpoint drops: later batches, weights and evals, and writes cut
short (step directories without COMPLETE, temporaries); complete checkpoints after it are archived.
Every launch rewinds to its newest complete checkpoint (prl.run.launches.start_attempt); `prl resume
--step N` to N.
"""

from __future__ import annotations

import time
from pathlib import Path

from prl.run.files import is_temporary
from prl.run.rundir import RunDir, is_complete, remove_step, step_of


def rewind_plan(rd: RunDir, step: int) -> tuple[list[Path], list[Path]]:
    """What must go for the run to continue from checkpoint `step`: (to delete, to archive).

    Deleted: rollouts from `step` on (they would be trained on again), weights after `step` and
    their evals, and every step directory without its COMPLETE marker (an interrupted write). Archived:
    complete checkpoints after `step` (expensive to make, so they are kept aside).
    """
    delete = [p for p in _step_entries(rd.rollouts) if step_of(p, suffixed=True) >= step]
    delete += unfinished(rd)
    delete += [p for p in _step_entries(rd.weights) if step_of(p, suffixed=True) > step and is_complete(p)]
    delete += [p for p in _step_entries(rd.evals) if step_of(p, suffixed=True) > step]  # of weights that go
    archive = [p for p in _step_entries(rd.checkpoints) if is_complete(p) and step_of(p, suffixed=True) > step]
    return sorted(set(delete)), sorted(archive)


def unfinished(rd: RunDir) -> list[Path]:
    """Writes cut short: weights and checkpoint step directories without COMPLETE, and temporaries."""
    partial = [p for parent in (rd.weights, rd.checkpoints) for p in _step_entries(parent) if not is_complete(p)]
    return partial + temporaries(rd)


def temporaries(rd: RunDir) -> list[Path]:
    """What a write cut short left behind where the run's components write: weights/.step_N.tmp
    (prl.trainer.export) and the temporaries of prl.run.files.write_atomic in rollouts/ and
    weights/. Checkpoints' .trainer.tmp is inside a step directory without COMPLETE, which goes whole."""
    found = []
    for parent in (rd.weights, rd.rollouts):
        if parent.is_dir():
            found += [p for p in parent.iterdir() if is_temporary(p.name)]
    return found


def rewind(rd: RunDir, step: int) -> list[str]:
    """Carry out `rewind_plan(step)`; returns what was done, one line per path."""
    delete, archive = rewind_plan(rd, step)
    done = []
    for p in delete:
        remove_step(p) if p.is_dir() else p.unlink()
        done.append(f"removed {p}")
    if archive:
        dest = rd.path / "archive" / f"rewind-to-{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        dest.mkdir(parents=True)
        for p in archive:
            p.rename(dest / p.name)
            done.append(f"archived {p} -> {dest / p.name}")
    return done


def _step_entries(parent: Path) -> list[Path]:
    """`step_N` directories and `step_N.*` files directly under `parent`."""
    if not parent.is_dir():
        return []
    return [p for p in parent.iterdir() if step_of(p, suffixed=True) is not None]
