"""Files that readers see whole or not at all: the one atomic-write helper of prl."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: Path, data: str | bytes | Callable[[Path], object], *, hidden: bool = True) -> Path:
    """Write under a temporary name in the same directory, then rename: readers see all or nothing.
    `data`: the content, or a function that writes the temporary file (torch.save). The temporary is
    `.NAME.tmpPID`; with hidden=False `NAME.tmpPID`, for rollouts/step_N.* files: a rewind of the run
    directory removes step_N.* leftovers of a crash (prl.run.rundir.RunDir.rewind_plan)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{'.' if hidden else ''}{path.name}.tmp{os.getpid()}")
    if callable(data):
        data(tmp)
    elif isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)
    return path
