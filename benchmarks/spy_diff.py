"""Two py-spy profiles of the same work done two ways, compared function by function, per process.

    python benchmarks/spy_diff.py plain.txt logprobs.txt [--top 25]
    python benchmarks/spy_diff.py start_profile_warm.txt --front-end-depth 1   # one profile: where its time went
    python benchmarks/spy_diff.py start_profile_warm.txt --front-end-depth 1 --process jobs/inference.py

Each file is `py-spy record --subprocesses --format raw` of one run (logprob_path_bench.py engine
--only plain / --only logprobs: the same tokens, asked without and with logprobs). A process is named
by its depth under the profiled one: 0 the front end, 1 vLLM's engine core, 2 and deeper its workers
(--front-end-depth D: the front end D processes down, as under server_start_bench.py, which starts
the server as a child; shallower processes are named by their depth). For each, the samples in which
a function was running (self) and in which it was on the stack (inclusive), in A and in B, those
that grew most first: at one sampling rate over the same work, B - A is what B's way costs there.
With A alone, its functions by samples, the most first (py-spy records 100 samples a second unless
--rate said otherwise: server_start_bench's profiles took 50).
"""

from __future__ import annotations

import argparse
import collections
import re

LINE = re.compile(r"(.*) (\d+)$")
LINE_NUMBER = re.compile(r":\d+\)")
GENERATED = re.compile(r"\b[a-z0-9]{40,}\.py")
"""Inductor's generated modules, named by a hash that differs from run to run."""
ROLES = {0: "front end", 1: "engine core"}


def function(frame: str) -> str:
    return GENERATED.sub("<generated>.py", LINE_NUMBER.sub(")", frame))


def load(path: str, front_end_depth: int = 0,
         command: str = "") -> tuple[dict[str, collections.Counter], dict[str, collections.Counter]]:
    """({process role: {function (file): inclusive samples, "": all samples}}, the same for self samples),
    of the processes whose command line contains `command` (or all)."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(path) as f:
        for raw in f:
            match = LINE.match(raw.rstrip("\n"))
            if not match:
                continue
            frames, samples = match.group(1).split(";"), int(match.group(2))
            processes = [f for f in frames if f.startswith("process ")]
            if not processes or command not in processes[-1]:
                continue
            depth = len(processes) - 1 - front_end_depth
            role = ROLES.get(depth, f"worker (depth {depth})" if depth > 0 else f"parent (depth {depth})")
            code = [function(f) for f in frames if not f.startswith("process ")]
            counts[role][""] += samples
            for name in set(code):
                counts[role][name] += samples
            if code:
                own[role][code[-1]] += samples
    return counts, own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b", nargs="?", help="left out: A's own functions, the most samples first")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--front-end-depth", type=int, default=0)
    parser.add_argument("--process", default="", help="only processes whose command line contains this")
    args = parser.parse_args()
    a, a_own = load(args.a, args.front_end_depth, args.process)
    if args.b is None:
        for role in sorted(a):
            print(f"\n== {role}: {a[role]['']} samples")
            for label, counts in (("self", a_own[role]), ("inclusive", a[role])):
                print(f"   samples   {label}")
                for name, n in counts.most_common(args.top + 1):
                    if name:
                        print(f"{n:9d}   {name[:160]}")
        return
    b, b_own = load(args.b, args.front_end_depth, args.process)
    for role in sorted(set(a) | set(b)):
        print(f"\n== {role}: {a[role]['']} samples in A, {b[role]['']} in B")
        for label, ca, cb in (("self", a_own[role], b_own[role]), ("inclusive", a[role], b[role])):
            print(f"   A        B      B-A   {label}")
            grown = sorted((f for f in set(ca) | set(cb) if f), key=lambda f: ca[f] - cb[f])
            for name in grown[: args.top]:
                print(f"{ca[name]:8d} {cb[name]:8d} {cb[name] - ca[name]:+8d}  {name[:160]}")


if __name__ == "__main__":
    main()
