"""How long a policy version takes from the trainer's hand-off to its COMPLETE marker, fsynced
(durable, what every version did until now) against not (the RL loop's versions now; a checkpoint makes
the ones a resume needs durable: prl.trainer.export.make_durable). The orchestrator cannot load a
version before its COMPLETE, and the next batch waits for that load (docs/performance.md).

    python benchmarks/publish_bench.py --gb 3.1 --rounds 3 --dir /tmp/publish-bench

Writes a state of --gb GB of bf16 tensors (the 1.5B model's 3.1 GB by default) with
prl.trainer.export.write_weights into a run directory under --dir, alternating the two ways, and
prints the median of each and their ratio, measured in this run on this machine's disk.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import torch

from prl.run.rundir import RunDir
from prl.trainer.export import write_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=3.1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/publish-bench"))
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    source = args.dir / "source"
    source.mkdir(parents=True)
    (source / "config.json").write_text("{}\n")
    rd = RunDir(args.dir / "run")
    columns = 32 * 1024 * 1024  # 64 MiB bf16 tensors, as a model's large matrices
    state = {f"w{i}": torch.ones(columns, dtype=torch.bfloat16) for i in range(max(1, round(args.gb * 1e9 / (2 * columns))))}
    size = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(1, 2 * args.rounds + 1):
        durable = step % 2 == 1
        start = time.perf_counter()
        write_weights(state, source, rd, step, durable=durable)
        times[durable].append(time.perf_counter() - start)
        shutil.rmtree(rd.weights_dir(step - 1), ignore_errors=True)  # as prune_weights: the disk stays this size
    shutil.rmtree(args.dir, ignore_errors=True)
    synced, unsynced = statistics.median(times[True]), statistics.median(times[False])
    print(f"machine: {platform.node()}, {os.cpu_count()} cores; {size:.2f} GB per version, {args.rounds} rounds each")
    print(f"durable (fsync, then COMPLETE): median {synced:.2f} s {['%.2f' % t for t in times[True]]}")
    print(f"not durable (COMPLETE at once): median {unsynced:.2f} s {['%.2f' % t for t in times[False]]}")
    print(f"ratio durable / not durable: {synced / unsynced:.2f}")


if __name__ == "__main__":
    main()
