"""The run directory: the only state of a run (see docs/architecture.md for the layout). `RunDir`
names its paths and creates its tree; what is read from or written to them belongs to the module that
owns that fact (prl.run.launches: attempts and the jobs' records; prl.run.rewind: what a resumed run
drops; prl.run.batch: batches; prl.run.secret: the secret). `is_complete` and `complete_steps` are the
one definition of a finished step directory.

Checkpoints and weights are complete only when their `COMPLETE` marker exists; a step directory
without it does not exist for anyone reading the run.

The run is its owner's alone from the first moment: its processes create under `umask_for(group_readable)`
(0700/0600; run.group_readable: 0750/0640), and every launch starts only in a run directory that
`not_private` finds nothing wrong with.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prl.run.attempt import Attempt
from prl.run.files import fsync, fsync_tree, write_atomic
from prl.run.protocol import CANCELLED, COMPLETE

if TYPE_CHECKING:
    from prl.config import Config

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

    def attempt(self, n: int) -> Attempt:
        """logs/attempt_N, as the object that owns the paths in it."""
        return Attempt(self.logs / f"attempt_{n}")

    def create(self, config_text: str, job_text: str, group_readable: bool = False) -> None:
        """Write the resolved config and the job script; make the artifact directories. Each is
        made with the run's mode, and a run made before runs were private gets it too (the top and
        the directories under it; the process's umask, `umask`, covers what is created inside)."""
        mode = dir_mode(group_readable)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for d in (self.path, self.logs, self.checkpoints, self.weights, self.rollouts):
            d.mkdir(mode=mode, exist_ok=True)
            os.chmod(d, mode)
        write_atomic(self.config, config_text)
        write_atomic(self.job_script, job_text)
        for d in (self.checkpoints, self.weights):
            set_lustre_striping(d)


def is_complete(step_dir: Path) -> bool:
    """The one definition of a complete checkpoint or weights directory."""
    return (step_dir / COMPLETE).exists()


def mark_complete(step_dir: Path, durable: bool = True, fence: Callable[[], str | None] = lambda: None) -> None:
    """Written last, after everything in `step_dir` is in place and on the disk: a node that crashes
    (or loses power) right after cannot leave a marker that vouches for files it never flushed.

    durable=False: in place (readers on any node see it whole), not yet on the disk. For the policy
    versions the trainer publishes every step, which the next batch waits for
    (prl.trainer.export.make_durable says why a crash cannot leave one of those behind).
    `fence`: asked last, right before the marker is written (prl.run.fence.check: it exits unless
    this process's attempt still writes the run); the marker records the writer it returns."""
    if durable:
        fsync_tree(step_dir)
    writer = fence()
    write_atomic(step_dir / COMPLETE, f"{writer}\n" if writer else "", sync=durable)


def remove_step(step_dir: Path) -> None:
    """Delete a checkpoint or weights directory, its COMPLETE marker first and that on the disk: a
    crash midway leaves a directory without it (which nobody reads and the next prune or launch
    removes), never a COMPLETE over half of one."""
    try:
        (step_dir / COMPLETE).unlink()
        fsync(step_dir)
    except FileNotFoundError:
        pass
    shutil.rmtree(step_dir, ignore_errors=True)


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


def dir_mode(group_readable: bool) -> int:
    """A run directory's mode (and of every directory in it): its owner's, with run.group_readable
    also readable by its group; never anyone else's."""
    return 0o750 if group_readable else 0o700


def umask_for(group_readable: bool) -> int:
    """The umask under which the run's processes create its files, 0700/0600 (0750/0640) from the
    first moment: a handle another user opens in a moment it was wider stays open for the run's
    life, and a copy of the run (cp -r) keeps the modes. The batch script sets it (srun hands it to
    every task), `prl submit` for itself and a local run's components (set_umask)."""
    return 0o777 & ~dir_mode(group_readable)


def set_umask(group_readable: bool) -> int:
    """This process's umask (and its children's) is the run's from now on; returns the previous one."""
    return os.umask(umask_for(group_readable))


def not_private(rd: RunDir) -> str | None:
    """Why the run directory is not this user's own, in one line naming the path, or None. Checked
    at every launch: a link at RUN would send the run's writes elsewhere, and a group member who can
    write RUN or its config.yaml could swap the config the next requeue starts from."""
    for path in (rd.path, rd.config):
        if problem := not_own(path):
            return problem
        if (mode := os.lstat(path).st_mode) & 0o022:
            return f"{path}: others may write it ({stat.filemode(mode)}); `chmod go-w` it, then start again"
    return None


def not_own(path: Path) -> str | None:
    """Why `path` is not this user's own file or directory (missing, a link, another's), or None."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{path}: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path}: a symbolic link; a run's directory and config must be its owner's own, not links"
    if st.st_uid != os.getuid():
        return f"{path}: owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    return None


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




if __name__ == "__main__":
    # Job scripts written before prl.run.launches held the launch's first command still call
    # `python -m prl.run.rundir new-attempt RUN_DIR` (`prl resume` resubmits them as they are). runpy,
    # not an import: this file, run as __main__, is not prl.run.rundir, which prl.run.launches imports.
    import runpy

    runpy.run_module("prl.run.launches", run_name="__main__", alter_sys=True)
