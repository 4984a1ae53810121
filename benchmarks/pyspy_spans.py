"""Where a process's time went, from a py-spy chrome trace: every call that lasted at least --min
seconds in the sampled stacks, with when it started (seconds from the first sample), in time order.

    py-spy record --subprocesses -p PID -r 100 -f chrometrace -o orch.trace.json
    python benchmarks/pyspy_spans.py orch.trace.json --min 0.3  # or a .json.gz --match prl/ --match transformers/

A call's duration is the span of consecutive samples it was on the stack (py-spy's chrome trace
opens and closes a frame where consecutive stacks differ), so it is as fine as the sampling rate.
--match keeps calls whose file contains one of the strings (default: all); --max-depth cuts deep
frames (imports nest 30 deep).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def spans(events: list[dict]) -> list[tuple[float, float, int, str, str]]:
    """(start s, duration s, depth, function, file) for each frame, from the trace's B/E pairs."""
    timed = sorted((e for e in events if "ts" in e and e.get("ph") in ("B", "E")), key=lambda e: e["ts"])
    if not timed:
        return []
    origin, open_frames, out = timed[0]["ts"], defaultdict(list), []
    for e in timed:
        stack = open_frames[(e.get("pid"), e.get("tid"))]
        if e["ph"] == "B":
            stack.append((e["ts"], e.get("name", "?"), (e.get("args") or {}).get("filename", "")))
        elif stack:
            start, name, filename = stack.pop()
            out.append(((start - origin) / 1e6, (e["ts"] - start) / 1e6, len(stack), name, short(filename)))
    return sorted(out)


def short(filename: str) -> str:
    """A path from its package on: site-packages/x/y.py -> x/y.py, /repo/prl/z.py -> prl/z.py."""
    for marker in ("site-packages/", "/prl/", "/jobs/"):
        if marker in filename:
            head = "" if marker == "site-packages/" else marker.strip("/") + "/"
            return head + filename.split(marker, 1)[1]
    return filename


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--min", type=float, default=0.3, help="seconds")
    parser.add_argument("--match", action="append", default=[], help="keep calls whose file contains this")
    parser.add_argument("--max-depth", type=int, default=40)
    args = parser.parse_args()
    raw = args.trace.read_bytes()
    events = json.loads(gzip.decompress(raw) if args.trace.suffix == ".gz" else raw)
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    print("start s  dur s  depth  function  file")
    for start, duration, depth, name, filename in spans(events):
        if duration >= args.min and depth <= args.max_depth and (not args.match or any(m in filename for m in args.match)):
            print(f"{start:7.2f} {duration:6.2f} {depth:5d}  {name}  {filename}")


if __name__ == "__main__":
    main()
