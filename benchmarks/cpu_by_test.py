"""CPU by test over a whole CI run: every process's CPU, read from /proc once a second, summed by the
pytest test whose temporary directory the process (or its nearest ancestor) names in its command
line or working directory; what names none is summed by program. On SIGTERM the table goes to OUT.

    python3 benchmarks/cpu_by_test.py OUT & sampler=$!; bash .ci/run; kill -TERM $sampler

A test's processes are found by its tmp path (`.../pytest-N/popen-gwK/TEST0/...`): the runs it
launches locally or on the test cluster, their vLLM engines (forked: the parent's test) and
torchrun's ranks. The pytest workers' own CPU (in-process tests) is one line per worker, not split
by test. Machine-wide: it counts whatever runs beside it (keep the machine quiet).
"""
import collections
import os
import re
import signal
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")
TEST = re.compile(r"/pytest-\d+/(?:popen-gw\d+/)?([^/\s]+)")
procs = {}  # (pid, start) -> [cpu s, ppid, label or None, comm]


def label_of(pid: str) -> str | None:
    texts = []
    for name in ("cmdline", "cwd"):
        try:
            texts.append(os.readlink(f"/proc/{pid}/cwd") if name == "cwd" else
                         open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    for text in texts:
        if (m := TEST.search(text)) is not None:
            return re.sub(r"\d+$", "", m.group(1))
    return None


def is_pytest(pid: str) -> bool:
    try:
        return b"pytest" in open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return False


def scan(by_pid: dict[str, tuple]) -> None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = open(f"/proc/{pid}/stat").read()
            comm = open(f"/proc/{pid}/comm").read().strip()
        except OSError:
            continue
        x = stat.rsplit(")", 1)[1].split()
        key = (pid, x[19])
        cpu = (int(x[11]) + int(x[12])) / TICK
        if key not in procs:
            parent = by_pid.get(x[1])
            label = label_of(pid) or (procs[parent][2] if parent in procs else None)
            if label is None and comm.startswith("python") and is_pytest(pid):
                comm = "pytest (in-process tests)"
            procs[key] = [cpu, x[1], label, comm, cpu]  # the last: CPU when first seen
        procs[key][0] = cpu
        by_pid[pid] = key


def main(out: str) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    by_pid: dict[str, tuple] = {}
    scan(by_pid)
    for p in procs.values():  # what ran before the sampler started is not counted
        p[4] = p[0]
    t0 = time.monotonic()
    while not stop:
        scan(by_pid)
        time.sleep(1)
    tests, programs = collections.Counter(), collections.Counter()
    for cpu, _, label, comm, first in procs.values():
        (tests if label else programs)[label or comm] += cpu - first
    with open(out, "w") as f:
        f.write(f"{time.monotonic() - t0:.0f} s sampled; {sum(tests.values()) + sum(programs.values()):.1f} CPU-s in all\n")
        f.write(f"\n-- by test ({sum(tests.values()):.1f} CPU-s)\n")
        f.writelines(f"{v:8.1f}  {k}\n" for k, v in tests.most_common())
        f.write(f"\n-- by program, naming no test ({sum(programs.values()):.1f} CPU-s)\n")
        f.writelines(f"{v:8.1f}  {k}\n" for k, v in programs.most_common(40))


if __name__ == "__main__":
    main(sys.argv[1])
