"""The real RL run as one SLURM job on the multi-node test cluster: vLLM (CPU) on one node, torchrun
across two trainer nodes (gloo), the orchestrator on a fourth (the session's reference run,
conftest.cluster_reference); the other layout (no hetjob, one vLLM server over two inference nodes,
weights by broadcast) preempted and requeued; the one-node layout requeued without warning;
failures and resume.

    sudo bash tools/slurm_cluster.sh up && pytest tests/cluster/test_slurm_rl.py -s
"""

import json
import math
import os
import pickle
import re
import signal
import socket
import stat
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (DELETER, STEPS, final_state, job_log, losses, losses_by_attempt, metrics, pid_of, prl,
                     squat_everywhere, tiny_model_dir, submit_rl, submitted_job, wait_for, wait_no_processes)

from prl.control import slurm
from prl.run import secret

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]


def test_complete_run_hetjob(cluster_reference):
    run, st = cluster_reference.run, cluster_reference.state
    print(f"\nreference hetjob run: {STEPS} steps, submit -> COMPLETED in {cluster_reference.seconds:.0f}s")
    assert st.state == "COMPLETED", job_log(run)
    steps = metrics(run, 0)
    assert [m["step"] for m in steps] == list(range(STEPS))
    assert all(math.isfinite(m["train/loss"]) for m in steps)
    assert (run / f"weights/step_{STEPS}/COMPLETE").exists()
    assert (run / f"checkpoints/step_{STEPS}/COMPLETE").exists()
    # two trainer nodes: one rank file each, each written on its own node
    hosts = {re.search(r"on (\S+)", (run / f"logs/attempt_0/trainer/rank_{r}.log").read_text()).group(1) for r in (0, 1)}
    assert len(hosts) == 2
    status = prl("status", str(run), cwd=run).stdout
    assert "COMPLETED" in status and f"last step:   {STEPS}" in status and "reward:" in status


def test_the_runs_secret_is_nowhere_else_and_its_server_listens_on_its_node_only(cluster_reference):
    """What another user of the cluster could use: the run directory and all in it are its owner's
    alone; the run's secret is in RUN/secret (0600) and in no log, script, record or checkpoint of the
    run; vLLM listened on its node's own address (the one PRL_INFERENCE_URLS names), not on every
    interface. The job took the run over (RUN/writer) and its COMPLETE markers name it."""
    run = cluster_reference.run
    assert run.stat().st_mode & 0o077 == 0, oct(run.stat().st_mode)  # nobody else gets in
    # ... nor into anything in it, made by submit, SLURM or the job's tasks on four nodes (the job's umask)
    loose = [f"{p} {stat.filemode(p.lstat().st_mode)}" for p in [run, *run.rglob("*")]
             if not p.is_symlink() and p.lstat().st_mode & 0o077]
    assert not loose, loose[:20]
    # The job took the run over, and its trainer's COMPLETE markers name it (prl.run.fence).
    writer = (run / "writer").read_text()
    assert writer.startswith(f"job={cluster_reference.job_id} restart=0 attempt=0 nonce="), writer
    for done in (f"checkpoints/step_{STEPS}/COMPLETE", f"weights/step_{STEPS}/COMPLETE"):
        assert (run / done).read_text() == writer, done
    key = secret.read(run).encode()
    leaks = [f for f in run.rglob("*") if f.is_file() and f.name != secret.NAME and key in f.read_bytes()]
    assert not leaks, leaks
    log = (run / "logs/attempt_0/inference/rank_0.log").read_text()
    node, host = re.search(r": pid \d+ on (\S+)", log).group(1), re.search(r"vllm serve .* --host (\S+)", log).group(1)
    assert host == socket.gethostbyname(node) and not host.startswith("127."), (node, host)


