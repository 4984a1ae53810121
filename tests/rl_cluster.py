"""Helpers for the RL runs on the multi-node test cluster (tests/test_slurm_rl.py, tests/test_chaos.py):
submit the toy run (vLLM on one node, torchrun across two trainer nodes, the orchestrator on a fourth),
wait for it, read its losses, find its processes.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from prl.control import slurm

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6
RL = [
    f"model.name={ROOT / '.cache/tiny-qwen2'}", "slurm.time=00:15:00", "slurm.max_requeues=2",
    "inference.nodes=1", "trainer.nodes=2", "orchestrator.placement=own_node", "orchestrator.cpus=1",
    f"run.max_steps={STEPS}", "trainer.checkpoint.interval=2", "trainer.checkpoint.keep_last=3",
]


def prl(*args, cwd):
    return subprocess.run([sys.executable, "-m", "prl.control.cli", *args], cwd=cwd, capture_output=True, text=True)


def submit(base: Path, *overrides) -> tuple[Path, str]:
    base.mkdir(parents=True, exist_ok=True)
    r = prl("submit", str(ROOT / "configs/toy.yaml"), f"run.output_dir={base}", *RL, *overrides, cwd=base)
    assert r.returncode == 0, r.stderr
    return base / "toy", re.search(r"submitted job (\d+)", r.stdout).group(1)


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.25)
    return value


def final_state(job_id, timeout=600):
    def done():
        st = slurm.job_states([job_id]).get(job_id)
        return st if st is not None and st.state not in slurm.ACTIVE else None

    return wait_for(done, timeout, f"job {job_id} to end")


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


def losses(run: Path) -> dict[int, float]:
    """Loss per step, the newest attempt's value where a step ran twice."""
    out = {}
    for n in sorted(int(p.name[8:]) for p in (run / "logs").glob("attempt_*")):
        out |= {m["step"]: m["train/loss"] for m in metrics(run, n)}
    return out


def pid_of(run: Path, attempt: int, component: str, rank: int = 0) -> int:
    log = run / f"logs/attempt_{attempt}/{component}/rank_{rank}.log"
    found = wait_for(lambda: log.exists() and re.search(r": pid (\d+) on", log.read_text()), 300, f"{log}")
    return int(found.group(1))


def job_log(run: Path, attempt: int = 0) -> str:
    return (run / f"logs/attempt_{attempt}/job.log").read_text()




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
