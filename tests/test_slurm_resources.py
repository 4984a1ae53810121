"""Per-component resources on the real test cluster (tools/slurm_cluster.sh up: partition `gpu` =
node1-4 with fake GPUs, `cpu` = node5 without, `debug` = all): het groups on different partitions
with different resources, and setup failures that end the job with status 15.

    sudo bash tools/slurm_cluster.sh up && pytest -m slurm tests/test_slurm_resources.py -s
"""

import re
import subprocess
import sys

import pytest
from test_slurm import submit as submit_probe
from test_slurm import wait_done
from test_slurm_rl import final_state, job_log, metrics
from test_slurm_rl import submit as submit_rl

from prl.run import protocol

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]
STEPS = 3


def het_groups(log: str) -> dict[int, dict[str, str]]:
    """HetJobOffset -> Partition, NodeList, TRES from `scontrol show job` printed into job.log."""
    groups = {}
    for record in re.split(r"(?=JobId=\d+ HetJobId=)", log)[1:]:
        fields = dict(re.findall(r"([\w/]+)=(\S*)", record.split("\n\n")[0]))
        groups[int(fields["HetJobOffset"])] = fields
    return groups


@pytest.mark.vllm
@pytest.mark.slow
def test_rl_run_with_het_groups_on_different_partitions(tmp_path):
    run, job_id = submit_rl(
        tmp_path, f"run.max_steps={STEPS}", "trainer.nodes=1",
        "inference.slurm.partition=gpu", "inference.slurm.gres=gpu:2", "inference.cpus_per_node=2",
        "inference.slurm.mem=2G",
        "trainer.slurm.partition=gpu", "trainer.slurm.gres=gpu:1", "trainer.cpus_per_node=3", "trainer.slurm.mem=3G",
        "orchestrator.slurm.partition=cpu", "orchestrator.cpus=1", "orchestrator.slurm.mem=512M",
        "orchestrator.slurm.exclusive=false",
        # Output of both kinds of setup lands in the attempt's logs: the batch script's in job.log,
        # a component's in its <node>.out.
        "slurm.setup=[scontrol show job $SLURM_JOB_ID]",
        "orchestrator.slurm.setup=[echo orchestrator setup on $(hostname)]",
    )
    st = final_state(job_id)
    log = job_log(run)
    assert st.state == "COMPLETED", log
    assert [m["step"] for m in metrics(run, 0)] == list(range(STEPS))
    inf, tr, orch = (het_groups(log)[i] for i in range(3))
    assert (inf["Partition"], tr["Partition"], orch["Partition"]) == ("gpu", "gpu", "cpu")
    assert orch["NodeList"] == "node5" and {inf["NodeList"], tr["NodeList"]} <= {f"node{i}" for i in range(1, 5)}
    # The GPU groups are exclusive (whole 4-CPU nodes); the orchestrator gets what it asked for.
    assert (inf["CPUs/Task"], inf["MinMemoryNode"], inf["TresPerNode"]) == ("2", "2G", "gres:gpu:2")
    assert (tr["CPUs/Task"], tr["MinMemoryNode"], tr["TresPerNode"]) == ("3", "3G", "gres:gpu:1")
    assert orch["TRES"].startswith("cpu=1,mem=512M,") and "TresPerNode" not in orch
    # Each component ran where its group was placed.
    for name, group in (("inference", inf), ("trainer", tr), ("orchestrator", orch)):
        rank0 = (run / f"logs/attempt_0/{name}/rank_0.log").read_text()
        assert re.search(rf"on {group['NodeList']}\b", rank0), (name, group["NodeList"])
    assert "orchestrator setup on node5" in (run / "logs/attempt_0/orchestrator/node5.out").read_text()


def test_failing_setup_line_ends_the_job_with_its_status(tmp_path):
    run, job_id = submit_probe(tmp_path, "slurm.setup=[echo preparing,ls /no/such/prl/dir]")
    st = wait_done(job_id)
    assert st.state == "FAILED" and st.exit_code.startswith(str(protocol.EXIT_SETUP)), st
    log = job_log(run)
    assert "preparing" in log and "/no/such/prl/dir" in log
    status = subprocess.run([sys.executable, "-m", "prl.control.cli", "status", str(run)], capture_output=True, text=True)
    assert "failed:      setup failed: ls /no/such/prl/dir" in status.stdout


def test_failing_component_setup_names_the_component(tmp_path):
    run, job_id = submit_probe(tmp_path, "trainer.slurm.setup=[ls /no/such/prl/dir]")
    st = wait_done(job_id)
    assert st.state == "FAILED" and st.exit_code.startswith("12"), st
    assert (run / "logs/attempt_0/failed").read_text().startswith(f"trainer failed with exit status {protocol.EXIT_SETUP}")
    outs = "".join(p.read_text() for p in (run / "logs/attempt_0/trainer").glob("*.out"))
    assert "trainer setup failed: ls /no/such/prl/dir" in outs


def test_interpreter_without_prl_fails_in_slurm_out(tmp_path):
    run, job_id = submit_probe(tmp_path, "slurm.python=/bin/false")
    st = wait_done(job_id)
    assert st.state == "FAILED" and st.exit_code.startswith(str(protocol.EXIT_SETUP)), st
    assert not (run / "logs/attempt_0").exists()
    out = (run / f"logs/slurm-{job_id}.out").read_text()
    assert "setup failed: /bin/false -m prl.run.rundir new-attempt" in out
    logs = subprocess.run([sys.executable, "-m", "prl.control.cli", "logs", str(run)], capture_output=True, text=True)
    assert f"[slurm-{job_id}] setup failed" in logs.stdout
