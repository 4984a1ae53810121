"""Files that readers see whole or not at all, and that stay whole through a crash of the node: the
one atomic-write helper of prl and the fsync of what a COMPLETE marker covers."""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: Path, data: str | bytes | Callable[[Path], object], *, hidden: bool = True,
                 sync: bool = True) -> Path:
    """Write under a temporary name in the same directory, then rename: readers see all or nothing.
    `data`: the content, or a function that writes the temporary file (torch.save). The temporary is
    `.NAME.tmpPID`; with hidden=False `NAME.tmpPID`, for rollouts/step_N.* files: a rewind of the run
    directory removes step_N.* leftovers of a crash (prl.run.rewind.rewind_plan).
    sync=False: no fsync, so a crash of the node may lose it (what prl.run.rundir.mark_complete's
    durable=False is for)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{'.' if hidden else ''}{path.name}.tmp{os.getpid()}")
    if callable(data):
        data(tmp)
    elif isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    if sync:
        fsync(tmp)
    os.replace(tmp, path)
    if sync:
        fsync(path.parent)  # the rename itself
    return path


_TEMPORARY = re.compile(r"^\..+\.tmp\d*$|^.+\.tmp\d+$")
"""Names of temporaries: write_atomic's `.NAME.tmpPID` / `NAME.tmpPID`, the trainer's `.step_N.tmp`."""


def is_temporary(name: str) -> bool:
    return bool(_TEMPORARY.match(name))


def fsync(path: Path) -> None:
    """Flush one file's or directory's data and metadata to the disk (or the file server)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory from the deepest up, then `root` itself and
    its parent (which holds its name): after this a crash keeps all of it as it is now."""
    dirs = []
    for top, _, files in os.walk(root):
        dirs.append(Path(top))
        for name in files:
            if not os.path.islink(os.path.join(top, name)):
                fsync(Path(top, name))
    for d in reversed(dirs):
        fsync(d)
    fsync(root.parent)


DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def write_failure(exc: BaseException) -> str | None:
    """What a failed write for want of room says, if `exc` is one (None otherwise), looked for in the
    error, its causes, and the per-rank failures torch.distributed.checkpoint wraps (CheckpointException):
    an OSError ENOSPC or EDQUOT (with the file when known), or torch.save's zip writer coming up short
    ("unexpected pos"), which is how it reports a write the disk refused, without the errno."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return f"{e.strerror}{f' writing {e.filename}' if e.filename else ''}"
        if isinstance(e, RuntimeError) and "unexpected pos" in str(e):
            return f"a write came up short ({str(e).split('] ')[-1].strip(' .')})"
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # CheckpointException: rank -> (exc, stack)
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


def room_left(where: Path) -> str:
    """How much room is left on `where`'s filesystem, in words."""
    try:
        usage = shutil.disk_usage(where)
    except OSError as e:
        return f"free space of {where} unknown ({e.strerror})"
    return f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.0f} MiB on the filesystem of {where}"
