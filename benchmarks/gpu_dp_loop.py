"""Two inference nodes in the RL loop under SLURM on GPUs: independent servers (inference.multi_node=
servers, the orchestrator spreads the requests) against one vLLM server over both nodes
(inference.multi_node=data_parallel: node 0 the endpoint, node 1 a headless engine). The test cluster on
a GPU machine of 4 GPUs, nodes of one GPU each (tests/test_gpu_slurm.py says how to bring it up): vLLM
on two nodes, the trainer on a third, weights by NCCL broadcast to both nodes' workers.

    python3 benchmarks/bench_model.py --preset qwen2-1.5b --out /tmp/m15
    python3 benchmarks/gpu_dp_loop.py --model /tmp/m15 --work /tmp/dp-loop [--pairs 1]

A and B alternate (A B A B ...), each a fresh run. Per run, over steps 2.. (the first two wait for the
servers and the first batch): the median rollout tokens/s of a batch (the orchestrator's completion
tokens over its generation time), the median step time, and submit -> first step
(until 2026-11-27's results: "job start -> first step", wrongly timed from job.log's last change). Prints the
machine, each run, medians and the ratios B/A.
"""

from __future__ import annotations

import argparse
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

STEPS = 10
MODES = {"servers": ["inference.multi_node=servers"], "data_parallel": ["inference.multi_node=data_parallel"]}


def config(model: str) -> list[str]:
    return [f"model.name={model}", "model.dtype=bfloat16", "model.max_model_len=2048", "run.wandb.mode=disabled",
            f"run.max_steps={STEPS}", "trainer.checkpoint.interval=100", "inference.nodes=2",
            "inference.data_parallel=2", "inference.gpus_per_node=1", "trainer.gpus_per_node=1",
            "inference.weight_transfer=broadcast", "trainer.micro_batch_size=8", "orchestrator.batch_size=256",
            "orchestrator.max_concurrent=256", "orchestrator.sampling.max_tokens=256", "slurm.time=00:30:00"]


def one_run(work: Path, model: str, extra: list[str]) -> dict:
    t0, submitted = time.monotonic(), time.time()
    prl = [sys.executable, "-m", "prl.control.cli"]
    r = subprocess.run([*prl, "submit", str(ROOT / "configs/toy.yaml"), f"run.output_dir={work}", *config(model), *extra],
                       cwd=work.parent, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"submit failed: {r.stdout}{r.stderr}")
    job_id = re.search(r"submitted job (\d+)", r.stdout).group(1)
    run = work / "toy"
    while not (st := slurm.job_states([job_id]).get(job_id)) or st.state in slurm.ACTIVE:
        if time.monotonic() - t0 > 900:
            subprocess.run(["scancel", job_id])
            raise SystemExit(f"job {job_id} still running after 900 s")
        time.sleep(2)
    records = metrics_by_attempt(RunDir(run)).get(0, [])
    if st.state != "COMPLETED" or len(records) != STEPS:
        raise SystemExit(f"job {job_id} ended {st.state} with {len(records)} steps: see {run}/logs")
    later = records[2:]
    return {"job": job_id, "rollout_tok_s": statistics.median(m["rollout/rollout_tokens_per_s"] for m in later),
            "step_s": statistics.median(m["perf/step_s"] for m in later),
            "first_step_s": records[0]["time"] - submitted, "wall_s": time.monotonic() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--pairs", type=int, default=1)
    args = parser.parse_args()
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    print(f"machine: {gpus.stdout.strip().splitlines()}; model {args.model}; {STEPS} steps, 256 rollouts of up to "
          f"256 tokens per batch", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in MODES}
    for pair in range(args.pairs):
        for name, extra in MODES.items():
            work = args.work / f"{pair}-{name}"
            work.mkdir(parents=True, exist_ok=True)
            res = one_run(work, args.model, extra)
            runs[name].append(res)
            print(f"pair {pair} {name}: job {res['job']}, rollout {res['rollout_tok_s']:.0f} tok/s, step "
                  f"{res['step_s']:.2f} s, submit -> first step {res['first_step_s']:.0f} s, "
                  f"submit -> end {res['wall_s']:.0f} s", flush=True)
    (a_name, a), (b_name, b) = runs.items()
    print()
    for key, label in (("rollout_tok_s", "rollout tok/s"), ("step_s", "median step s"),
                       ("first_step_s", "submit -> first step s")):
        ma, mb = statistics.median(r[key] for r in a), statistics.median(r[key] for r in b)
        print(f"{label:26s} {a_name}: {ma:9.2f} | {b_name}: {mb:9.2f} | ratio B/A {mb / ma:.3f}")


if __name__ == "__main__":
    main()
