"""Processes by PID, never by name: what a process started (from /proc), and signals that check a
process's start time so that a PID reused since it was recorded is never hit.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

Proc = tuple[int, int]
"""(pid, start time in clock ticks since boot)."""


def stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, from /proc/PID/stat; None once it is gone or a
    zombie (ended, only waiting for its parent to collect the exit status)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else (int(fields[1]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def reap_orphans(leader: subprocess.Popen | None = None) -> None:
    """Collect the exit status of every ended child of this process (a subreaper inherits orphans).
    The leader's status goes to its Popen (its returncode), so that its poll() still reports it.

    waitpid(-1) asks the kernel for exactly these; scanning /proc for zombies whose parent is this
    process cost each node's wrapper about 4 % of a core at 5 scans a second."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no child left at all
            return
        if pid == 0:  # children left, none ended
            return
        if leader is not None and pid == leader.pid:
            leader.returncode = os.waitstatus_to_exitcode(status)


def process_start(pid: int) -> int | None:
    """The start time of a live process, to tell it from a later process with the same PID."""
    info = stat(pid)
    return None if info is None else info[1]


def descendants(pid: int) -> list[Proc]:
    """`pid`'s children, grandchildren, ... as (pid, start time). Process groups are not enough:
    torchrun starts each training rank in a session of its own."""
    children: dict[int, list[Proc]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        if (info := stat(int(entry.parent.name))) is not None:
            children.setdefault(info[0], []).append((int(entry.parent.name), info[1]))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def alive(procs: list[Proc]) -> list[Proc]:
    """The recorded processes that still run (same PID and start time)."""
    return [(pid, start) for pid, start in procs if process_start(pid) == start]


def signal_procs(procs: list[Proc], sig: int) -> None:
    for pid, start in alive(procs):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def shm_paths(procs: list[Proc]) -> set[str]:
    """/dev/shm files that these processes hold open or mapped (vLLM's and torch's shared memory):
    exactly the segments a crashed job can leave behind for the next one."""
    found = set()
    for pid, _ in alive(procs):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            fds = [os.readlink(p) for p in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        for path in [line.split(None, 5)[-1] for line in maps.splitlines() if "/dev/shm/" in line] + fds:
            if path.startswith("/dev/shm/"):
                found.add(path.removesuffix(" (deleted)"))
    return {p for p in found if os.path.exists(p)}
