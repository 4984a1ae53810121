"""Per-component resources on the real test cluster (tools/slurm_cluster.sh up: partition `gpu` =
the nodes with fake GPUs, `cpu` = the last node, without; `debug` = all): het groups on different partitions
with different resources (the session's reference run, conftest.cluster_reference, is placed so:
conftest.PARTITIONS), and setup failures that end the job with status 15.

    sudo bash tools/slurm_cluster.sh up && pytest tests/cluster/test_slurm_resources.py -s
"""

import re
import subprocess

import pytest
from helpers import STEPS, final_state, het_groups, hostnames, job_log, metrics, prl, submit_probe

from prl.run import protocol

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


@pytest.mark.vllm
@pytest.mark.slow
def test_rl_run_with_het_groups_on_different_partitions(cluster_reference):
    run = cluster_reference.run
    log = job_log(run)
    assert cluster_reference.state.state == "COMPLETED", log
    assert [m["step"] for m in metrics(run, 0)] == list(range(STEPS))
    inf, tr, orch = (het_groups(log)[i] for i in range(3))
    assert (inf["Partition"], tr["Partition"], orch["Partition"]) == ("gpu", "gpu", "cpu")
    nodes = {name: hostnames(group["NodeList"]) for name, group in (("inference", inf), ("trainer", tr), ("orchestrator", orch))}
    partition = {p: set(hostnames(subprocess.run(["sinfo", "-h", "-p", p, "-o", "%N"], capture_output=True, text=True,
                                                  check=True).stdout.strip())) for p in ("gpu", "cpu")}
    (cpu_node,) = nodes["orchestrator"]
    assert cpu_node in partition["cpu"] and set(nodes["inference"] + nodes["trainer"]) <= partition["gpu"]
    # The GPU groups are exclusive (whole 4-CPU nodes); the orchestrator gets what it asked for.
    assert (inf["CPUs/Task"], inf["MinMemoryNode"], inf["TresPerNode"]) == ("2", "2G", "gres:gpu:2")
    assert (tr["CPUs/Task"], tr["MinMemoryNode"], tr["TresPerNode"]) == ("3", "3G", "gres:gpu:1")
    assert orch["TRES"].startswith("cpu=1,mem=512M,") and "TresPerNode" not in orch
    # Each component ran where its group was placed: every rank on one of its group's nodes.
    for name, hosts in nodes.items():
        ranks = sorted((run / f"logs/attempt_0/{name}").glob("rank_*.log"))
        assert ranks and all(re.search(r": pid \d+ on (\S+)", p.read_text()).group(1) in hosts for p in ranks), name
    assert f"orchestrator setup on {cpu_node}" in (run / f"logs/attempt_0/orchestrator/{cpu_node}.out").read_text()


def test_failing_setup_line_ends_the_job_with_its_status(tmp_path):
    run, job_id = submit_probe(tmp_path, "slurm.setup=[echo preparing,ls /no/such/prl/dir]")
    st = final_state(job_id, 180)
    assert st.state == "FAILED" and st.exit_code.startswith(str(protocol.EXIT_SETUP)), st
    log = job_log(run)
    assert "preparing" in log and "/no/such/prl/dir" in log
    status = prl("status", str(run))
    assert "failed:      setup failed: ls /no/such/prl/dir" in status.stdout


def test_failing_component_setup_names_the_component(tmp_path):
    run, job_id = submit_probe(tmp_path, "trainer.slurm.setup=[ls /no/such/prl/dir]")
    st = final_state(job_id, 180)
    assert st.state == "FAILED" and st.exit_code.startswith("12"), st
    assert (run / "logs/attempt_0/failed").read_text().startswith(f"trainer failed with exit status {protocol.EXIT_SETUP}")
    outs = "".join(p.read_text() for p in (run / "logs/attempt_0/trainer").glob("*.out"))
    assert "trainer setup failed: ls /no/such/prl/dir" in outs


def test_interpreter_without_prl_fails_in_slurm_out(tmp_path):
    run, job_id = submit_probe(tmp_path, "slurm.python=/bin/false")
    st = final_state(job_id, 180)
    assert st.state == "FAILED" and st.exit_code.startswith(str(protocol.EXIT_SETUP)), st
    assert not (run / "logs/attempt_0").exists()
    out = (run / f"logs/slurm-{job_id}.out").read_text()
    assert "setup failed: /bin/false -m prl.run.launches new-attempt" in out
    logs = prl("logs", str(run))
    assert f"[slurm-{job_id}] setup failed" in logs.stdout
