"""Logging for the RL components: loguru to stderr and to `$PRL_LOG_DIR/<component>/rank_<R>.log`.

    from prl.run.log import setup_logging
    setup_logging("trainer", rank=int(os.environ.get("RANK", 0)))
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from loguru import logger

from prl.run.attempt import Attempt

FORMAT = "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | {extra[component]}[{extra[rank]}] | {message}"


def setup_logging(component: str, rank: int = 0, level: str = "INFO") -> Path | None:
    """Send loguru output to the per-rank file and stderr; returns the file (None outside a run).

    Inside a run, stderr (captured per node by srun, or local.out) gets warnings and errors only, so
    `prl logs` does not show every line twice; the rank file has everything.
    """
    logger.remove()
    logger.configure(extra={"component": component, "rank": rank})
    attempt = Attempt.current()
    logger.add(sys.stderr, level=level if attempt is None else "WARNING", format=FORMAT)
    if attempt is None:
        return None
    path = attempt.rank_log(component, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    logger.add(path, level=level, format=FORMAT, enqueue=False)
    logger.info(f"{component} rank {rank}: pid {os.getpid()} on {socket.gethostname()}")
    return path