def test_prl_eval_job_array_on_saved_weights(cluster_reference):
    """`prl eval --steps 4,6`: one submitit array of two tasks, each serving its version with its own vLLM."""
    run = cluster_reference.run
    t0 = time.time()
    r = prl("eval", str(run), "--steps", "4,6", cwd=run)
    assert r.returncode == 0, r.stderr
    job_id = re.search(r"submitted job array (\d+)", r.stdout).group(1)

    def ended() -> bool:
        queued = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
        return queued.returncode == 0 and not queued.stdout.strip()

    wait_for(ended, 600, f"eval array {job_id} to end")
    outs = {p.name: p.read_text() for p in (run / "evals/logs/submitit").glob(f"{job_id}_*_log.out")}
    assert sorted(outs) == [f"{job_id}_0_0_log.out", f"{job_id}_1_0_log.out"]
    for task in (0, 1):  # submitit's record of each call: it returned (jobs/eval.py exited 0)
        with open(run / f"evals/logs/submitit/{job_id}_{task}_0_result.pkl", "rb") as f:
            assert pickle.load(f)[0] == "success", "\n".join(outs.values())
    for step in (4, 6):
        path = run / f"evals/step_{step}.json"
        assert path.exists(), "\n".join(outs.values())
        record = json.loads(path.read_text())
        assert record["source"] == "prl eval" and record["weights"] == str(run / f"weights/step_{step}")
        assert record["rollouts"] == 64 and 0.0 <= record["reward_mean"] <= 1.0
    print(f"\nprl eval array of 2 tasks: submit -> both records in {time.time() - t0:.0f}s")
    assert "evals:       step 4 reward" in prl("status", str(run), cwd=run).stdout


DATA_PARALLEL = ("inference.nodes=2", "inference.data_parallel=2", "inference.multi_node=data_parallel",
                 "slurm.fabric_isolated=true")  # vLLM's sockets take anyone: the test cluster is this machine's alone
"""One vLLM server over two inference nodes (vLLM's data parallelism): node 0 the endpoint and engine 0,
node 1 engine 1 headless."""


def check_data_parallel(run: Path, attempt: int = 0) -> None:
    """The two inference nodes were one server: one URL, node 1 headless and joined to node 0, and
    both engines took part in every weight update (vLLM pauses and resumes each engine around it)."""
    logs = run / f"logs/attempt_{attempt}/inference"
    head, other = ((logs / f"rank_{r}.log").read_text() for r in (0, 1))
    nodes = [re.search(r"inference node \d+ on (\S+),", text).group(1) for text in (head, other)]
    assert "--headless" not in head and "--data-parallel-size 2 --data-parallel-size-local 1" in head
    assert "--headless --data-parallel-start-rank 1" in other, other[-2000:]
    assert re.findall(r"^PRL_INFERENCE_URLS=(\S+)$", job_log(run, attempt), re.M) == [f"http://{nodes[0]}:8000/v1"]
    engine1 = (logs / f"{nodes[1]}.out").read_text()
    assert f"headless mode, with head node address tcp://{nodes[0]}:" in engine1, engine1[-2000:]
    # Every update reached the headless engine. An attempt stopped at step 1 loaded none (batch 1 is
    # sampled with version 0 at async_level 1): nothing to reach it then.
    loads = re.findall(r"servers now at policy version \d+ by", (run / f"logs/attempt_{attempt}/orchestrator/rank_0.log").read_text())
    assert engine1.count("Successfully reset prefix cache") >= (len(loads) > 0), (loads, engine1[-2000:])


ATTACK = """
import sys, urllib.request, urllib.error
base = sys.argv[1]
for method, path, key in (("GET", "/health", None), ("GET", "/v1/models", None), ("GET", "/metrics", None),
                          ("POST", "/update_weights", "guessed"), ("POST", "/invocations", None)):
    request = urllib.request.Request(base + path, method=method, data=b"{}" if method == "POST" else None,
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        status = urllib.request.urlopen(request, timeout=10).status
    except urllib.error.HTTPError as e:
        status = e.code
    print(method, path, status)
"""


