"""What the test files share: `prl` run as a user runs it, SLURM's commands replaced at the subprocess
boundary, waiting for a condition, and jobs on the Slurm test cluster (tools/slurm_cluster.sh): the
toy RL run (vLLM on one node, torchrun across two trainer nodes, the orchestrator on a fourth) and
probe-mode jobs. The session-scoped runs built from these live in tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from prl.control import slurm
from prl.run.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "configs/toy.yaml"
SFT = ROOT / "configs/sft_toy.yaml"
SFT_STEPS = 12
NO_WANDB = "run.wandb.mode=disabled"
"""The test runs' W&B: off. Offline, as the shipped configs have it, costs a toy run 12.5 CPU-s of 87 and 7 s of
its 52 (2-core VM, 2026-12-04): wandb's import and init, and its service process. The cluster's reference
run keeps it (test_resume_step_after_completion checks its run id), tests/unit/test_wandb.py the sink."""
# One thread a rank in both modes: the same arithmetic here and on the cluster (whose nodes share
# this machine's cores), so the losses can be compared exactly.
SFT_COMMON = [NO_WANDB, f"run.max_steps={SFT_STEPS}", "trainer.checkpoint.interval=4", "trainer.env.OMP_NUM_THREADS=1",
              f"sft.data={ROOT / 'prl/envs/data/sft_toy.jsonl'}"]
T = TypeVar("T")


def prl(*args, cwd: Path | str = "/", env: dict[str, str] | None = None, path_prefix: Path | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    """`python -m prl.control.cli ARGS` in `cwd`, importing this checkout's prl (first on PYTHONPATH, before
    what the environment has there: the GPU machines' carried packages), with `env` added to the
    environment and `path_prefix` (fake SLURM commands) first on PATH."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    argv = [sys.executable, "-m", "prl.control.cli", *args]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def fake_commands(bin_dir: Path, **bodies: str) -> Path:
    """Executable bash scripts bin_dir/NAME running each body (sbatch="exit 0", squeue=...): put
    bin_dir first on PATH (prl(..., path_prefix=bin_dir)) to replace SLURM's commands."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in bodies.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def wait_for(predicate: Callable[[], T], timeout: float, what: str, poll_s: float = 0.25) -> T:
    """Poll `predicate` until it returns something true, and return that; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(poll_s)
    return value


