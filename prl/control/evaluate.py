"""`prl eval RUN [--steps 10,20 | --all] [--local]`: evaluate a run's saved weights with its eval settings.

    prl eval RUN --steps 10,20 --local    # here: one vLLM server per version, one after the other
    prl eval RUN --all                    # SLURM: one array task per version, each with its own vLLM

Each version is one run of jobs/eval.py: `orchestrator.eval` (environments, examples, rollouts,
sampling) against weights/step_N (0: model.name), into RUN/evals/step_N.json, which `prl status`
shows. Without --steps or --all: the newest saved weights. On SLURM the array is submitit's: one
`run_step` per version, pickled into RUN/evals/logs/submitit/, its tasks with the inference group's
batch options (partition, account, qos, time, constraint, mem, gres, GPUs, setup, python;
prl.control.render.eval_array_parameters). Control plane: nothing heavy is imported here.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

from prl.config import component_slurm, load_config
from prl.control import slurm
from prl.control.render import eval_array_parameters
from prl.run.home import PRL_HOME
from prl.run.rundir import RunDir, complete_steps


def parse_steps(text: str) -> list[int]:
    """'10,20' -> [10, 20]; ValueError naming the bad word."""
    steps = []
    for word in text.split(","):
        if not word.strip().isdigit():
            raise ValueError(f"{word.strip()!r} is not a step number (e.g. --steps 10,20)")
        steps.append(int(word))
    return sorted(set(steps))


def missing_steps(rd: RunDir, steps: list[int]) -> list[int]:
    """Steps without complete weights (0 is the base model, model.name: never missing)."""
    saved = set(complete_steps(rd.weights))
    return [s for s in steps if s != 0 and s not in saved]


def eval_command(rd: RunDir, step: int) -> list[str]:
    return eval_command_for(str(rd.config), step)


def eval_command_for(config: str, step: int) -> list[str]:
    return [sys.executable, str(PRL_HOME / "jobs" / "eval.py"), config, str(step)]


def run_local(rd: RunDir, steps: list[int]) -> int:
    """jobs/eval.py for each step in turn, here; 0 when every one wrote its record."""
    failed = []
    for step in steps:
        print(f"step {step}: starting vLLM and the eval (logs: {rd.eval_log_dir(step)})", flush=True)
        env = {**os.environ, "PRL_RUN_DIR": str(rd.path)}
        if subprocess.run(eval_command(rd, step), cwd=str(PRL_HOME), env=env).returncode != 0:
            failed.append(step)
    if failed:
        print(f"eval failed for step(s) {', '.join(map(str, failed))}; see {rd.eval_logs}", file=sys.stderr)
        return 1
    return 0


def run_step(config: str, step: int) -> None:
    """One array task, on its compute node (submitit calls it there): jobs/eval.py for `step`."""
    rc = subprocess.run(eval_command_for(config, step), cwd=str(PRL_HOME)).returncode
    if rc != 0:
        raise RuntimeError(f"jobs/eval.py {config} {step} exited with {rc}")


def submit_array(rd: RunDir, steps: list[int], argv: list[str]) -> str:
    """Submit one submitit job array (a single job for one step); returns its job id. Recorded in
    evals/submissions.jsonl, not with the run's jobs (prl status and prl cancel keep to training)."""
    import submitit

    cfg = load_config(rd.config)
    python = component_slurm(cfg, "inference").python or cfg.slurm.python or sys.executable
    executor = submitit.SlurmExecutor(folder=rd.eval_array_dir, python=shlex.quote(python), max_num_timeout=0)
    executor.update_parameters(**eval_array_parameters(cfg))
    before = set(rd.eval_array_dir.iterdir()) if rd.eval_array_dir.is_dir() else set()
    try:
        with executor.batch():
            jobs = [executor.submit(run_step, str(rd.config), step) for step in steps]
    except (submitit.core.utils.FailedJobError, submitit.core.utils.FailedSubmissionError) as e:
        for path in set(rd.eval_array_dir.iterdir()) - before:  # the refused array's script and calls
            path.unlink()
        raise slurm.SlurmError(f"sbatch failed: {e}") from None
    job_id = jobs[0].job_id.partition("_")[0]
    entry = {"job_id": job_id, "steps": steps, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": argv,
             "script": str(rd.eval_array_dir / f"{job_id}_submission.sh")}
    with open(rd.eval_submissions, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return job_id
