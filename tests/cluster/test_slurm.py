"""Rendered jobs on the real multi-node test cluster (tools/slurm_cluster.sh up), in probe mode:
every component reports what it saw (hostname, wiring, torchrun world, reachability of the
inference servers) to logs/attempt_N/probe/*.json, and the assertions are on those reports.

    sudo bash tools/slurm_cluster.sh up && pytest tests/cluster
"""

import json
import os
import time

import pytest
from helpers import final_state, job_log, prl, squat_everywhere
from helpers import submit_probe as submit

from prl.control import slurm
from prl.run.protocol import COMPILE_CACHES, NAMES

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def wait_done(job_id: str):
    return final_state(job_id, timeout=180)


def probes(run, attempt=0):
    reports = [json.loads(p.read_text()) for p in (run / f"logs/attempt_{attempt}/probe").glob("*.json")]
    return {c: [r for r in reports if r["component"] == c] for c in NAMES}


def check_wiring(run):
    seen = probes(run)
    (inf,), (orch,) = seen["inference"], seen["orchestrator"]
    trainers = seen["trainer"]
    assert len(trainers) == 4  # 2 nodes x 2 ranks under torchrun
    trainer_hosts = sorted({t["hostname"] for t in trainers})
    assert len(trainer_hosts) == 2
    # Components on distinct nodes.
    assert len({inf["hostname"], orch["hostname"], *trainer_hosts}) == 4
    for t in trainers:
        assert t["world_size"] == 4 and t["allreduce_sum"] == 1 + 2 + 3 + 4
        assert t["env"]["MASTER_ADDR"] == trainer_hosts[0]
    rank0 = next(t for t in trainers if t["env"]["RANK"] == "0")
    assert rank0["hostname"] == trainer_hosts[0]
    for r in (inf, orch, *trainers):
        assert "DATA_PARALLEL_ADDRESS" not in r["env"]  # only for inference.multi_node=data_parallel
        assert r["env"]["PRL_INFERENCE_URLS"] == f"http://{inf['hostname']}:8000/v1"
        assert r["env"]["PRL_RUN_DIR"] == str(run)
        # run.compile_cache: what any node compiles is kept in the run for its later jobs
        assert {r["env"][v] for v in COMPILE_CACHES} == {f"{run}/cache/{name}" for name in COMPILE_CACHES.values()}
    assert (run / "cache").stat().st_mode & 0o777 == 0o700
    # The orchestrator reached the inference server across the (namespaced) network.
    assert orch["answers"] == {f"http://{inf['hostname']}:8000/v1": inf["hostname"]}
    return inf, orch, trainers


MARK = "Zq7-SECRET-xj9"
OC_ENV = ["env.PRL_AUTH=Bearer ${oc.env:SECRET_MARK}", "slurm.setup=['export PRL_FROM_SETUP=${oc.env:SECRET_MARK}']",
          "trainer.slurm.setup=['export PRL_TRAINER_SETUP=\"${oc.env:SECRET_MARK}\"']"]
"""`${oc.env:...}` inside a string, in the job's setup and in a component's: the value travels by the
job's environment alone (prl.config.envref)."""


def not_probe_report(path) -> str:
    """A file's text without the probe's own report lines (the PRL_* variables it saw, printed as JSON)."""
    lines = path.read_bytes().decode(errors="replace").splitlines()
    return "\n".join(line for line in lines if not (line.startswith("{") and '"component":' in line))