def fake_run(parent: Path, name: str = "r", max_steps: int = 10, steps: int = 4, step_s: float = 2.0,
             last_age_s: float = 3.0, attempts: int = 2) -> RunDir:
    """A run directory as the programs leave it: config, attempts, metrics.jsonl with times."""
    rd = RunDir(parent / name)
    (rd.path / "logs").mkdir(parents=True)
    rd.config.write_text(f"run:\n  name: {name}\n  max_steps: {max_steps}\n  wandb:\n    mode: offline\n")
    rd.job_script.write_text("#!/bin/bash\n")
    now, per = time.time(), max(1, steps // attempts) if steps else 0
    for n in range(attempts):
        d = rd.logs / f"attempt_{n}/trainer"
        d.mkdir(parents=True)
        lo, hi = n * per, steps if n == attempts - 1 else (n + 1) * per
        with open(d / "metrics.jsonl", "w") as f:
            for s in range(lo, hi):
                t = now - last_age_s - (steps - 1 - s) * step_s
                f.write(json.dumps({"step": s, "time": t, "perf/step_s": step_s, "train/loss": 1.0 / (s + 1),
                                    "train/entropy": 0.5, "rollout/reward_mean": 0.1 * s}) + "\n")
    return rd


# --- jobs on the Slurm test cluster -------------------------------------------------------------

STEPS = 6
"""Steps of the toy RL run on the cluster: checkpoints 2, 4 and 6 (the final one)."""
RL = [
    # The tiny Qwen3-MoE (2 layers of 8 experts, top-2; tools/setup.sh builds it): the cluster tier's RL runs serve,
    # update, checkpoint, requeue and resume an MoE (issue 52); the data-parallel layout names the dense model.
    f"model.name={ROOT / '.cache/tiny-qwen3-moe'}", "slurm.time=00:15:00", "slurm.max_requeues=2",
    "inference.nodes=1", "trainer.nodes=2", "orchestrator.placement=own_node", "orchestrator.cpus=1",
    f"run.max_steps={STEPS}", "trainer.checkpoint.interval=2", "trainer.checkpoint.keep_last=3",
    # The test cluster's nodes share this machine's two cores: a rank per node with a thread per core
    # would oversubscribe them (one cluster run: 50 s and 82 CPU-s instead of 55 s and 92, same losses).
    "trainer.env.OMP_NUM_THREADS=1", NO_WANDB,
]
"""The toy RL run on the test cluster (submit_rl): vLLM on one node, the trainer over two, the tiny MoE."""
PROBE = [
    "run.mode=probe", "slurm.time=00:05:00", "slurm.signal_lead_s=30",
    "inference.nodes=1", "inference.gpus_per_node=2", "inference.data_parallel=2",
    "trainer.nodes=2", "trainer.gpus_per_node=2", "orchestrator.placement=own_node", "orchestrator.cpus=1",
]
"""Probe mode (jobs/probe.py): every component reports what it saw to logs/attempt_N/probe/*.json."""


def submitted_job(r: subprocess.CompletedProcess) -> str:
    """The job id `prl submit`/`prl resume` printed."""
    assert r.returncode == 0, r.stderr
    return re.search(r"submitted job (\d+)", r.stdout).group(1)


def submit_rl(base: Path, *overrides: str, env: dict[str, str] | None = None) -> tuple[Path, str]:
    """The toy RL run (RL, then `overrides`) submitted from `base` with `env` added (SBATCH_HOLD=1: the
    job waits for `scontrol release`): (run directory, job id)."""
    base.mkdir(parents=True, exist_ok=True)
    r = prl("submit", str(TOY), f"run.output_dir={base}", *RL, *overrides, cwd=base, env=env)
    return base / "toy", submitted_job(r)


def submit_probe(base: Path, *overrides: str, extra: tuple[str, ...] = ()) -> tuple[Path, str | None]:
    """A probe-mode job into a run directory whose path has a space: (run directory, job id; None
    for --dry-run)."""
    r = prl("submit", str(TOY), f"run.output_dir={base / 'runs dir'}", *PROBE, *overrides, *extra, cwd=base)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.split("submitted job ")[1].split()[0] if "submitted job" in r.stdout else None
    return base / "runs dir" / "toy", job_id


def final_state(job_id: str, timeout: float = 600) -> slurm.JobState:
    """Block until the job has left the queue; its final state. A job still there after `timeout`
    is cancelled, so that it does not hold the cluster's nodes for the tests after it. Polls once a
    second: each poll runs squeue and sacct, CPU the job under test needs on a 2-core machine."""
    def ended():
        st = slurm.job_states([job_id]).get(job_id)
        return st if st is not None and st.state not in slurm.ACTIVE else None

    try:
        return wait_for(ended, timeout, f"job {job_id} to end", poll_s=1.0)
    except AssertionError:
        subprocess.run(["scancel", job_id], capture_output=True)
        raise


def job_log(run: Path, attempt: int = 0) -> str:
    return (run / f"logs/attempt_{attempt}/job.log").read_text()


def metrics(run: Path, attempt: int) -> list[dict]:
    """Trainer rank 0's per-step records; a line still being written is not one yet."""
    path = run / f"logs/attempt_{attempt}/trainer/metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def losses_by_attempt(run: Path) -> dict[int, dict[int, float]]:
    """attempt -> {step: loss} for every attempt of the run, steps that ran twice in each of theirs."""
    attempts = sorted(int(p.name[8:]) for p in (run / "logs").glob("attempt_*"))
    return {n: {m["step"]: m["train/loss"] for m in metrics(run, n)} for n in attempts}


def losses(run: Path) -> dict[int, float]:
    """Loss per step, the newest attempt's value where a step ran twice."""
    out = {}
    for per_step in losses_by_attempt(run).values():
        out |= per_step
    return out


def pid_of(run: Path, attempt: int, component: str, rank: int = 0) -> int:
    """The pid that the component's rank log names (prl.run.node writes it first)."""
    log = run / f"logs/attempt_{attempt}/{component}/rank_{rank}.log"
    found = wait_for(lambda: log.exists() and re.search(r": pid (\d+) on", log.read_text()), 300, f"{log}")
    return int(found.group(1))


def run_processes(run: Path) -> list[tuple[int, str]]:
    """Every process on this machine (every test-cluster node shares its PID space) whose environment
    names this run directory: what the run left behind once its job ended."""
    found = []
    needle = f"PRL_RUN_DIR={run}".encode()
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in env.read_bytes().split(b"\0"):
                found.append((int(env.parent.name), (env.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]))
        except OSError:
            continue
    return found


def wait_no_processes(run: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while left := run_processes(run):
        assert time.monotonic() < deadline, f"processes of {run} still running {timeout}s after its job: {left}"
        time.sleep(0.5)


def het_groups(log: str) -> dict[int, dict[str, str]]:
    """HetJobOffset -> Partition, NodeList, TRES... from `scontrol show job` output (a job's own
    job.log with slurm.setup=[scontrol show job $SLURM_JOB_ID], or asked live)."""
    groups = {}
    for record in re.split(r"(?=JobId=\d+ HetJobId=)", log)[1:]:
        fields = dict(re.findall(r"([\w/]+)=(\S*)", record.split("\n\n")[0]))
        groups[int(fields["HetJobOffset"])] = fields
    return groups


def hostnames(nodelist: str) -> list[str]:
    """node[1-2],node5 -> [node1, node2, node5] (scontrol show hostnames)."""
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                          check=True).stdout.split()


def tiny_model_dir(family: str = "qwen2") -> Path:
    """tools/make_tiny_model.py's model of `family` in .cache (tools/setup.sh builds qwen2 and qwen3)."""
    path = ROOT / f".cache/tiny-{family.replace('_', '-')}"
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "tools/make_tiny_model.py"), "--family", family, "--out", str(path)],
                       check=True)
    return path


