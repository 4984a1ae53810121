"""Each launch of a run: the records of its jobs (submissions.jsonl: what prl submitted; jobs.jsonl:
what started) and its attempt directory, logs/attempt_N, opened after rewinding to the newest complete
checkpoint (prl.run.rewind).

    python -m prl.run.launches new-attempt RUN_DIR     # first thing of each launch (batch script, local mode)
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from prl.run import fence
from prl.run.attempt import Attempt
from prl.run.rewind import rewind
from prl.run.rundir import RunDir, complete_steps, not_private

# --- the jobs' records ---------------------------------------------------------------------------------


def record_submission(rd: RunDir, job_id: str, argv: list[str], kind: str = "submit") -> None:
    entry = {"job_id": job_id, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "kind": kind, "argv": argv}
    with open(rd.submissions, "a") as f:
        f.write(json.dumps(entry) + "\n")


def record_start(rd: RunDir, attempt: int, env: dict[str, str] | None = None, pid: int | None = None,
                 pid_start: int | None = None) -> dict:
    """Append this launch to jobs.jsonl: SLURM job id and restart count (none for local runs),
    attempt, node, the supervisor's pid (with its start time for local runs) and time. A job
    sbatch'ed by hand is known to the run from here on."""
    env = os.environ if env is None else env
    entry = {"job_id": env.get("SLURM_JOB_ID"), "restart": int(env.get("SLURM_RESTART_COUNT") or 0),
             "attempt": attempt, "node": os.uname().nodename, "pid": pid or os.getppid(),
             "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    entry |= {"pid_start": pid_start} if pid_start is not None else {}
    with open(rd.starts, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def start_records(rd: RunDir) -> list[dict]:
    return _jsonl(rd.starts)


def job_ids(rd: RunDir) -> list[str]:
    """SLURM job ids of the run, oldest first: every submission and every job that started in it
    (requeued, or submitted by hand). Local launches have none."""
    ids: list[str] = []
    for e in _jsonl(rd.submissions) + start_records(rd):
        if e.get("job_id") and str(e["job_id"]) not in ids:
            ids.append(str(e["job_id"]))
    return ids


def _jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file; a line cut short by a crash is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return [e for e in out if isinstance(e, dict)]


# --- attempts -------------------------------------------------------------------------------------------


def attempts(rd: RunDir) -> list[int]:
    if not rd.logs.is_dir():
        return []
    return sorted(int(p.name.split("_")[1]) for p in rd.logs.glob("attempt_*") if p.name[8:].isdigit())


def attempt_dir(rd: RunDir, attempt: int | None = None) -> Path | None:
    """logs/attempt_N (the newest when attempt is None)."""
    started = attempts(rd)
    if not started:
        return None
    n = started[-1] if attempt is None else attempt
    return rd.logs / f"attempt_{n}"


def new_attempt(rd: RunDir) -> tuple[int, Path]:
    """Create the next logs/attempt_N (mkdir is atomic, so two launches never share one)."""
    rd.logs.mkdir(parents=True, exist_ok=True)
    n = len(attempts(rd))
    while True:
        d = rd.logs / f"attempt_{n}"
        try:
            d.mkdir()
        except FileExistsError:
            n += 1
            continue
        latest = rd.logs / "latest"
        tmp = rd.logs / f".latest.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(d.name)
        os.replace(tmp, latest)
        return n, d


def start_attempt(rd: RunDir, environ: dict[str, str] | None = None) -> tuple[int, Path]:
    """What every launch does first: open a fresh logs/attempt_N, take the run over (prl.run.fence:
    an earlier attempt still running writes nothing from now on), then continue from the newest
    complete checkpoint, dropping later partial artifacts."""
    n, d = new_attempt(rd)
    fence.take_over(rd, Attempt(d), os.environ if environ is None else environ)
    steps = complete_steps(rd.checkpoints)
    done = rewind(rd, steps[-1] if steps else 0)
    if done:
        (d / "rewind.log").write_text("\n".join(done) + "\n")
    return n, d


# --- prl cancel's mark, and the launch's first command ----------------------------------------------------


def cancel_mark(job_ids: list[str]) -> str:
    """The text of the run's `cancelled` file (prl cancel): which jobs were cancelled, and when."""
    return json.dumps({"jobs": job_ids, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "by": "prl cancel"}) + "\n"


def cancelled_jobs(mark: str) -> list[str] | None:
    """The job ids a `cancelled` file names; None when it cannot be read as such (then every launch
    is refused: unknown is not "none")."""
    try:
        jobs = json.loads(mark).get("jobs")
    except (ValueError, AttributeError):
        jobs = re.findall(r"\d+", m.group(1)) if (m := re.match(r"prl cancel of job ([\d, ]+) at ", mark)) else None
    return [str(j) for j in jobs] if isinstance(jobs, list) and jobs else None


CANCELLED_EXIT = 3
"""`new-attempt`'s status when `prl cancel` marked the run: the launch ends at once, successfully."""


def main(argv: list[str] | None = None) -> int:
    """`new-attempt RUN_DIR`: create logs/attempt_N, take the run over, rewind to the newest complete
    checkpoint, record the launch in jobs.jsonl and print N (called by the batch script before any
    component starts). Refuses (one line, status 2) a run directory that is not its owner's own
    (prl.run.rundir.not_private).
    Exits CANCELLED_EXIT, creating nothing, when `prl cancel` cancelled this job (a requeue of it);
    a new job (sbatch of job.sbatch by hand) clears the mark and continues the run."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "new-attempt":
        print("usage: python -m prl.run.launches new-attempt RUN_DIR", file=sys.stderr)
        return 2
    rd = RunDir(Path(args[1]))
    if problem := not_private(rd):
        print(f"not starting: {problem}", file=sys.stderr)
        return 2
    if rd.cancelled.exists():
        job_id = os.environ.get("SLURM_JOB_ID")
        jobs = cancelled_jobs(rd.cancelled.read_text())
        if jobs is None or job_id is None or job_id in jobs:  # a requeue of a cancelled job, or unknown
            print(f"{rd.path}: cancelled ({rd.cancelled.read_text().strip()}); not starting. "
                  "`prl resume` continues the run.", file=sys.stderr)
            return CANCELLED_EXIT
        # A job of the run's script submitted by hand after `prl cancel`: it continues the run, as
        # `prl resume` would (from the newest complete checkpoint); later requeues of it start too.
        rd.cancelled.unlink(missing_ok=True)
        print(f"{rd.path}: was cancelled (jobs {', '.join(jobs)}); job {job_id} continues the run", file=sys.stderr)
    n, _ = start_attempt(rd)
    record_start(rd, n)
    print(n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
