"""A full disk (or quota) ends the run with one clear line, not a traceback deep in a writer.

    with reporting_disk_full("trainer", rd):   # around a component's main
        ...

A write that fails for want of space or quota (prl.run.files.write_failure: ENOSPC, EDQUOT, torch.save
coming up short; also inside torch.distributed.checkpoint's CheckpointException) makes rank 0 remove
the run's unfinished files (the checkpoint or version being written: without COMPLETE nobody reads
them, and a resume redoes them), which also makes room to say so; every rank logs the line and the
first records it in the attempt (protocol.WRITE_FAILED), where the supervisor and `prl status` read
it. The error still propagates: the component fails as it would.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from loguru import logger

from prl.run import rewind
from prl.run.attempt import Attempt
from prl.run.files import room_left, write_failure
from prl.run.protocol import WRITE_FAILED
from prl.run.rundir import RunDir


@contextmanager
def reporting_disk_full(component: str, rd: RunDir) -> Iterator[None]:
    try:
        yield
    except BaseException as e:
        if (what := write_failure(e)) is not None:
            report(component, rd, what)
        raise


def report(component: str, rd: RunDir, what: str) -> None:
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        for path in rewind.unfinished(rd):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    line = f"{component} rank {rank}: {what}; {room_left(rd.path)}"
    logger.error(f"cannot write: {line}; the run can continue from its newest complete checkpoint once there is room")
    if (attempt := Attempt.current()) is not None and not attempt.has(WRITE_FAILED):
        try:
            attempt.write(WRITE_FAILED, line + "\n")
        except OSError as e:
            logger.error(f"could not record it in {attempt.marker(WRITE_FAILED)} either: {e.strerror}")
