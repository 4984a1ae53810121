"""What staging a policy version costs the engine's own thread (prl.inference.readahead), on this host.

    python benchmarks/staging_bench.py [--gib 2.9] [--rounds 3]

A vLLM worker stages in a thread of the engine's process, beside the thread that schedules and
launches each decode step (Python, CPU-bound at 1.5B: docs/performance.md). This writes a safetensors
file of the given size (1.5B in bf16: 2.9 GiB), reads it through the page cache as a staging does, and
measures, per round: the read's seconds and GiB/s (the first round allocates the buffers, later ones
reuse them), and the rate of a pure-Python loop standing in for the engine's thread while the read
runs, against the same loop alone just before (the ratio is the share of its speed it keeps).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from prl.inference import readahead


def spin_rate(stop: threading.Event | None, seconds: float = 1.0) -> float:
    """Iterations a second of a small pure-Python loop, until `stop` is set (or for `seconds`)."""
    count, start = 0, time.perf_counter()
    while (stop is None and time.perf_counter() - start < seconds) or (stop is not None and not stop.is_set()):
        for _ in range(1000):
            count += 1
    return count / (time.perf_counter() - start)


def one_round(directory: Path, buffers: dict) -> tuple[float, float, float]:
    """(read seconds, loop rate alone, loop rate during the read)."""
    alone = spin_rate(None)
    stop, rate = threading.Event(), []
    spinner = threading.Thread(target=lambda: rate.append(spin_rate(stop)))
    spinner.start()
    start = time.perf_counter()
    tensors, why = readahead.Staged(str(directory), buffers).take()
    seconds = time.perf_counter() - start
    stop.set()
    spinner.join()
    assert tensors is not None, why
    return seconds, alone, rate[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.9, help="the version's size (1.5B in bf16: 2.9)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}; "
          f"torch {torch.__version__}, pinned buffers: {torch.cuda.is_available()}")
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        directory = Path(tmp)
        numel = int(args.gib * 2**30) // 2 // 28
        save_file({f"layer.{i}.weight": torch.ones(numel, dtype=torch.bfloat16) for i in range(28)},
                  directory / "model.safetensors")
        size = (directory / "model.safetensors").stat().st_size
        buffers: dict = {}
        print(f"version: {size / 2**30:.2f} GiB in 28 tensors, in the page cache (just written)")
        print("| round | read s | GiB/s | loop alone (M it/s) | loop during the read | kept |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        kept = []
        for n in range(1, args.rounds + 1):
            seconds, alone, during = one_round(directory, buffers)
            kept.append(during / alone)
            print(f"| {n}{' (allocates)' if n == 1 else ''} | {seconds:.2f} | {size / 2**30 / seconds:.1f} | "
                  f"{alone / 1e6:.2f} | {during / 1e6:.2f} | {during / alone:.2f} |")
        if len(kept) > 1:
            print(f"median kept over rounds 2-{args.rounds} (buffers reused): {statistics.median(kept[1:]):.2f}")


if __name__ == "__main__":
    main()
