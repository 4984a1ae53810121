"""Preemption of a 1.5B run on GPUs under SLURM, measured: the test cluster on a GPU machine
(tests/test_gpu_slurm.py says how to bring it up), vLLM on one node's GPU, the trainer on another's,
weights by NCCL broadcast between the het groups.

    python3 benchmarks/bench_model.py --preset qwen2-1.5b --out /tmp/m15
    python3 benchmarks/gpu_slurm_preemption.py --model /tmp/m15 --work /tmp/preempt --json OUT.json

One job, three attempts: after step 2 SLURM's warning (USR1 to the batch script, as --signal=B:USR1
sends it) makes the trainer checkpoint and the job requeue itself; three steps into the next attempt an
admin's `scontrol requeue` (TERM, no warning, SIGKILL after KillWait) requeues it, and the next attempt
resumes from the newest complete checkpoint. Printed: submit -> first step, signal -> checkpoint
complete (where one was written on the signal), signal -> first step of the next attempt, per event; that every attempt
continued at the step after its checkpoint, with the data order and policy versions an uninterrupted
run has; and the median step time under SLURM against the same config in local mode (`prl submit
--local`, inference and trainer on two GPUs of this machine) run right after: the SLURM layer's cost.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from prl.control import slurm  # noqa: E402
from prl.control.progress import metrics_by_attempt  # noqa: E402
from prl.run.rundir import RunDir  # noqa: E402

STEPS = 12


def config(model: str) -> list[str]:
    return [f"model.name={model}", "model.dtype=bfloat16", "model.max_model_len=2048", "run.wandb.mode=disabled",
            f"run.max_steps={STEPS}", "trainer.checkpoint.interval=100", "inference.gpus_per_node=1",
            "trainer.gpus_per_node=1", "inference.weight_transfer=broadcast", "trainer.micro_batch_size=8",
            "orchestrator.sampling.max_tokens=128", "slurm.time=00:30:00"]


def metrics(run: Path, attempt: int) -> list[dict]:
    """Trainer rank 0's records of one attempt (none yet: [])."""
    return metrics_by_attempt(RunDir(run)).get(attempt, [])


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)
    return value


def complete_checkpoints(run: Path) -> set[int]:
    return {int(p.parent.name.removeprefix("step_")) for p in run.glob("checkpoints/step_*/COMPLETE")}


def preempt(run: Path, job_id: str, attempt: int, how: str, after: int = 3) -> dict:
    """Signal the job once attempt `attempt` has done `after` steps; time the checkpoint and the next start.

    The next attempt says where it resumed (its first step). A checkpoint of that step whose COMPLETE is
    newer than the signal was written on it (USR1); an older one was the newest complete checkpoint at
    the time (scontrol requeue: TERM, then SIGKILL after the cluster's KillWait, no time to write one)."""
    wait(lambda: len(metrics(run, attempt)) >= after, 900, f"{after} steps of attempt {attempt}")
    t0, wall0 = time.monotonic(), time.time()
    if how == "USR1":
        slurm.scancel([job_id], signal="USR1", batch=True)
    else:
        subprocess.run(["scontrol", "requeue", job_id], check=True)
    wait(lambda: metrics(run, attempt + 1), 900, f"the first step of attempt {attempt + 1}")
    t_step = time.monotonic()
    done = [m["step"] for m in metrics(run, attempt)]
    resumed = metrics(run, attempt + 1)[0]["step"]
    complete = run / f"checkpoints/step_{resumed}/COMPLETE"
    written = complete.exists() and complete.stat().st_mtime >= wall0
    event = {"event": how, "attempt": attempt, "steps_done": done[-1] + 1, "resumed_at": resumed,
             "checkpoint_written_on_signal": written, "signal_to_next_first_step_s": round(t_step - t0, 1)}
    if written:
        t_ckpt = t0 + complete.stat().st_mtime - wall0
        event |= {"signal_to_checkpoint_s": round(t_ckpt - t0, 1),
                  "checkpoint_to_next_first_step_s": round(t_step - t_ckpt, 1)}
    return event


def step_times(records: list[dict], skip: int = 2) -> float:
    return statistics.median(m["perf/step_s"] for m in records[skip:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip-local", action="store_true")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    toy = str(ROOT / "configs/toy.yaml")
    prl = [sys.executable, "-m", "prl.control.cli"]

    t0 = time.monotonic()
    r = subprocess.run([*prl, "submit", toy, f"run.output_dir={args.work / 'slurm'}", *config(args.model)],
                       capture_output=True, text=True, cwd=args.work)
    if r.returncode != 0:
        raise SystemExit(r.stdout + r.stderr)
    job_id = re.search(r"submitted job (\d+)", r.stdout).group(1)
    run = args.work / "slurm/toy"
    wait(lambda: metrics(run, 0), 900, "the first step")
    result: dict = {"job": job_id, "submit_to_first_step_s": round(time.monotonic() - t0, 1), "events": []}
    print(f"submit -> first step: {result['submit_to_first_step_s']}s", flush=True)
    for attempt, how in ((0, "USR1"), (1, "scontrol requeue")):
        event = preempt(run, job_id, attempt, how)
        result["events"].append(event)
        print(json.dumps(event), flush=True)
    wait(lambda: (st := slurm.job_states([job_id]).get(job_id)) and st.state not in slurm.ACTIVE and st, 1800,
         "the job to end")
    state = slurm.job_states([job_id])[job_id].state
    attempts = [metrics(run, a) for a in range(3)]
    steps = [m["step"] for records in attempts for m in records]
    versions = {m["step"]: m["rollout/policy_version"] for records in attempts for m in records}
    result |= {
        "state": state,
        # each attempt continues where the previous one's checkpoint left off, and the run reaches the end
        "steps_in_order": all(a[i]["step"] == a[0]["step"] + i for a in attempts if a for i in range(len(a)))
        and sorted(set(steps)) == list(range(STEPS)),
        "resumed_at": [records[0]["step"] for records in attempts[1:]],
        "policy_versions_as_uninterrupted": all(v == max(0, s - 1) for s, v in versions.items()),
        "broadcast_versions": len(re.findall(r"weights updated version \d+ by broadcast",
                                             "".join(p.read_text() for p in run.glob("logs/attempt_*/inference/rank_*.log")))),
        "slurm_step_s_median": round(step_times(attempts[0] + attempts[1] + attempts[2]), 3),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "events"}), flush=True)
    if args.json:  # kept even if the local run below does not finish
        args.json.write_text(json.dumps(result, indent=1))
    if not args.skip_local:
        r = subprocess.run([*prl, "submit", toy, "--local", f"run.output_dir={args.work / 'local'}",
                            *config(args.model)], capture_output=True, text=True, cwd=args.work, timeout=1800)
        local = metrics(args.work / "local/toy", 0)
        result["local_rc"] = r.returncode
        if local:
            result["local_step_s_median"] = round(step_times(local), 3)
            result["slurm_over_local"] = round(result["slurm_step_s_median"] / result["local_step_s_median"], 3)
        print(json.dumps({k: result.get(k) for k in ("local_rc", "local_step_s_median", "slurm_over_local")}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
