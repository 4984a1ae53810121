"""`prl logs`: every component's and rank's log of a run, prefixed with where each line came from.

    prl logs RUN                      # last 20 lines of every file of the newest attempt
    prl logs RUN --attempt all        # ... of every attempt
    prl logs RUN -c trainer -r 1 -f   # follow trainer rank 1, including files (and attempts) that appear later

Files: logs/slurm-<job>.out (the batch script until its attempt's log is open), logs/attempt_N/job.log
(the batch script, slurm.setup included), <component>/rank_R.log (each process, loguru) and
<component>/<host>.out (srun's capture of a node's stdout/stderr, its setup lines included).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from prl.run import launches
from prl.run.protocol import NAMES as COMPONENTS
from prl.run.rundir import RunDir


def log_files(rd: RunDir, component: str | None, rank: int | None, attempt: int | str | None) -> list[Path]:
    """The matching files, ordered by attempt, component, name. `attempt`: a number, "all", or None
    for the newest."""
    attempts = launches.attempts(rd) if attempt == "all" else [attempt] if attempt is not None else launches.attempts(rd)[-1:]
    files: list[Path] = []
    if rank is None and attempt is None and component in (None, "job"):
        # The batch script's output before an attempt's job.log is open (a failed bookkeeping step).
        files += sorted(rd.logs.glob("slurm-*.out"))
    for n in attempts:
        att = rd.attempt(n)
        if rank is None and component in (None, "job") and att.job_log.exists():
            files.append(att.job_log)
        pattern = "*" if rank is None else att.rank_log("x", rank).name
        for comp in [c for c in COMPONENTS if component in (None, c)]:
            files += sorted(p for p in att.component_dir(comp).glob(pattern) if p.suffix in (".log", ".out"))
    return files


def prefix(rd: RunDir, path: Path) -> str:
    """`attempt_0/trainer/rank_1` style label."""
    return str(path.relative_to(rd.logs).with_suffix(""))


def _tail(path: Path, lines: int) -> tuple[list[str], int]:
    data = path.read_bytes()
    text = data.decode(errors="replace").splitlines()
    return (text[-lines:] if lines else text), len(data)


def show_logs(rd: RunDir, *, component: str | None = None, rank: int | None = None,
              attempt: int | str | None = None, lines: int = 20, follow: bool = False, poll_s: float = 0.5,
              out=sys.stdout) -> int:
    offsets: dict[Path, int] = {}
    for path in log_files(rd, component, rank, attempt):
        tail, offsets[path] = _tail(path, lines)
        for line in tail:
            out.write(f"[{prefix(rd, path)}] {line}\n")
    out.flush()
    if not follow:
        if not offsets:
            print(f"no log files match in {rd.logs}", file=sys.stderr)
        return 0
    try:
        while True:
            # Files already shown stay followed (an attempt's last lines after the next one began).
            files = list(dict.fromkeys([*offsets, *log_files(rd, component, rank, attempt)]))
            _print_new(rd, files, offsets, out)
            time.sleep(poll_s)
    except KeyboardInterrupt:
        return 0


def _print_new(rd: RunDir, files: list[Path], offsets: dict[Path, int], out) -> None:
    """Print what was appended to each file since its offset (whole lines only)."""
    for path in files:
        start = offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                chunk = f.read()
        except OSError:
            continue
        end = chunk.rfind(b"\n") + 1
        if not end:
            continue
        offsets[path] = start + end
        for line in chunk[:end].decode(errors="replace").splitlines():
            out.write(f"[{prefix(rd, path)}] {line}\n")
    out.flush()