def test_hetjob_wiring(tmp_path, monkeypatch):
    t0 = time.time()
    monkeypatch.setenv("SECRET_MARK", MARK)
    run, job_id = submit(tmp_path, *OC_ENV)
    st = wait_done(job_id)
    assert st.state == "COMPLETED", job_log(run)
    inf, orch, trainers = check_wiring(run)
    for r in (inf, orch, *trainers):  # the probes record PRL_* variables: each program got the value
        assert r["env"]["PRL_AUTH"] == f"Bearer {MARK}" and r["env"]["PRL_FROM_SETUP"] == MARK
        assert r["env"].get("PRL_TRAINER_SETUP") == (MARK if r in trainers else None)
    written = [f for f in run.rglob("*") if f.is_file() and f.parent.name != "probe" and MARK in not_probe_report(f)]
    assert not written, written  # not in config.yaml, job.sbatch, job.log, the components' logs
    assert inf["env"]["SLURM_JOB_NODELIST_HET_GROUP_0"] == inf["hostname"]
    assert orch["env"]["SLURM_JOB_NODELIST_HET_GROUP_2"] == orch["hostname"]
    assert "run complete" in job_log(run)
    reported = max(p.stat().st_mtime for p in (run / "logs/attempt_0/probe").glob("*.json"))
    print(f"\nhetjob: sbatch -> every component reported its wiring: {reported - t0:.1f}s")


def test_homogeneous_fallback_wiring(tmp_path):
    """Also (issue 53): torchrun's rendezvous port, once 15000 + job id mod 5000, squatted by another
    user on every node as soon as the job id is known: the job runs, its trainer nodes meet at the
    port trainer node rank 0 picked and recorded (logs/attempt_0/rendezvous), on that node's address."""
    run, job_id = submit(tmp_path, "slurm.hetjob=false")
    squatters = squat_everywhere(15000 + int(job_id) % 5000)
    try:
        st = wait_done(job_id)
    finally:
        for p in squatters:
            p.kill()
            p.wait()
    assert st.state == "COMPLETED", job_log(run)
    inf, _, trainers = check_wiring(run)
    assert "SLURM_JOB_NODELIST_HET_GROUP_0" not in inf["env"]
    host, port = (run / "logs/attempt_0/rendezvous").read_text().strip().rsplit(":", 1)
    assert host == trainers[0]["env"]["MASTER_ADDR"] and int(port) != 15000 + int(job_id) % 5000
    assert {t["env"]["MASTER_PORT"] for t in trainers} == {port}


def test_replica_servers_give_the_orchestrator_a_url_per_replica(tmp_path):
    """inference.replica_servers with 2 replicas on the inference node: ports 8000 and 8001 there, both
    in PRL_INFERENCE_URLS, and the orchestrator on another node reaches each."""
    run, job_id = submit(tmp_path, "inference.replica_servers=true")  # PROBE: 2 GPUs, 2 replicas
    assert wait_done(job_id).state == "COMPLETED", job_log(run)
    seen = probes(run)
    (inf,), (orch,) = seen["inference"], seen["orchestrator"]
    urls = [f"http://{inf['hostname']}:{port}/v1" for port in (8000, 8001)]
    assert inf["ports"] == [8000, 8001] and orch["env"]["PRL_INFERENCE_URLS"] == ",".join(urls)
    assert orch["answers"] == {url: inf["hostname"] for url in urls} and orch["hostname"] != inf["hostname"]


def test_orchestrator_on_the_trainer_node(tmp_path):
    """...with a v1 environment served by an environment server (server_workers): the envserver's step
    overlaps the orchestrator's on that node (--overlap --mem=0 beside a step that holds the node), runs
    until the run is complete, and ends with it."""
    run, job_id = submit(tmp_path, "orchestrator.placement=trainer_node", "orchestrator.environment.api=v1",
                         "orchestrator.environment.id=prl_toy_v1", "orchestrator.environment.server_workers=1")
    assert wait_done(job_id).state == "COMPLETED", job_log(run)
    seen = probes(run)
    (orch,), (server,) = seen["orchestrator"], seen["envserver"]
    assert orch["hostname"] == orch["env"]["MASTER_ADDR"] == server["hostname"]


ONE_NODE = ["slurm.hetjob=false", "slurm.one_node=true", "inference.gpus_per_node=1", "inference.data_parallel=1",
            "trainer.nodes=1", "trainer.gpus_per_node=1", "orchestrator.placement=trainer_node"]


