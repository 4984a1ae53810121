"""Logging for the RL components: loguru to stderr and to `$PRL_LOG_DIR/<component>/rank_<R>.log`.

    from prl.log import setup_logging
    setup_logging("trainer", rank=int(os.environ.get("RANK", 0)))
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from loguru import logger

FORMAT = "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | {extra[component]}[{extra[rank]}] | {message}"


def setup_logging(component: str, rank: int = 0, level: str = "INFO") -> Path | None:
    """Send loguru output to stderr and the per-rank file; returns the file (None outside a run)."""
    logger.remove()
    logger.configure(extra={"component": component, "rank": rank})
    logger.add(sys.stderr, level=level, format=FORMAT)
    log_dir = os.environ.get("PRL_LOG_DIR")
    if not log_dir:
        return None
    path = Path(log_dir) / component / f"rank_{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    logger.add(path, level=level, format=FORMAT, enqueue=False)
    return path
