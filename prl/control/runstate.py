"""Whether a run is busy: its SLURM jobs (submitted by prl, requeued or sbatch'ed by hand) and its
local supervisor. Destructive commands ask here first and refuse on "busy" and on "unknown".

    from prl.control.runstate import ensure_idle
    ensure_idle(rd, "resume")     # raises RunBusy, or SlurmUnknown when squeue does not answer
"""

from __future__ import annotations

from prl.control import slurm
from prl.run import launches
from prl.run.procs import process_start
from prl.run.rundir import RunDir


class RunBusy(RuntimeError):
    """A job or local launch of the run is queued or running; exit status 1."""


def live_local(rd: RunDir) -> dict | None:
    """The newest local launch's record if its supervisor still runs on this machine."""
    import os

    local = [e for e in launches.start_records(rd) if not e.get("job_id") and e.get("pid_start")]
    if not local or local[-1].get("node") != os.uname().nodename:
        return None
    entry = local[-1]
    return entry if process_start(int(entry["pid"])) == entry["pid_start"] else None


def live_jobs(rd: RunDir) -> dict[str, slurm.JobState]:
    """Queued or running SLURM jobs of the run. Raises SlurmUnknown when SLURM does not answer; on a
    machine without SLURM (not installed, or no cluster configured), a run that never went through
    it has none."""
    ids = launches.job_ids(rd)
    try:
        return slurm.live_jobs(ids, script=str(rd.job_script))
    except slurm.SlurmUnknown as e:
        if not ids and slurm.not_here(e):
            return {}  # no SLURM here, and no job was ever submitted or started: a local-only run
        raise


def ensure_idle(rd: RunDir, action: str) -> None:
    """Refuse `action` while any job or local launch of the run may be running."""
    if (local := live_local(rd)) is not None:
        raise RunBusy(f"{rd.path} is running locally (pid {local['pid']}, attempt {local['attempt']}); "
                      f"stop it first (prl cancel, or Ctrl-C in its terminal) before {action}")
    try:
        live = live_jobs(rd)
    except slurm.SlurmUnknown as e:
        raise slurm.SlurmUnknown(f"cannot tell whether a job of {rd.path} is queued or running ({e}); "
                                 f"not going to {action} until SLURM answers") from None
    if live:
        jobs = ", ".join(f"{j} ({s.state})" for j, s in live.items())
        if held := [j for j, s in live.items() if slurm.held(s.reason)]:
            raise RunBusy(f"{rd.path} still has job {jobs}; SLURM holds {', '.join(held)} ({live[held[0]].reason}), "
                          f"which starts only once released (scontrol release {' '.join(held)}): release it, or "
                          f"cancel it (prl cancel), before {action}")
        raise RunBusy(f"{rd.path} still has job {jobs}; cancel it first (prl cancel) or let it finish "
                      f"before {action}")
