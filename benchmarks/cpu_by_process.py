"""CPU by program over a whole CI run (or any stretch of time): every process's CPU, read from /proc
once a second; on SIGTERM, the sums per program and the 80 costliest command lines go to OUT.

    python3 benchmarks/cpu_by_process.py OUT & sampler=$!; bash .ci/run; kill -TERM $sampler

Machine-wide: it counts whatever runs beside (the machine should be quiet). A process last seen as a
zombie has lost its command line and is counted under its bare name ("python"). Used for
benchmarks/results/cpu-2026-11-27/ci_xdist2_*_cpu_by_process.txt (2-core VM).
"""
import os, signal, sys, time, collections
tick = os.sysconf("SC_CLK_TCK"); seen = {}
KEYS = ("jobs/inference.py", "jobs/orchestrator.py", "jobs/trainer.py", "torch.distributed.run", "prl.run.node",
        "prl.run.supervise", "prl.control.cli", "bin/prl", "pytest", "xdist", "slurm", "sbatch", "srun", "squeue", "sacct",
        "scontrol", "jobs/eval.py", "munge", "vllm", "-c")
def cat(comm, cmd):
    for key in KEYS:
        if key in cmd: return key
    return comm
def scan():
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try:
            f = open(f"/proc/{pid}/stat").read(); comm = open(f"/proc/{pid}/comm").read().strip()
            cmd = open(f"/proc/{pid}/cmdline","rb").read().replace(b"\0",b" ").decode(errors="replace")
        except OSError: continue
        x = f.rsplit(")",1)[1].split()
        seen[(pid, x[19])] = ((int(x[11])+int(x[12]))/tick, cat(comm, cmd), comm + " | " + cmd[:200])
scan(); base = dict(seen)
stop = False
def end(*_):
    global stop; stop = True
signal.signal(signal.SIGTERM, end)
while not stop:
    scan(); time.sleep(1)
agg = collections.Counter(); cmds = collections.Counter()
for k, (cpu, c, full) in seen.items():
    d = cpu - base.get(k, (0,))[0]; agg[c] += d; cmds[(c, full)] += d
with open(sys.argv[1], "w") as out:
    out.write(f"total {sum(agg.values()):.1f}\n")
    for c, v in agg.most_common(40): out.write(f"{v:8.1f}  {c}\n")
    out.write("\n-- top command lines\n")
    for (c, full), v in cmds.most_common(80): out.write(f"{v:8.1f}  [{c}] {full}\n")
