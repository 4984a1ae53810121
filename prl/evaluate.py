"""`prl eval RUN [--steps 10,20 | --all] [--local]`: evaluate a run's saved weights with its eval settings.

    prl eval RUN --steps 10,20 --local    # here: one vLLM server per version, one after the other
    prl eval RUN --all                    # SLURM: one array task per version, each with its own vLLM

Each version is one run of jobs/eval.py: `orchestrator.eval` (environments, examples, rollouts,
sampling) against weights/step_N (0: model.name), into RUN/evals/step_N.json, which `prl status`
shows. Without --steps or --all: the newest saved weights. The array's tasks take the inference
group's batch options (partition, account, qos, time, constraint, mem, gres, GPUs, setup, python).
Control plane: nothing heavy is imported here, the programs do that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from prl import slurm
from prl.config import load_config
from prl.home import PRL_HOME
from prl.render import render_eval_array
from prl.rundir import RunDir, write_atomic


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
    saved = set(rd.complete_weights())
    return [s for s in steps if s != 0 and s not in saved]


def eval_command(rd: RunDir, step: int) -> list[str]:
    return [sys.executable, str(PRL_HOME / "jobs" / "eval.py"), str(rd.config), str(step)]


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


def submit_array(rd: RunDir, steps: list[int], argv: list[str]) -> str:
    """Render, write and sbatch the job array; returns its job id. Recorded in evals/submissions.jsonl,
    not with the run's jobs (prl status and prl cancel keep to the training job)."""
    from prl.submit import check_script

    cfg = load_config(rd.config)
    text = render_eval_array(cfg, steps, python=sys.executable, prl_home=str(PRL_HOME))
    check_script(text)
    rd.eval_logs.mkdir(parents=True, exist_ok=True)  # sbatch opens the tasks' --output there
    write_atomic(rd.eval_script, text)
    job_id = slurm.sbatch(str(rd.eval_script))
    entry = {"job_id": job_id, "steps": steps, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": argv}
    with open(rd.eval_submissions, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return job_id