def attack_from_another_node(run: Path) -> None:
    """Another user (uid 65534) on another node of the cluster, while the run is live: the server
    answers /health and refuses everything else without the run's secret."""
    log = (run / "logs/attempt_0/inference/rank_0.log").read_text()
    node = re.search(r"inference node 0 on (\S+),", log).group(1)
    other = next(ns for ns in sorted(Path("/run/netns").glob("prl-node*")) if ns.name != f"prl-{node}")
    r = subprocess.run(["nsenter", f"--net={other}", "--", "setpriv", "--reuid=65534", "--regid=65534",
                        "--clear-groups", "/usr/bin/python3", "-c", ATTACK, f"http://{socket.gethostbyname(node)}:8000"],
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.split("\n")[:-1] == ["GET /health 200", "GET /v1/models 401", "GET /metrics 401",
                                         "POST /update_weights 401", "POST /invocations 401"], (r.stdout, r.stderr)


def test_preemption_checkpoints_requeues_and_resumes(tmp_path, dense_reference_record):
    """USR1 to the batch script: the trainer checkpoints at the next step boundary and the job requeues
    itself; the next attempt (same job id) resumes from that checkpoint with nothing lost, and the
    losses equal the dense reference run's (het groups, one server, files) exactly.
    The run is the other layout: slurm.hetjob=false (one allocation split by node index), its two
    inference nodes one vLLM server (inference.multi_node=data_parallel, check_data_parallel), weights
    by broadcast to both nodes' workers: the same bytes reach vLLM either way, and the batches do not
    depend on which engine served which request. Attempt 0's server is attacked from another node by
    another user (attack_from_another_node). The requeued trainer hosts its store again (on a port of
    its own, recorded in the new attempt), and every version it computes after the resume reaches vLLM
    by broadcast, none by a fallback to files (check_broadcast_after_resume).
    Under issue 53's attacks at once, by another user (uid 65534) from the moment the job id is known: the
    old rendezvous port squatted on every node, /tmp/prl-JOB planted, attempt 0's broadcast store's
    want/V and go/V keys deleted as they appear (from another node), its server probed without the key."""
    run, job_id = submit_rl(tmp_path, f"model.name={tiny_model_dir()}", "slurm.hetjob=false",
                            "inference.weight_transfer=broadcast", *DATA_PARALLEL, env={"SBATCH_HOLD": "1"})
    # Held until the attacks are in place: a job that starts at once makes /tmp/prl-JOB itself first.
    attackers = squat_everywhere(15000 + int(job_id) % 5000)
    planted = Path(f"/tmp/prl-{job_id}")
    shutil.rmtree(planted, ignore_errors=True)  # an earlier test cluster's job of this id (held: not this one's)
    try:
        subprocess.run([*STRANGER, "mkdir", "-m", "777", str(planted)], check=True)
        subprocess.run(["scontrol", "release", job_id], check=True)
        # From the moment the store is recorded: the deleter sees every version's keys from version 1 on.
        wait_for(lambda: (run / "logs/attempt_0/weights_store").exists(), 400, "the trainer's store")
        attackers.append(delete_control_keys(run))
        wait_for(lambda: (run / "rollouts/step_0.pt").exists(), 400, "the first batch")
        attack_from_another_node(run)
        preempt_and_resume(run, job_id, dense_reference_record)
        assert not any(planted.iterdir()), list(planted.iterdir())  # the job made a scratch of its own
    finally:
        for p in attackers:
            p.kill()
        deleted = attackers[-1].communicate()[0]
        shutil.rmtree(planted, ignore_errors=True)
    # It did delete (it had no permission to lack). Whether a writer saw a key gone before its reader took
    # it (and logged tampering) is a race: tests/integration/test_broadcast.py pins that log.
    assert "deleted" in deleted, deleted


STRANGER = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def delete_control_keys(run: Path) -> subprocess.Popen:
    """Another user on a node that is not the trainer's, deleting attempt 0's want/V and go/V keys."""
    host, port = (run / "logs/attempt_0/weights_store").read_text().strip().rsplit(":", 1)
    other = next(ns for ns in sorted(Path("/run/netns").glob("prl-node*")) if ns.name != f"prl-{host}")
    deleter = subprocess.Popen(["nsenter", f"--net={other}", "--", *STRANGER, sys.executable, "-c", DELETER,
                                socket.gethostbyname(host), port], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    said = [deleter.stdout.readline()]  # c10d may warn first (no name for the client's address)
    while said[-1] not in ("connected\n", ""):
        said.append(deleter.stdout.readline())
    assert said[-1] == "connected\n", said
    return deleter


def preempt_and_resume(run: Path, job_id: str, reference_record) -> None:
    # After the first step, not later: the stop then lands at step 1 or 2, and the resumed attempt
    # must still compute versions that the orchestrator needs (check_broadcast_after_resume).
    wait_for(lambda: metrics(run, 0), 400, "the first trainer step")
    t_signal = time.time()
    slurm.scancel([job_id], signal="USR1", batch=True)
    marker = wait_for(lambda: (run / "logs/attempt_0/preempted").exists(), 120, "the trainer's checkpoint")
    t_ckpt = time.time()
    wait_for(lambda: (run / "logs/attempt_1/job.log").exists(), 180, "the requeued job to start")
    t_running = time.time()
    wait_for(lambda: metrics(run, 1), 400, "the first step after the requeue")
    t_step = time.time()
    st = final_state(job_id)
    assert marker and st.state == "COMPLETED", job_log(run, 1)
    assert "requeueing job" in job_log(run, 0)
    done_before = [m["step"] for m in metrics(run, 0)]
    resumed = [m["step"] for m in metrics(run, 1)]
    ckpt_step = resumed[0]
    assert ckpt_step == done_before[-1] + 1, "the checkpoint is taken at the step boundary: nothing lost"
    assert resumed == list(range(ckpt_step, STEPS))
    print(f"\npreemption: signal -> checkpoint complete {t_ckpt - t_signal:.1f}s, -> job running again "
          f"{t_running - t_signal:.1f}s, -> first new step {t_step - t_signal:.1f}s; steps lost: "
          f"{done_before[-1] + 1 - ckpt_step}; resumed at step {ckpt_step}")
    # Exact resume: the per-step losses equal the uninterrupted run's (by file; this one by broadcast).
    assert losses(run) == reference_record.losses
    # Each attempt took the run over (prl.run.fence); every COMPLETE names the attempt that wrote it.
    writers = [(run / f"logs/attempt_{n}/writer").read_text() for n in (0, 1)]
    assert [w.split(" nonce=")[0] for w in writers] == [f"job={job_id} restart={n} attempt={n}" for n in (0, 1)]
    assert (run / "writer").read_text() == writers[1]
    marks = {int(c.parent.name[5:]): c.read_text() for c in run.glob("checkpoints/step_*/COMPLETE")}
    assert STEPS in marks and marks == {n: writers[n > ckpt_step] for n in marks}, (ckpt_step, marks)
    for attempt in (0, 1):
        check_data_parallel(run, attempt)
    hosts = check_broadcast_after_resume(run, ckpt_step, workers=2)
    print(f"weights by broadcast from trainer rank 0 on {hosts[0]}, after the requeue on {hosts[1]}")


def check_broadcast_after_resume(run, ckpt_step: int, workers: int) -> list[str]:
    """Attempts 0 and 1 of a broadcast run requeued at step boundary C = ckpt_step, its `workers` vLLM
    workers on nodes other than the trainer's: each trainer rank 0 hosted its store on a port of its
    own, recorded in its attempt (the requeued one's workers and orchestrator read the new record, not
    the old); attempt 0 loaded every version before C by broadcast, and attempt 1 every version it
    computed. Returns trainer rank 0's node in each attempt."""
    names = ("trainer", "inference", "orchestrator")
    logs = [{name: (run / f"logs/attempt_{n}/{name}/rank_0.log").read_text() for name in names} for n in (0, 1)]
    hosts = [re.search(r": pid \d+ on (\S+)", log["trainer"]).group(1) for log in logs]
    for n, log in enumerate(logs):
        wiring = dict(re.findall(r"^(MASTER_ADDR)=(\S+)$", job_log(run, n), re.M))
        assert wiring == {"MASTER_ADDR": hosts[n]}, wiring
        assert hosts[n] != re.search(r": pid \d+ on (\S+)", log["inference"]).group(1)  # namespaces of their own
        recorded = (run / f"logs/attempt_{n}/weights_store").read_text().strip()
        assert recorded.startswith(f"{hosts[n]}:")
        assert f"weight broadcast: store at {recorded}, {workers} inference workers, gloo" in log["trainer"]
        assert "still busy at exit" not in log["trainer"]
        # No worker found a version unlike its tag ("weight broadcast: version V does not match").
        assert not any("weight broadcast" in out.read_text() for out in (run / f"logs/attempt_{n}/inference").glob("*"))
    # Attempt 0: the trainer sent every version before C (version 0 is what vLLM started with), and
    # every one of them that the orchestrator loaded before the stop came by broadcast. Version C is
    # exported as the trainer stops: the orchestrator may find the broadcast gone and take the file.
    sent0 = {int(v) for v in re.findall(r"version (\d+) broadcast: ", logs[0]["trainer"])}
    assert set(range(1, ckpt_step)) <= sent0, sent0
    loads0 = re.findall(r"batch (\d+): servers now at policy version (\d+) by (\w+)", logs[0]["orchestrator"])
    assert all(how == "broadcast" for _, v, how in loads0 if int(v) < ckpt_step), loads0
    # Attempt 1 generates batches C..STEPS-1 with versions C-1..STEPS-2 (async_level 1; version 0 is
    # what vLLM starts with: no load). Versions up to C are files of attempt 0 (C-1 kept for this
    # resume, C written before the checkpoint; publish_resumed_version rewrites C only if it is missing
    # and never offers it to the sender), and the resumed trainer holds neither: its sender starts
    # after the resume and stages only the versions it computes. So the orchestrator finds C-1 and C
    # complete on disk with have/V unset: by file, by design (Policy.load). Every version from C+1 on
    # is staged before its file is written: by broadcast.
    assert ckpt_step <= STEPS - 3, f"stopped at step {ckpt_step}: no version left to broadcast after the resume"
    loads = [(str(b), str(b - 1), "file" if b - 1 <= ckpt_step else "broadcast") for b in range(max(ckpt_step, 2), STEPS)]
    assert re.findall(r"batch (\d+): servers now at policy version (\d+) by (\w+)", logs[1]["orchestrator"]) == loads, \
        logs[1]["orchestrator"]
    sent = [v for _, v, how in loads if how == "broadcast"]
    # The sender's only "weight broadcast" line is its store: no "... of version V failed", no "... still busy".
    assert re.findall(r"weight broadcast\b.*", logs[1]["trainer"]) == [
        f"weight broadcast: store at {(run / 'logs/attempt_1/weights_store').read_text().strip()}, {workers} inference workers, gloo"]
    assert re.findall(r"version (\d+) broadcast: ", logs[1]["trainer"]) == sent
    assert re.findall(r"weights updated version (\d+) by broadcast", logs[1]["inference"]) == sent
    assert "weight broadcast" not in logs[1]["orchestrator"]  # neither "... failed" nor "... store unreachable"
    return hosts


def test_one_node_layout_requeue_without_warning(tmp_path, reference_record):
    """slurm.one_node: the real run with every component on one node of one allocation (vLLM and two
    trainer ranks, the node's two GPUs the trainer's). An admin's `scontrol requeue` (or a node failure)
    after checkpoint 2: no USR1; the next launch continues from the newest complete checkpoint.
    Every attempt's losses match the uninterrupted reference run's (two ranks on two nodes: the same
    global batch, the same reduction), and `prl status` and `prl logs` show the run as in the other
    layouts. (A kill -9 while a checkpoint is written, then `prl resume` from the one before: the
    full-disk test of tests/integration/test_trainer_run.py and test_chaos.py's kill9 events; left
    out of this test for CI's budget.)"""
    run, job_id = submit_rl(tmp_path, "slurm.hetjob=false", "slurm.one_node=true", "trainer.nodes=1",
                            "trainer.gpus_per_node=2", "orchestrator.placement=trainer_node")
    wait_for(lambda: (run / "checkpoints/step_2/COMPLETE").exists(), 400, "checkpoint 2")
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    wait_for(lambda: (run / "logs/attempt_1/job.log").exists(), 180, "the requeued job to start")
    first, resumed = [m["step"] for m in metrics(run, 0)], wait_for(lambda: metrics(run, 1), 400, "a step after the requeue")
    assert 2 <= resumed[0]["step"] <= len(first) < 4, (first, resumed)  # TERM may add a checkpoint (3)
    st = final_state(job_id)
    assert st.state == "COMPLETED", job_log(run, 1)
    assert [m["step"] for m in metrics(run, 1)] == list(range(resumed[0]["step"], STEPS))
    for attempt, per_step in losses_by_attempt(run).items():  # every attempt's, not only the newest
        assert per_step == {s: reference_record.losses[s] for s in per_step}, attempt
    assert losses(run) == reference_record.losses
    for attempt in (0, 1):
        hosts = {re.search(r"on (\S+)", (run / f"logs/attempt_{attempt}/{name}/rank_0.log").read_text()).group(1)
                 for name in ("inference", "trainer", "orchestrator")}
        assert len(hosts) == 1, hosts
    status = prl("status", str(run), cwd=run).stdout
    assert "COMPLETED" in status and f"last step:   {STEPS}" in status
    logs = prl("logs", str(run), "-c", "trainer", "-n", "5", cwd=run)
    assert logs.returncode == 0 and f"| step {STEPS - 1} | loss" in logs.stdout, logs.stdout[-2000:]


@pytest.mark.parametrize("component,code", [("inference", 11)])
def test_kill_9_of_a_component_ends_the_job_and_leaves_nothing(tmp_path, component, code):
    """kill -9 of vLLM's API server, whose engine core process then loses its parent: the job ends naming
    the component, and no process of the run survives on any node. (The orchestrator's kill -9, a process
    without children of its own here, left CI for its budget: a component's failure ending the job fast and
    naming it is test_slurm.py's test_failing_component_ends_the_job_fast.)"""
    run, job_id = submit_rl(tmp_path, "run.max_steps=40", "trainer.nodes=1")
    pid = pid_of(run, 0, component)
    wait_for(lambda: (run / "rollouts/step_0.pt").exists(), 400, "the first batch")
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    st = final_state(job_id)
    ended = time.monotonic() - t0
    wait_no_processes(run)
    print(f"\nkill -9 {component} -> job ended in {ended:.1f}s, no process left after {time.monotonic() - t0:.1f}s")
    assert ended < 60
    assert st.state == "FAILED" and st.exit_code.startswith(str(code)), st
    assert f"failed:      {component} failed" in prl("status", str(run), cwd=run).stdout


def test_resume_step_after_completion(cluster_reference):
    run = cluster_reference.run
    run_id = (run / "wandb_id").read_text()
    first = {m["step"]: m["train/loss"] for m in metrics(run, 0)}
    r = prl("resume", "--step", "2", "--dry-run", cwd=run)
    assert r.returncode == 0 and "would archive" in r.stdout and f"checkpoints/step_{STEPS}" in r.stdout
    r = prl("resume", "--step", "2", cwd=run)  # bare, from inside the run directory
    job_id = submitted_job(r)
    assert not (run / "weights/step_3").exists() and not (run / "rollouts/step_2.pt").exists()
    assert final_state(job_id).state == "COMPLETED", job_log(run, 1)
    assert [m["step"] for m in metrics(run, 1)] == list(range(2, STEPS))
    assert {m["step"]: m["train/loss"] for m in metrics(run, 1)} == {s: first[s] for s in range(2, STEPS)}
    assert (run / "wandb_id").read_text() == run_id
    assert (run / f"checkpoints/step_{STEPS}/COMPLETE").exists()