SQUAT = """
import socket, sys, time
s = socket.socket()
try:
    s.bind(("0.0.0.0", int(sys.argv[1])))
    s.listen(1)
    print("held", flush=True)
except OSError as e:
    print("not held:", e, flush=True)
time.sleep(600)
"""


def squat_everywhere(port: int) -> list[subprocess.Popen]:
    """Another user (uid 65534) listening at `port` on every node of the cluster, as one who knows
    the old scheme (15000 + job id mod 5000) and the job id (squeue shows it) could."""
    procs = [subprocess.Popen(["nsenter", f"--net={ns}", "--", "setpriv", "--reuid=65534", "--regid=65534",
                               "--clear-groups", "/usr/bin/python3", "-c", SQUAT, str(port)],
                              stdout=subprocess.PIPE, text=True) for ns in sorted(Path("/run/netns").glob("prl-node*"))]
    assert [p.stdout.readline().strip() for p in procs] == ["held"] * len(procs)
    return procs


DELETER = """
import sys, time
from prl.run import broadcast_store as bs
# The issue-53 attacker, made stronger: every want/V and go/V deleted as soon as a listing shows it, for
# as long as the test lets it run. It needs no secret, only the store's address (a scan finds it). (A
# have/V deleted so sends its version by file: test_a_full_sender_drops_its_oldest_version_unsent...)
raw = bs.store(sys.argv[1], int(sys.argv[2]), host_it=False, timeout_s=30)
print("connected", flush=True)
deleted = 0
while True:
    for k in raw.list_keys():
        if any(f"/{kind}/" in k for kind in ("want", "go")):
            deleted += raw.delete_key(k)
            print("deleted", deleted, flush=True)
"""
"""`python -c DELETER HOST PORT`: deletes the weight broadcast's want/V and go/V keys as they appear."""
