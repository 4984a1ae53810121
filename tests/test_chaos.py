"""Chaos on the test cluster: RL runs hit by random events at random moments must still end COMPLETED
with per-step losses bitwise equal to an uninterrupted run, and leave no process on any node.

    sudo bash tools/slurm_cluster.sh up && pytest -m slurm tests/test_chaos.py -s
    PRL_CHAOS_SEED=1234 PRL_CHAOS_RUNS=3 pytest -m slurm tests/test_chaos.py -s   # replay a failure

Events: USR1 or TERM to the batch script (time-limit warning, preemption), `scontrol requeue`, a
trainer node set DOWN, `kill -9` of a component's main process. Moments: the first second the job
runs (before the script's traps exist), while the trainer waits for its first batch, after a step,
right after the final checkpoint. After an event that ends the job (TERM, kill -9) the run is
continued with `prl resume`, first with `squeue` failing, which must refuse and change nothing.
"""

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rl_cluster import STEPS, final_state, job_log, losses, metrics, pid_of, prl, submit, wait_for, wait_no_processes

from prl.control import slurm
from prl.run.rundir import RunDir

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

KINDS = ("usr1", "term", "requeue", "node_down", "kill9")
MOMENTS = ("start", "first_batch", "mid", "after_last")
RUNS = int(os.environ.get("PRL_CHAOS_RUNS", "3"))
SEED = int(os.environ.get("PRL_CHAOS_SEED", str(int(time.time()) % 100000)))


def running(job_id: str) -> bool:
    st = slurm.job_states([job_id]).get(job_id)
    return st is not None and st.state == "RUNNING"


def reach(run: Path, job_id: str, moment: str) -> bool:
    """Wait for `moment` of the run; False if the run got past it (then the event is skipped)."""
    final = run / f"checkpoints/step_{STEPS}/COMPLETE"
    attempt = max([int(p.name[8:]) for p in (run / "logs").glob("attempt_*")], default=0)
    if moment == "start":
        return wait_for(lambda: running(job_id) or final.exists(), 300, "the job to run") and not final.exists()
    if moment == "first_batch":
        log = run / f"logs/attempt_{attempt}/trainer/rank_0.log"
        wait_for(lambda: log.exists() or final.exists(), 300, "the trainer to start")
        return not final.exists()
    if moment == "mid":
        done = len(metrics(run, attempt))
        wait_for(lambda: len(metrics(run, attempt)) > done or final.exists(), 400, "a step")
        return not final.exists()
    return bool(wait_for(final.exists, 600, "the final checkpoint"))


def strike(run: Path, job_id: str, kind: str, rng: random.Random) -> None:
    if kind in ("usr1", "term"):
        slurm.scancel([job_id], signal=kind.upper(), batch=True)
    elif kind == "requeue":
        subprocess.run(["scontrol", "requeue", job_id], capture_output=True)
    elif kind == "node_down":  # a trainer node fails: SLURM requeues the job
        hosts = wait_for(lambda: sorted(p.stem for p in (run / "logs/latest/trainer").glob("*.out")), 300, "trainer nodes")
        victim = rng.choice(hosts)
        subprocess.run(["scontrol", "update", f"NodeName={victim}", "State=DOWN", "Reason=chaos"], check=True)
        time.sleep(3)
        subprocess.run(["scontrol", "update", f"NodeName={victim}", "State=RESUME"], check=True)
    else:  # the job may be RUNNING before its first attempt directory exists
        latest = wait_for(lambda: os.path.islink(run / "logs/latest") and os.readlink(run / "logs/latest"), 300, "an attempt")
        attempt = int(latest[8:])
        component = rng.choice(["inference", "trainer", "orchestrator"])
        try:
            os.kill(pid_of(run, attempt, component), signal.SIGKILL)
        except ProcessLookupError:
            pass


def resume_refusing_unknown_first(run: Path, tmp: Path) -> str:
    """`prl resume` with squeue failing changes nothing (exit 1); then the real one."""
    bin_dir = tmp / "broken-slurm"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "squeue").write_text("#!/bin/bash\necho 'squeue: error: slurm_load_jobs error: Socket timed out' >&2\nexit 1\n")
    (bin_dir / "squeue").chmod(0o755)
    before = sorted(str(p) for p in run.rglob("*") if "logs" not in p.parts)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    r = subprocess.run([sys.executable, "-m", "prl.control.cli", "resume", str(run)], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "cannot tell" in r.stderr, r.stderr
    assert sorted(str(p) for p in run.rglob("*") if "logs" not in p.parts) == before
    r = prl("resume", str(run), cwd=run)
    assert r.returncode == 0, r.stderr
    return re.search(r"submitted job (\d+)", r.stdout).group(1)


def after_end(run: Path, job_id: str, tmp: Path, log: list[str]) -> str | None:
    """Once the job ends: None if the run is complete, else the job id of its `prl resume`."""
    st = final_state(job_id, timeout=900)
    if (run / f"checkpoints/step_{STEPS}/COMPLETE").exists() and st.state == "COMPLETED":
        return None
    log.append(f"job {job_id} ended {st.state} {st.exit_code}: prl resume")
    wait_no_processes(run)
    return resume_refusing_unknown_first(run, tmp)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run, job_id = submit(tmp_path_factory.mktemp("chaos-reference"))
    assert final_state(job_id).state == "COMPLETED", job_log(run)
    return losses(run)


@pytest.mark.parametrize("n", range(RUNS))
def test_chaos(tmp_path, uninterrupted, n):
    rng = random.Random(SEED * 100 + n)
    # In the order of their moments, so that an early event is not skipped for a late one.
    events = sorted(((rng.choice(KINDS), rng.choice(MOMENTS)) for _ in range(2)), key=lambda e: MOMENTS.index(e[1]))
    print(f"\nchaos run {n}: PRL_CHAOS_SEED={SEED}; events {events}")
    t0 = time.monotonic()
    run, job_id = submit(tmp_path)
    log: list[str] = []
    try:
        drive(run, job_id, events, rng, tmp_path, log, t0)
    finally:  # a failing run must not hold the cluster's nodes for the tests after it
        subprocess.run(["scancel", *RunDir(run).job_ids()], capture_output=True)
    wait_no_processes(run)
    print(f"chaos run {n}: {'; '.join(log)}; COMPLETED after {time.monotonic() - t0:.0f}s")
    assert losses(run) == uninterrupted, log


def drive(run: Path, job_id: str, events, rng: random.Random, tmp: Path, log: list[str], t0: float) -> None:
    """Apply the events, resuming the run where one ends its job, until the run is complete."""
    for kind, moment in events:
        if job_id is None or not reach(run, job_id, moment):
            log.append(f"{kind}@{moment}: skipped, the run was past it")
            continue
        strike(run, job_id, kind, rng)
        log.append(f"{kind}@{moment} at {time.monotonic() - t0:.0f}s")
        if kind in ("term", "kill9"):  # the job ends: continue the run
            job_id = after_end(run, job_id, tmp, log)
    for _ in range(3):
        if job_id is None:
            break
        job_id = after_end(run, job_id, tmp, log)
    assert job_id is None, f"run {run} not complete: {log}"
