"""The subprocess boundary to SLURM: sbatch, squeue, sacct, scancel. Nothing else shells out to SLURM.

Tests replace these commands by putting scripts named sbatch/squeue/... first on PATH, or run them
against the real test cluster (tools/slurm_cluster.sh).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, replace


class SlurmError(RuntimeError):
    """A SLURM command failed; the message carries its stderr."""


class SlurmUnknown(SlurmError):
    """A query failed or timed out, so which jobs are queued or running is unknown (not "none")."""


NOT_HERE = ("not found: is this a SLURM login node?", "Could not establish a configuration source")
"""What SLURM's commands say on a machine that has no cluster: not installed, or installed (a client
package) with no slurm.conf and no slurmctld to fetch one from."""


def not_here(error: SlurmError) -> bool:
    """True when `error` says this machine has no SLURM at all (not: SLURM failed to answer)."""
    return any(text in str(error) for text in NOT_HERE)


QUERY_TIMEOUT_S = float(os.environ.get("PRL_SLURM_TIMEOUT_S", "20"))
"""How long one squeue/sacct may take before the answer counts as unknown (a hung slurmctld)."""


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str
    """PENDING, RUNNING, COMPLETED, FAILED, REQUEUED, ... (het components folded into the leader)."""
    elapsed: str = ""
    nodes: str = ""
    exit_code: str = ""
    reason: str = ""
    """Why a job is pending (squeue's %r), e.g. Priority, Resources."""
    start: str = ""
    """Expected (pending) or actual start time."""
    het_nodes: tuple[tuple[int, str], ...] = ()
    """A het job's nodes per component: (het group, node list), ascending; empty for other jobs."""


def held(reason: str | None) -> bool:
    """Whether a pending job's reason says SLURM holds it (JobHeldUser, JobHeldAdmin, "launch failed
    requeued held"): it waits for `scontrol release`, not for resources, and would wait forever."""
    return "held" in (reason or "").lower()


ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUE_HOLD", "REQUEUE_FED"}


def _run(argv: list[str], retries: int = 0, timeout: float = 30) -> str:
    """Run a SLURM command; retry transient failures (slurmctld busy or restarting)."""
    for attempt in range(retries + 1):
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            raise SlurmError(f"{argv[0]} not found: is this a SLURM login node?") from None
        except subprocess.TimeoutExpired:
            result = None
        if result is not None and result.returncode == 0:
            return result.stdout
        if attempt < retries:
            time.sleep(1 + attempt)
    err = result.stderr.strip() if result is not None else f"timed out after {timeout}s"
    raise SlurmError(f"{' '.join(argv[:2])} failed: {err}")


def sbatch(script: str, extra: list[str] = ()) -> str:
    """Submit a batch script; returns the job id (never retried: a retry could submit twice)."""
    out = _run(["sbatch", "--parsable", *extra, script])
    return out.strip().split(";")[0]


def scancel(job_ids: list[str], signal: str | None = None, batch: bool = False) -> None:
    if not job_ids:
        return
    argv = ["scancel", *([f"--signal={signal}"] if signal else []), *(["--batch"] if batch else []), *job_ids]
    _run(argv, retries=2)


def _fold(rows: list[JobState]) -> dict[str, JobState]:
    """One state per job. A het job's components (ID+0, ID+1, ...) come in any order (squeue and an
    accounting database both return them so); the leader ID+0 runs the batch script, so its state
    and exit status are the job's, and every component's nodes are kept. Otherwise the first row of
    an id wins (for the jobcomp log, callers put the newest first)."""
    def is_leader(row: JobState) -> bool:
        return row.job_id.partition("+")[2] in ("", "0")

    out: dict[str, JobState] = {}
    het: dict[str, dict[int, str]] = {}
    for row in sorted(rows, key=lambda r: not is_leader(r)):  # stable: leaders first, order kept
        base, _, comp = row.job_id.partition("+")
        if "." in base:
            continue
        if comp.isdigit():
            het.setdefault(base, {}).setdefault(int(comp), row.nodes)
        out.setdefault(base, replace(row, job_id=base))
    return {j: replace(st, het_nodes=tuple(sorted(het.get(j, {}).items()))) for j, st in out.items()}


SQUEUE_FORMAT = "%i|%T|%M|%N|%r|%S|%o"
"""Job id, state, time used, nodes, pending reason, (expected) start, batch script path (last: a
path may hold '|')."""


def squeue(job_ids: list[str], script: str | None = None) -> dict[str, JobState]:
    """Live jobs among `job_ids`, and any of the user's jobs whose batch script is `script` (a job
    sbatch'ed by hand is part of its run before it ever starts). One call for all of the user's
    jobs: `squeue -j` fails outright when any id has already left the queue. Raises SlurmUnknown."""
    try:
        out = _run(["squeue", "-h", "--me", "-o", SQUEUE_FORMAT], retries=1, timeout=QUERY_TIMEOUT_S)
    except SlurmError as e:
        raise SlurmUnknown(str(e)) from None
    wanted, rows = set(job_ids), []
    for line in out.splitlines():
        fields = line.split("|", 6)
        if len(fields) != 7:
            continue
        job_id, state, elapsed, nodes, reason, start, command = fields
        if job_id.split("+")[0] in wanted or (script is not None and command == script):
            rows.append(JobState(job_id, state, elapsed, nodes, "", reason, start))
    return _fold(rows)


def sacct(job_ids: list[str]) -> dict[str, JobState]:
    """Finished jobs among `job_ids` from accounting; falls back to the jobcomp log (`sacct -c`)."""
    if not job_ids:
        return {}
    fields = ["-n", "-P", "-X", "-o", "JobID,State,Elapsed,NodeList,ExitCode", "-j", ",".join(job_ids)]
    try:
        out = _run(["sacct", *fields], retries=1, timeout=QUERY_TIMEOUT_S)
    except SlurmError:
        out = ""
    if not out.strip():
        try:
            out = _run(["sacct", "-c", *fields], retries=1, timeout=QUERY_TIMEOUT_S)
        except SlurmError:
            return {}
    rows = [JobState(*line.split("|")[:5]) for line in out.splitlines() if line.count("|") >= 4]
    rows = [JobState(r.job_id, r.state.split()[0], r.elapsed, r.nodes, r.exit_code) for r in rows]
    # The jobcomp log keeps every record of a requeued job; the newest is last.
    return _fold(list(reversed(rows)))


def job_states(job_ids: list[str], script: str | None = None) -> dict[str, JobState]:
    """squeue for live jobs (with `script`: hand-submitted ones too), sacct for the rest; ids that
    accounting no longer knows are left out. Raises SlurmUnknown when squeue does not answer:
    then nobody can tell whether a job of the run is still queued or running."""
    states = squeue(job_ids, script)
    rest = [j for j in job_ids if j not in states]
    return states | sacct(rest)


def live_jobs(job_ids: list[str], script: str | None = None) -> dict[str, JobState]:
    """The queued or running jobs among `job_ids` (and of `script`). Raises SlurmUnknown."""
    return {j: s for j, s in squeue(job_ids, script).items() if s.state in ACTIVE}
