"""A shipped one-node config as a SLURM job on GPUs, measured: the layout of configs/one_node_4gpu.yaml
(or _8gpu, _2gpu) at 1.5B, SIGUSR1 mid-run (SLURM's warning: checkpoint, requeue, exact resume), then
the figures issue 26 asks of the 8-GPU run. On a GPU machine with the test cluster as ONE node of all
its GPUs (benchmarks/one_node_session.sh brings it up):

    python3 benchmarks/rl_bench.py --preset qwen2-1.5b --gpus 4 --skip-loop --work /tmp/rlb --json /tmp/offline.json
    python3 benchmarks/one_node_bench.py configs/one_node_4gpu.yaml --model /tmp/rlb/models/qwen2-1.5b \\
        --offline /tmp/offline.json --work /tmp/one-node --json OUT.json

The config's layout (slurm, GPUs per component, replicas) is submitted as is; what it trains is
rl_bench's workload instead of its math task (no dataset on the GPU machines, and a random model
scores 0 there): the toy task, 256 rollouts x 1024 tokens (ignore_eos), async 1, the trainer compiled,
no periodic checkpoints. After --usr1-after steps, `scancel --signal=USR1 --batch` (what
`--signal=B:USR1@...` sends before the time limit); the job checkpoints, requeues itself and resumes.
Printed: submit -> first step (and the startup/* split), step time, trainer idle, rollout tok/s
against replicas x one GPU's offline rate (rl_bench's figures from the same call), loop efficiency
(issue 24's measure), weight update latency, signal -> checkpoint complete -> first step of the next
attempt, and that the resumed run has an uninterrupted run's steps and policy versions.
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
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_slurm_preemption import metrics, preempt, wait  # noqa: E402
from rl_bench import machine  # noqa: E402
from rl_bench_engine import LOOP_REQUEST, RECOMPUTE_REQUEST, fastest_plain  # noqa: E402

from prl.config import load_config  # noqa: E402
from prl.control import slurm  # noqa: E402

NAME = "one-node-bench"


def workload(args: argparse.Namespace) -> list[str]:
    """rl_bench's batch on the config's layout: keys over the shipped config."""
    return [f"run.output_dir={args.work}", f"run.name={NAME}", f"run.max_steps={args.steps}", "run.async_level=1",
            "run.wandb.mode=disabled", f"model.name={args.model}", "model.dtype=bfloat16", "model.max_model_len=1536",
            "orchestrator.environment=null", "orchestrator.environments=[{id: prl.envs.toy}]",
            "orchestrator.batch_size=256", "orchestrator.rollouts_per_example=8", "orchestrator.max_concurrent=256",
            "orchestrator.sampling.temperature=1.0", "orchestrator.sampling.max_tokens=1024",
            "orchestrator.sampling.extra_body={ignore_eos: true}", "inference.gpu_memory_utilization=0.85",
            "trainer.micro_batch_size=8", "trainer.compile=true", "trainer.lr=1e-6", "trainer.checkpoint.interval=0",
            "trainer.checkpoint.keep_last=1", "slurm.time=00:40:00", *args.set]


def mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return statistics.fmean(values) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--offline", type=Path, required=True, help="rl_bench --json of the same call (its offline figures)")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--usr1-after", type=int, default=4, help="steps of the first attempt before SIGUSR1")
    ap.add_argument("--skip", type=int, default=2, help="steps of each attempt left out of the means (compile, filling up)")
    ap.add_argument("--set", nargs="*", default=[], help="more KEY=VALUE overrides, e.g. inference.weight_transfer=broadcast")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}", flush=True)
    keys = workload(args)
    cfg = load_config(args.config.resolve(), keys)
    replicas = cfg.inference.data_parallel
    prl = [sys.executable, "-m", "prl.control.cli"]

    t0 = time.monotonic()
    r = subprocess.run([*prl, "submit", str(args.config.resolve()), *keys], capture_output=True, text=True, cwd=args.work)
    if r.returncode != 0:
        raise SystemExit(r.stdout + r.stderr)
    job_id = re.search(r"submitted job (\d+)", r.stdout).group(1)
    run = args.work / NAME
    wait(lambda: metrics(run, 0), 900, "the first step")
    result: dict = {"config": str(args.config), "overrides": keys, "job": job_id,
                    "submit_to_first_step_s": round(time.monotonic() - t0, 1)}
    print(f"job {job_id}: submit -> first step {result['submit_to_first_step_s']}s", flush=True)
    result["usr1"] = preempt(run, job_id, 0, "USR1", after=args.usr1_after)
    print(json.dumps(result["usr1"]), flush=True)
    wait(lambda: (st := slurm.job_states([job_id]).get(job_id)) and st.state not in slurm.ACTIVE and st, 1800,
         "the job to end")
    attempts = [a for a in (metrics(run, i) for i in range(4)) if a]
    steps = [m["step"] for a in attempts for m in a]
    versions = {m["step"]: m["rollout/policy_version"] for a in attempts for m in a}
    steady = [m for a in attempts for m in a[args.skip:]]
    offline = json.loads(args.offline.read_text())["offline"]["variants"]
    request = LOOP_REQUEST if cfg.trainer.behaviour_logprobs == "inference" else RECOMPUTE_REQUEST
    step_s, train_s = mean(steady, "perf/step_s"), mean(steady, "perf/train_s")
    batch_tokens = mean(steady, "rollout/completion_len_mean") * cfg.orchestrator.batch_size
    offline_gen_s = batch_tokens / (replicas * fastest_plain(offline))  # rl_bench's efficiency
    rollout = mean(steady, "rollout/rollout_tokens_per_s")
    result |= {
        "state": slurm.job_states([job_id])[job_id].state,
        "attempts": len(attempts),
        "steps_in_order": sorted(steps) == steps == list(range(args.steps)),
        "policy_versions_as_uninterrupted": all(v == max(0, s - 1) for s, v in versions.items()),
        "steps_measured": [m["step"] for m in steady],
        "step_s": step_s, "train_s": train_s, "trainer_idle": mean(steady, "perf/wait_s") / step_s,
        "generation_s": mean(steady, "rollout/generation_s"), "rollout_tok_s": rollout,
        "replicas": replicas, "offline_plain_tok_s": offline["plain"]["tok_s"],
        "offline_request_tok_s": offline[request]["tok_s"],
        "vs_replicas_offline_plain": rollout / (replicas * offline["plain"]["tok_s"]),
        "vs_replicas_offline_request": rollout / (replicas * offline[request]["tok_s"]),
        # issue 24: max(the trainer's step, offline generation of the batch on the run's GPUs) / step
        "efficiency": max(train_s, offline_gen_s) / step_s, "offline_generation_s": offline_gen_s,
        "weight_update_s": statistics.median(m["rollout/weight_update_s"] for m in steady if m.get("rollout/weight_update_s")),
        "startup": [{k.removeprefix("startup/"): round(v, 1) for k, v in a[0].items() if k.startswith("startup/")}
                    for a in attempts],
        "step_s_by_attempt": [[round(m["perf/step_s"], 2) for m in a] for a in attempts],
        "gpus_by_component": node_gpus(run),
    }
    print(json.dumps(result, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result | {"machine": machine()}, indent=1))
    print_table(result)


def node_gpus(run: Path) -> dict[str, str]:
    """Component -> where prl.run.node's first line of attempt 0 says it ran (host; CUDA_VISIBLE_DEVICES)."""
    found = {}
    for out in sorted(run.glob("logs/attempt_0/*/*.out")):
        m = re.search(r"leader pid \d+ on ([^\n]+)", out.read_text(errors="replace"))
        if m:
            found[out.parent.name] = m[1].strip()
    return found


