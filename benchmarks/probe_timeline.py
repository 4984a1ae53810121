"""A loop's seconds side by side: vLLM's own stats each second (VLLM_LOG_STATS_INTERVAL=1), each
GPU's use and clock, the machine's CPU and writes, and the busiest thread of each process, from what
`LOOP_PLAN=probe benchmarks/loop_session.sh` keeps (machine_sampler.sh's files and the run's logs).

    python benchmarks/probe_timeline.py benchmarks/results/h200x2-2026-11-28i probe_disk --logs loop_probe_disk-logs.tgz
    python benchmarks/probe_timeline.py OUT probe_alone    # an engine without a server (reload_bench): no stats

Prints one row per second in which vLLM logged, then the medians over the seconds in which it
generated with at least --full requests running (a batch's body, not its ramp or tail). Without
--logs, one row per second of nvidia-smi's, and the medians over the seconds the GPU was in use.
"""

from __future__ import annotations

import argparse
import gzip
import re
import statistics
import tarfile
from collections import defaultdict
from pathlib import Path

STATS = re.compile(r"pid=(\d+)\).* (\d\d:\d\d:\d\d) \[loggers.py:\d+\] Engine \d+: .*generation throughput: "
                   r"([\d.]+) tokens/s, Running: (\d+) reqs")
TOP = re.compile(r"^top - (\d\d:\d\d:\d\d)")


def engine_seconds(logs: Path) -> dict[str, tuple[float, int]]:
    """time -> (generated tok/s, requests running), summed over the servers of the newest run in the
    tgz (inference.servers_per_gpu: several servers write to one local.out, each its own pid; a work
    directory may also hold an earlier run's logs, h200x2-2026-11-28k)."""
    per_server: dict[str, dict[str, tuple[float, int]]] = defaultdict(dict)
    with tarfile.open(logs) as tar:
        outs = [m for m in tar.getmembers() if m.name.endswith("inference/local.out")]
        if not outs:
            return {}
        newest = max(outs, key=lambda m: m.mtime)
        for line in tar.extractfile(newest).read().decode(errors="replace").splitlines():
            if m := STATS.search(line):
                per_server[m[2]][m[1]] = (float(m[3]), int(m[4]))
    return {t: (sum(v[0] for v in servers.values()), sum(v[1] for v in servers.values()))
            for t, servers in per_server.items()}


def gpu_seconds(path: Path) -> dict[str, dict[str, tuple[int, int, int]]]:
    """time -> GPU index -> (power W, SM %, SM clock MHz), from `nvidia-smi dmon -s pucm -o T`."""
    out: dict[str, dict] = defaultdict(dict)
    for line in path.read_text().splitlines():
        f = line.split()
        if len(f) >= 14 and not line.startswith("#") and f[2].isdigit():
            out[f[0]][f[1]] = (int(f[2]), int(f[5]) if f[5].isdigit() else -1, int(f[12]))
    return out


def cpu_seconds(path: Path) -> dict[str, tuple[int, int, int]]:
    """time -> (user %, iowait %, blocks written), from `vmstat -t -w 1`."""
    out = {}
    for line in path.read_text().splitlines():
        f = line.split()
        if len(f) > 18 and re.fullmatch(r"\d\d:\d\d:\d\d", f[-1]) and f[0].isdigit():
            out[f[-1]] = (int(f[12]), int(f[15]), int(f[9]))
    return out


def busiest_threads(path: Path) -> dict[str, dict[str, float]]:
    """time -> thread name -> %CPU (the most of any thread of that name), from `top -H` frames
    (machine_sampler.sh's .threads, gzipped or not). Each frame covers the 2 s before it."""
    text = (gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()).decode(errors="replace")
    out: dict[str, dict[str, float]] = defaultdict(dict)
    now = None
    for line in text.splitlines():
        if m := TOP.match(line):
            now = m[1]
            continue
        f = line.split()
        if now and len(f) >= 12 and f[0].isdigit():
            name, cpu = " ".join(f[11:]), float(f[8])
            out[now][name] = max(cpu, out[now].get(name, 0.0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("prefix", help="machine_sampler.sh's prefix within DIR, e.g. probe_disk")
    parser.add_argument("--logs", help="the run's logs tgz within DIR (its server's stats each second)")
    parser.add_argument("--gpu", default="0", help="the engine's GPU index (nvidia-smi's)")
    parser.add_argument("--full", type=int, default=200, help="requests running for a second to count as a batch's body")
    args = parser.parse_args()
    gpus, cpu = gpu_seconds(args.dir / f"{args.prefix}.gpus"), cpu_seconds(args.dir / f"{args.prefix}.vmstat")
    threads_file = next(p for p in (args.dir / f"{args.prefix}.threads.gz", args.dir / f"{args.prefix}.threads") if p.exists())
    threads = busiest_threads(threads_file)
    # Without the server's stats, each second the GPU was sampled, "running" standing for its SM %.
    engine = engine_seconds(args.dir / args.logs) if args.logs else {
        t: (float("nan"), per_gpu[args.gpu][1]) for t, per_gpu in gpus.items() if args.gpu in per_gpu}
    full = args.full if args.logs else 5
    frames = sorted(threads)
    print(f"time      tok/s  running | GPU {args.gpu}: W  SM%  MHz | CPU user% iowait% blocks-out | EngineCore thread %CPU (top's frame)")
    body = []
    for t in sorted(engine):
        tok_s, running = engine[t]
        power, sm, mhz = gpus.get(t, {}).get(args.gpu, (-1, -1, -1))
        user, wait, written = cpu.get(t, (-1, -1, -1))
        frame = next((f for f in frames if f >= t), None)
        core = threads.get(frame, {}).get("VLLM::EngineCor", 0.0) if frame else float("nan")  # the busier core
        print(f"{t} {tok_s:8.0f} {running:5d}   | {power:4d} {sm:4d} {mhz:5d} | {user:4d} {wait:4d} {written:9d} | {core:5.1f}")
        if running >= full and not tok_s <= 0:
            body.append((tok_s, sm, core))
    if body:
        what = f">= {full} requests running" if args.logs else f"GPU {args.gpu} at >= {full} % SM"
        print(f"\n{len(body)} seconds with {what}: medians {statistics.median(b[0] for b in body):,.0f} tok/s, "
              f"GPU {args.gpu} SM {statistics.median(b[1] for b in body):.0f} %, the engine core's busiest thread "
              f"{statistics.median(b[2] for b in body):.0f} % of a core")


if __name__ == "__main__":
    main()
