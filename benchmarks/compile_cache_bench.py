"""What run.compile_cache saves a run's later job: the toy RL run on the Slurm test cluster (tests'
layout: vLLM on one node, the trainer over two, the orchestrator on a fourth), to its end, then
`prl resume --step 2` (a second job of the same run, steps 2-5 again), the trainer compiled (as on
GPU), once with the compile caches
kept in RUN/cache (the default) and once in each job's scratch (run.compile_cache=false). Printed
per job: submit -> first batch and -> first step (the startup/* metrics, from the launch), the job's
wall time, and what RUN/cache holds after it.

    PRL_SLURM_NODES=9 bash tools/slurm_cluster.sh up
    .venv/bin/python benchmarks/compile_cache_bench.py --work /tmp/ccb [--pairs 2]

What the cache keeps here is the trainer's torch.compile (inductor's C++ on CPU; on GPU also Triton's
kernels); the toy run's vLLM on CPU compiles nothing (enforce_eager).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers import final_state, metrics, prl, submit_rl, submitted_job  # noqa: E402

VARIANTS = {"kept": (), "per job": ("run.compile_cache=false",)}
COMPILED = ("trainer.compile=true",)
"""The trainer torch.compiled, as on GPU (on CPU its default is eager): what a later job can find compiled."""


def cache_files(run: Path) -> int:
    cache = run / "cache"
    return sum(1 for p in cache.rglob("*") if p.is_file()) if cache.is_dir() else 0


def job(run: Path, job_id: str, attempt: int, t0: float) -> dict:
    state = final_state(job_id)
    wall = time.monotonic() - t0
    assert state.state == "COMPLETED", (run, state)
    first = metrics(run, attempt)[0]
    return {"wall_s": wall, "first_batch_s": first.get("startup/first_batch_s"),
            "first_step_s": first.get("startup/first_step_s"), "cache_files": cache_files(run)}


def variant(work: Path, name: str, overrides: tuple[str, ...]) -> list[dict]:
    """Job 1 (a new run) and job 2 (`prl resume --step 2` of it)."""
    t0 = time.monotonic()
    run, job_id = submit_rl(work, *COMPILED, *overrides)
    first = job(run, job_id, 0, t0)
    t0 = time.monotonic()
    second = job(run, submitted_job(prl("resume", "--step", "2", str(run), cwd=run)), 1, t0)
    return [first, second]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/compile-cache-bench"))
    parser.add_argument("--pairs", type=int, default=1, help="runs of each variant, alternating")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"machine: {platform.node()}, {len(__import__('os').sched_getaffinity(0))} cores, the Slurm test cluster")
    results: dict[str, list[list[dict]]] = {name: [] for name in VARIANTS}
    for i in range(args.pairs):
        for name, overrides in VARIANTS.items():
            out = variant(args.work / f"{i}-{name.replace(' ', '-')}", name, overrides)
            results[name].append(out)
            print(json.dumps({"variant": name, "pair": i, "jobs": out}), flush=True)
    print("\n| compile caches | job | first batch s | first step s | job wall s | files in RUN/cache |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, runs in results.items():
        for j, what in enumerate(("1: new run", "2: prl resume --step 2")):
            med = {k: statistics.median(r[j][k] for r in runs) for k in ("first_batch_s", "first_step_s", "wall_s")}
            print(f"| {name} | {what} | {med['first_batch_s']:.1f} | {med['first_step_s']:.1f} | {med['wall_s']:.1f} "
                  f"| {runs[-1][j]['cache_files']} |")
    kept, per_job = (statistics.median(r[1]["first_step_s"] for r in results[n]) for n in VARIANTS)
    print(f"\njob 2's first step, kept against per job: {kept:.1f} s against {per_job:.1f} s (x{per_job / kept:.2f})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
