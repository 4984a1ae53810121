"""Which attempt writes the run: one at a time, the newest launch's.

A requeue after NODE_FAIL can start while the old attempt's processes still run (a partitioned node):
the new launch rewinds the run directory and trains on, while the old trainer would go on renaming
checkpoints, marking them COMPLETE, publishing versions and pruning. So every launch takes the run
over before it rewinds (prl.run.launches.start_attempt): it writes its identity (job id, restart count,
attempt, a random nonce) to `RUN/writer`, and its components carry it as $PRL_WRITER. Each writer of
the run's shared state calls `check` right before it commits (a checkpoint's rename and COMPLETE, a
version's publication, pruning, a batch): an attempt that is no longer the run's writer refuses, says
so in one line and exits non-zero. COMPLETE records the writer that made it.

What is left is the moment between a check and its commit (milliseconds), where only a crash-free
zombie that passed its check just before the takeover can still write once.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

from prl.run.attempt import Attempt
from prl.run.files import write_atomic
from prl.run.rundir import RunDir

ENV = "PRL_WRITER"
"""The identity of the attempt a component belongs to, set by whoever starts the components (the
batch job's supervisor, local mode) from the attempt's record."""
NAME = "writer"
"""RUN/writer: the run's current writer; logs/attempt_N/writer: that attempt's identity."""


def take_over(rd: RunDir, attempt: Attempt, environ: Mapping[str, str] = os.environ) -> str:
    """Make `attempt` the run's writer, from now on the only one whose commits go through; its
    identity is recorded in the attempt first, so that an attempt's identity is always known."""
    identity = (f"job={environ.get('SLURM_JOB_ID') or 'local'} restart={environ.get('SLURM_RESTART_COUNT') or 0} "
                f"attempt={attempt.number} nonce={secrets.token_hex(8)}")
    attempt.write(NAME, identity + "\n")
    write_atomic(rd.path / NAME, identity + "\n")
    return identity


def identity(attempt: Attempt) -> str | None:
    """The identity `take_over` gave `attempt`; None for one made before attempts had one."""
    return (attempt.read(NAME) or "").strip() or None


def current(rd: RunDir) -> str | None:
    """The run's writer now."""
    try:
        return (rd.path / NAME).read_text().strip() or None
    except OSError:
        return None


def check(rd: RunDir, what: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """Right before committing `what`: this process's attempt identity ($PRL_WRITER) if it is still the
    run's writer; SystemExit (one line, status 1) if another attempt took the run over. None outside
    a launch (a test, a tool run by hand): nothing to fence."""
    mine = environ.get(ENV)
    if not mine:
        return None
    if (now := current(rd)) != mine:
        raise SystemExit(f"{rd.path}: not writing {what}: this attempt ({mine}) is no longer the run's "
                         f"writer ({now or 'none recorded'} took it over); exiting")
    return mine