def print_table(r: dict) -> None:
    e = r["usr1"]
    print(f"\n| figure | value |\n| --- | ---: |")
    for label, value in [
        ("job state", f"{r['state']} after {r['attempts']} attempts"),
        ("steps in order, policy versions as uninterrupted", f"{r['steps_in_order']}, {r['policy_versions_as_uninterrupted']}"),
        ("submit -> first step", f"{r['submit_to_first_step_s']:.0f} s"),
        ("startup of each attempt (s from its launch)", "; ".join(", ".join(f"{k} {v}" for k, v in s.items()) for s in r["startup"])),
        (f"step (mean of steps {r['steps_measured']})", f"{r['step_s']:.2f} s"),
        ("trainer idle", f"{r['trainer_idle']:.0%}"),
        ("train", f"{r['train_s']:.2f} s"),
        ("rollout tok/s", f"{r['rollout_tok_s']:,.0f}"),
        (f"vs {r['replicas']} x one GPU offline, plain / the run's request",
         f"{r['vs_replicas_offline_plain']:.2f} / {r['vs_replicas_offline_request']:.2f}"),
        ("loop efficiency (issue 24)", f"{r['efficiency']:.2f}"),
        ("weight update (median)", f"{r['weight_update_s']:.2f} s"),
        (f"USR1 after step {e['steps_done'] - 1} -> checkpoint complete", f"{e.get('signal_to_checkpoint_s', float('nan'))} s"),
        ("checkpoint complete -> first step of the next attempt", f"{e.get('checkpoint_to_next_first_step_s', float('nan'))} s"),
        (f"resumed at step", f"{e['resumed_at']}"),
    ]:
        print(f"| {label} | {value} |")


if __name__ == "__main__":
    main()
