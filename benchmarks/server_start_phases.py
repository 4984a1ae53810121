"""Where a vLLM server's start goes, from its log: the seconds between the lines that mark each phase
(vLLM 0.26's wording; second resolution), and with --ready-s (the time from the launch to /health,
as the benches print it) the imports before its first line.

    python benchmarks/server_start_phases.py RUN/logs/attempt_0/inference_0.out --ready-s 108.9
    python benchmarks/server_start_phases.py cold/servers0-gpu0.out warm/servers0-gpu0.out --ready-s 71.1 45.8

Several logs: one row each, every phase's end in seconds from that log's first line, side by side
(--ready-s, if given, one per log).

A data-parallel server logs from several processes: each phase is timed at its first line, the
engine's readiness at the last engine's.
"""

from __future__ import annotations

import argparse
import re
from datetime import datetime
from pathlib import Path

PHASES = [  # (key, what has happened by that line, the line, its first or last occurrence)
    ("api", "API server parsed its arguments (after its imports)", r"non-default args", "first"),
    ("config", "model config resolved (a cold cache inspects the model class in a new interpreter)",
     r"Resolved architecture", "first"),
    ("engine", "engine process started and imported vLLM", r"Initializing a V1 LLM engine", "first"),
    ("worker", "worker process started (data parallelism: spawned, imports again)", r"world_size=\d+ rank=\d+",
     "first"),
    ("weights", "weights loaded", r"Model loading took", "first"),
    ("compile", "torch.compile done (or loaded from its cache)", r"torch\.compile took", "last"),
    ("graphs", "CUDA graphs captured", r"Graph capturing finished", "last"),
    ("warm", "engine warmed up (vLLM's dummy runs after the graphs) and ready", r"init engine .* took", "last"),
    ("serving", "API serving", r"Starting vLLM server on", "last"),
]
STAMP = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d)")


def stamps(text: str, pattern: str) -> list[datetime]:
    return [datetime.strptime(m.group(1), "%m-%d %H:%M:%S") for line in text.splitlines()
            if re.search(pattern, line) and (m := STAMP.search(line))]


def phases(text: str) -> list[tuple[str, str, datetime]]:
    """(key, description, time) of each phase whose line the log has, in PHASES' order."""
    found = []
    for key, name, pattern, which in PHASES:
        if times := stamps(text, pattern):
            found.append((key, name, times[0] if which == "first" else times[-1]))
    return found


def seconds(text: str) -> dict[str, float]:
    """Each phase's end in seconds from the log's first phase line (rl_bench prints these per run)."""
    found = phases(text)
    return {key: (at - found[0][2]).total_seconds() for key, _, at in found}


def table(logs: list[Path], ready: list[float]) -> None:
    """One row per log: each phase's end from its first line, the imports before it and /health."""
    keys = [key for key, *_ in PHASES]
    print("| log | imports s | " + " | ".join(keys) + " | launch -> /health s |")
    print("| --- | ---: | " + " | ".join("---:" for _ in keys) + " | ---: |")
    for i, log in enumerate(logs):
        ends = seconds(log.read_text(errors="replace"))
        imports = f"{ready[i] - max(ends.values()):.0f}" if ready else "-"
        cells = [f"{ends[k]:.0f}" if k in ends else "-" for k in keys]
        print(f"| {log} | {imports} | " + " | ".join(cells) + f" | {ready[i] if ready else '-'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", type=Path, nargs="+")
    parser.add_argument("--ready-s", type=float, nargs="+",
                        help="launch -> /health, measured by the bench that started it; one per log")
    args = parser.parse_args()
    if args.ready_s and len(args.ready_s) != len(args.logs):
        raise SystemExit(f"--ready-s: {len(args.ready_s)} values for {len(args.logs)} logs")
    if len(args.logs) > 1:
        table(args.logs, args.ready_s or [])
        return
    log, ready = args.logs[0], args.ready_s[0] if args.ready_s else None
    found = phases(log.read_text(errors="replace"))
    if not found:
        raise SystemExit(f"{log}: no vLLM start-up line found")
    first, last = found[0][2], found[-1][2]
    print(f"{log}\n| phase | ends at s (from its first line) | took s |\n| --- | ---: | ---: |")
    if ready is not None:
        imports = ready - (last - first).total_seconds()
        print(f"| imports before the first line (launch -> first line) | - | {imports:.0f} |")
    previous = first
    for _, name, at in found:
        print(f"| {name} | {(at - first).total_seconds():.0f} | {(at - previous).total_seconds():.0f} |")
        previous = at


if __name__ == "__main__":
    main()
