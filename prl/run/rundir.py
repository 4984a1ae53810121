"""The run directory: the only state of a run (see docs/architecture.md for the layout).

    python -m prl.run.rundir new-attempt RUN_DIR     # first thing of each launch (batch script, local mode)

Checkpoints and weights are complete only when their `COMPLETE` marker exists; a step directory
without it does not exist for anyone reading the run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prl.run.attempt import Attempt
from prl.run.files import fsync_tree, is_temporary, write_atomic
from prl.run.protocol import CANCELLED, COMPLETE

if TYPE_CHECKING:
    from prl.config import Config

ARTIFACTS = ("logs", "checkpoints", "weights", "rollouts", "submissions.jsonl", "jobs.jsonl")
_STEP = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def of(cls, cfg: Config, environ: Mapping[str, str] = os.environ) -> RunDir:
        """The run directory a program works in: $PRL_RUN_DIR (the batch script's), else the config's."""
        return cls(Path(environ.get("PRL_RUN_DIR") or cfg.run.run_dir))

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def job_script(self) -> Path:
        return self.path / "job.sbatch"

    @property
    def submissions(self) -> Path:
        return self.path / "submissions.jsonl"

    @property
    def starts(self) -> Path:
        """One line per launch, written by the launch itself: what ran, whoever submitted it."""
        return self.path / "jobs.jsonl"

    @property
    def cancelled(self) -> Path:
        """Written by `prl cancel`: a requeued or hand-resubmitted job of the run does not start."""
        return self.path / CANCELLED

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def cache(self) -> Path:
        """Compiled code kept between the run's jobs (run.compile_cache; prl.run.node.compile_caches)."""
        return self.path / "cache"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def weights(self) -> Path:
        return self.path / "weights"

    @property
    def rollouts(self) -> Path:
        return self.path / "rollouts"

    @property
    def evals(self) -> Path:
        return self.path / "evals"

    def eval_path(self, step: int) -> Path:
        """Results of evaluating policy version `step` (online or `prl eval`; written whole)."""
        return self.evals / f"step_{step}.json"

    @property
    def eval_logs(self) -> Path:
        """`prl eval`'s logs: step_N/ per evaluation, and the SLURM arrays' submitit/."""
        return self.evals / "logs"

    def eval_log_dir(self, step: int) -> Path:
        """Logs of `prl eval`'s evaluation of version `step` (its vLLM server's and its own)."""
        return self.eval_logs / f"step_{step}"

    @property
    def eval_array_dir(self) -> Path:
        """submitit's folder of `prl eval`'s arrays: JOB_submission.sh, each task's pickled call,
        result and log (JOB_TASK_0_log.out)."""
        return self.eval_logs / "submitit"

    @property
    def eval_submissions(self) -> Path:
        """One line per `prl eval` array submitted: job id, steps, time, argv (not the run's jobs)."""
        return self.evals / "submissions.jsonl"

    def eval_records(self) -> list[dict]:
        """evals/step_N.json, by step, each with its `step`; a file being written or not ours is skipped."""
        out = []
        for path in self.evals.glob("step_*.json"):
            step = step_of(path.stem)
            try:
                rec = json.loads(path.read_text())
            except (ValueError, OSError):
                continue
            if step is not None and isinstance(rec, dict):
                out.append(rec | {"step": step})
        return sorted(out, key=lambda r: r["step"])

    def weights_dir(self, step: int) -> Path:
        """Policy version `step` (HF safetensors), complete once its COMPLETE marker exists."""
        return self.weights / f"step_{step}"

    def checkpoint_dir(self, step: int) -> Path:
        """Full state after `step` optimizer steps, complete once its COMPLETE marker exists."""
        return self.checkpoints / f"step_{step}"

    def rollout_path(self, step: int) -> Path:
        """The trainer's batch for `step` (written under a temporary name, then renamed)."""
        return self.rollouts / f"step_{step}.pt"

    def completions_path(self, step: int) -> Path:
        """What the model wrote in batch `step`, one JSON line per rollout (prompt, completion,
        reward, advantage, trained or why not); written before the batch, also tmp + rename."""
        return self.rollouts / f"step_{step}.completions.jsonl"

    def complete_checkpoints(self) -> list[int]:
        return complete_steps(self.checkpoints)

    def complete_weights(self) -> list[int]:
        return complete_steps(self.weights)

    def exists(self) -> bool:
        return self.config.is_file()

    def has_artifacts(self) -> bool:
        """True once anything but the config and script was written (a launch or a submit)."""
        for name in ARTIFACTS:
            p = self.path / name
            if p.is_file() or (p.is_dir() and any(p.iterdir())):
                return True
        return False

    def create(self, config_text: str, job_text: str) -> None:
        """Write the resolved config and the job script; make the artifact directories."""
        for d in (self.logs, self.checkpoints, self.weights, self.rollouts):
            d.mkdir(parents=True, exist_ok=True)
        write_atomic(self.config, config_text)
        write_atomic(self.job_script, job_text)
        for d in (self.checkpoints, self.weights):
            set_lustre_striping(d)

    def record_submission(self, job_id: str, argv: list[str], kind: str = "submit") -> None:
        entry = {"job_id": job_id, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "kind": kind, "argv": argv}
        with open(self.submissions, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def record_start(self, attempt: int, env: dict[str, str] | None = None, pid: int | None = None,
                     pid_start: int | None = None) -> dict:
        """Append this launch to jobs.jsonl: SLURM job id and restart count (none for local runs),
        attempt, node, the supervisor's pid (with its start time for local runs) and time. A job
        sbatch'ed by hand is known to the run from here on."""
        env = os.environ if env is None else env
        entry = {"job_id": env.get("SLURM_JOB_ID"), "restart": int(env.get("SLURM_RESTART_COUNT") or 0),
                 "attempt": attempt, "node": os.uname().nodename, "pid": pid or os.getppid(),
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        entry |= {"pid_start": pid_start} if pid_start is not None else {}
        with open(self.starts, "a") as f:
            f.write(json.dumps(entry) + "\n")
        return entry

    def start_records(self) -> list[dict]:
        return _jsonl(self.starts)

    def job_ids(self) -> list[str]:
        """SLURM job ids of the run, oldest first: every submission and every job that started in it
        (requeued, or submitted by hand). Local launches have none."""
        ids: list[str] = []
        for e in _jsonl(self.submissions) + self.start_records():
            if e.get("job_id") and str(e["job_id"]) not in ids:
                ids.append(str(e["job_id"]))
        return ids

    def attempts(self) -> list[int]:
        if not self.logs.is_dir():
            return []
        return sorted(int(p.name.split("_")[1]) for p in self.logs.glob("attempt_*") if p.name[8:].isdigit())

    def attempt(self, n: int) -> Attempt:
        """logs/attempt_N, as the object that owns the paths in it."""
        return Attempt(self.logs / f"attempt_{n}")

    def attempt_dir(self, attempt: int | None = None) -> Path | None:
        """logs/attempt_N (the newest when attempt is None)."""
        attempts = self.attempts()
        if not attempts:
            return None
        n = attempts[-1] if attempt is None else attempt
        return self.logs / f"attempt_{n}"

    def new_attempt(self) -> tuple[int, Path]:
        """Create the next logs/attempt_N (mkdir is atomic, so two launches never share one)."""
        self.logs.mkdir(parents=True, exist_ok=True)
        n = len(self.attempts())
        while True:
            d = self.logs / f"attempt_{n}"
            try:
                d.mkdir()
            except FileExistsError:
                n += 1
                continue
            latest = self.logs / "latest"
            tmp = self.logs / f".latest.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(d.name)
            os.replace(tmp, latest)
            return n, d

    def rewind_plan(self, step: int) -> tuple[list[Path], list[Path]]:
        """What must go for the run to continue from checkpoint `step`: (to delete, to archive).

        Deleted: rollouts from `step` on (they would be trained on again), weights after `step` and
        their evals, and every step directory without its COMPLETE marker (an interrupted write). Archived:
        complete checkpoints after `step` (expensive to make, so they are kept aside).
        """
        delete = [p for p in _step_entries(self.rollouts) if step_of(p, suffixed=True) >= step]
        delete += self.unfinished()
        delete += [p for p in _step_entries(self.weights) if step_of(p, suffixed=True) > step and is_complete(p)]
        delete += [p for p in _step_entries(self.evals) if step_of(p, suffixed=True) > step]  # of weights that go
        archive = [p for p in _step_entries(self.checkpoints) if is_complete(p) and step_of(p, suffixed=True) > step]
        return sorted(set(delete)), sorted(archive)

    def unfinished(self) -> list[Path]:
        """Writes cut short: weights and checkpoint step directories without COMPLETE, and temporaries."""
        partial = [p for parent in (self.weights, self.checkpoints) for p in _step_entries(parent) if not is_complete(p)]
        return partial + self.temporaries()

    def temporaries(self) -> list[Path]:
        """What a write cut short left behind where the run's components write: weights/.step_N.tmp
        (prl.trainer.export) and the temporaries of prl.run.files.write_atomic in rollouts/ and
        weights/. Checkpoints' .trainer.tmp is inside a step directory without COMPLETE, which goes whole."""
        found = []
        for parent in (self.weights, self.rollouts):
            if parent.is_dir():
                found += [p for p in parent.iterdir() if is_temporary(p.name)]
        return found

    def rewind(self, step: int) -> list[str]:
        """Carry out `rewind_plan(step)`; returns what was done, one line per path."""
        delete, archive = self.rewind_plan(step)
        done = []
        for p in delete:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            done.append(f"removed {p}")
        if archive:
            dest = self.path / "archive" / f"rewind-to-{step}-{time.strftime('%Y%m%d-%H%M%S')}"
            dest.mkdir(parents=True)
            for p in archive:
                p.rename(dest / p.name)
                done.append(f"archived {p} -> {dest / p.name}")
        return done

    def start_attempt(self) -> tuple[int, Path]:
        """What every launch does first: continue from the newest complete checkpoint (dropping
        later partial artifacts), then open a fresh logs/attempt_N."""
        steps = complete_steps(self.checkpoints)
        done = self.rewind(steps[-1] if steps else 0)
        n, d = self.new_attempt()
        if done:
            (d / "rewind.log").write_text("\n".join(done) + "\n")
        return n, d

    def archive(self) -> Path:
        """Move the whole run directory aside (`--clean`): nothing is deleted."""
        dest = self.path.with_name(f"{self.path.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
        self.path.rename(dest)
        return dest


def is_complete(step_dir: Path) -> bool:
    """The one definition of a complete checkpoint or weights directory."""
    return (step_dir / COMPLETE).exists()


def mark_complete(step_dir: Path, durable: bool = True) -> None:
    """Written last, after everything in `step_dir` is in place and on the disk: a node that crashes
    (or loses power) right after cannot leave a marker that vouches for files it never flushed.

    durable=False: in place (readers on any node see it whole), not yet on the disk. For the policy
    versions the trainer publishes every step, which the next batch waits for
    (prl.trainer.export.make_durable says why a crash cannot leave one of those behind)."""
    if durable:
        fsync_tree(step_dir)
    write_atomic(step_dir / COMPLETE, "", sync=durable)


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


def complete_steps(parent: Path) -> list[int]:
    """Steps N with `parent/step_N/COMPLETE`, ascending."""
    if not parent.is_dir():
        return []
    steps = []
    for p in parent.iterdir():
        if (step := step_of(p)) is not None and is_complete(p):
            steps.append(step)
    return sorted(steps)


def step_of(path_or_name: Path | str, suffixed: bool = False) -> int | None:
    """N of a step directory's name `step_N` (checkpoints/, weights/; `path.stem` of evals/step_N.json);
    with `suffixed`, also of `step_N.*` (rollouts/step_N.pt, step_N.completions.jsonl). None for any
    other name: the one parser of step names."""
    name = Path(path_or_name).name
    m = _STEP.match(name.split(".")[0] if suffixed else name)
    return int(m.group(1)) if m else None


def _step_entries(parent: Path) -> list[Path]:
    """`step_N` directories and `step_N.*` files directly under `parent`."""
    if not parent.is_dir():
        return []
    return [p for p in parent.iterdir() if step_of(p, suffixed=True) is not None]


def set_lustre_striping(directory: Path, stripe_count: int = -1, mounts: str | None = None) -> bool:
    """Stripe big-file directories over all OSTs on Lustre; quietly does nothing elsewhere."""
    if shutil.which("lfs") is None or not _on_lustre(directory, mounts):
        return False
    result = subprocess.run(["lfs", "setstripe", "-c", str(stripe_count), str(directory)], capture_output=True)
    return result.returncode == 0


def _on_lustre(path: Path, mounts: str | None = None) -> bool:
    """Whether the longest mount point containing `path` is a Lustre mount (from /proc/mounts)."""
    try:
        mounts = Path("/proc/mounts").read_text() if mounts is None else mounts
    except OSError:
        return False
    path_s, best, fstype = str(path.resolve()), "", ""
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (path_s == mnt or path_s.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, parts[2]
    return fstype == "lustre"


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
    """`new-attempt RUN_DIR`: rewind to the newest complete checkpoint, create logs/attempt_N, record
    the launch in jobs.jsonl and print N (called by the batch script before any component starts).
    Exits CANCELLED_EXIT, creating nothing, when `prl cancel` cancelled this job (a requeue of it);
    a new job (sbatch of job.sbatch by hand) clears the mark and continues the run."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "new-attempt":
        print("usage: python -m prl.run.rundir new-attempt RUN_DIR", file=sys.stderr)
        return 2
    rd = RunDir(Path(args[1]))
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
    n, _ = rd.start_attempt()
    rd.record_start(n)
    print(n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