def test_one_node_layout_splits_the_nodes_gpus(tmp_path):
    """slurm.one_node: one allocation of one node with 1 + 1 GPUs; every component runs there, vLLM on
    the allocation's first GPU, the trainer on the second (PRL_GPU_SLICE), as each node log says."""
    run, job_id = submit(tmp_path, *ONE_NODE)
    assert wait_done(job_id).state == "COMPLETED", job_log(run)
    seen = probes(run)
    (inf,), (trainer,), (orch,) = seen["inference"], seen["trainer"], seen["orchestrator"]
    assert inf["hostname"] == trainer["hostname"] == orch["hostname"] == trainer["env"]["MASTER_ADDR"]
    assert (inf["env"]["CUDA_VISIBLE_DEVICES"], trainer["env"]["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    assert "PRL_GPU_SLICE" not in inf["env"]  # used up by prl.run.node
    host = inf["hostname"]
    for name, gpus in (("inference", "0"), ("trainer", "1")):
        out = (run / f"logs/attempt_0/{name}/{host}.out").read_text()
        assert f"{name} leader pid" in out and f"on {host}; CUDA_VISIBLE_DEVICES={gpus}" in out, out


def test_failing_component_ends_the_job_fast(tmp_path):
    run, job_id = submit(tmp_path, "trainer.env.PRL_PROBE_EXIT=3")
    t0 = time.monotonic()
    st = wait_done(job_id)
    assert time.monotonic() - t0 < 60
    assert st.state == "FAILED" and st.exit_code.startswith("12"), st
    assert (run / "logs/attempt_0/failed").read_text().startswith("trainer failed with exit status")
    status = prl("status", str(run))
    assert "failed:      trainer failed" in status.stdout


def test_usr1_checkpoints_and_requeues(tmp_path):
    run, job_id = submit(tmp_path, "trainer.env.PRL_PROBE_HOLD=120", "slurm.max_requeues=1")
    wait_ready(run)
    slurm.scancel([job_id], signal="USR1", batch=True)
    st = wait_done(job_id)
    assert st.state == "COMPLETED", job_log(run, 1) if (run / "logs/attempt_1").exists() else job_log(run)
    assert "requeueing job" in job_log(run, 0)
    assert all(t["usr1"] for t in probes(run, 0)["trainer"])
    second = probes(run, 1)
    assert {t["env"]["SLURM_RESTART_COUNT"] for t in second["trainer"]} == {"1"}
    assert os.readlink(run / "logs/latest") == "attempt_1"


def wait_ready(run, timeout=120):
    """Until every trainer probe rank has its USR1 handler in place."""
    ready = run / "logs/attempt_0/probe"
    deadline = time.monotonic() + timeout
    while len(list(ready.glob("trainer-ready-*"))) < 4:
        assert time.monotonic() < deadline, "trainer probes never became ready"
        time.sleep(0.5)


def test_dry_run_script_runs_when_sbatched_by_hand(tmp_path):
    run, _ = submit(tmp_path, extra=["--dry-run"])
    job_id = slurm.sbatch(str(run / "job.sbatch"))
    assert wait_done(job_id).state == "COMPLETED", job_log(run)
    check_wiring(run)


def test_requeue_budget_is_enforced(tmp_path):
    run, job_id = submit(tmp_path, "trainer.env.PRL_PROBE_HOLD=120", "slurm.max_requeues=0")
    wait_ready(run)
    slurm.scancel([job_id], signal="USR1", batch=True)
    st = wait_done(job_id)
    assert st.state == "FAILED" and st.exit_code.startswith("14"), st
    assert "requeue budget of 0 spent" in job_log(run)
    assert not (run / "logs/attempt_1").exists()


def test_sigterm_checkpoints_without_requeueing(tmp_path):
    """Preemption or scancel: the trainer checkpoints; SLURM (not the script) decides on a requeue."""
    run, job_id = submit(tmp_path, "trainer.env.PRL_PROBE_HOLD=120")
    wait_ready(run)
    slurm.scancel([job_id], signal="TERM", batch=True)
    st = wait_done(job_id)
    assert st.state == "COMPLETED", job_log(run)
    assert (run / "logs/attempt_0/preempted").exists()
    assert "preempted: checkpointed after SIGTERM" in job_log(run)
    assert not (run / "logs/attempt_1").exists()
