"""prl as a SLURM job on real GPUs: every layout on the test cluster (tools/slurm_cluster.sh) brought up
on a GPU machine, its GRES `gpu` bound to the machine's /dev/nvidiaN and split between the nodes.

    . /tmp/prl-gpu-site/env.sh; export PYTHONPATH=$PYTHONPATH:$PWD        # vLLM 0.26 (gpu-vllm bundle)
    PRL_SLURM_DEBS=.gpu-slurm/debs PRL_SLURM_GPUS=real PRL_SLURM_NODES=4 PRL_SLURM_CPU_NODES=0 \\
        PRL_SLURM_CPUS=16 PRL_SLURM_MEM_MB=100000 bash tools/slurm_cluster.sh up      # 4 GPUs: 4 nodes of 1
    python3 -m pytest -m "gpu and slurm" tests/gpu/test_gpu_slurm.py -v

Each layout needs nodes with enough GPUs and is skipped (saying why) on a cluster that has too few:
4 nodes of 1 GPU run all but the one-node layout, which needs one node of 2 (PRL_SLURM_NODES=2 on the
same machine). Each run's node logs name the GPUs SLURM gave every component (prl.run.node), and the
test checks them against the node's own devices in gres.conf, so that two components never share a
GPU by accident: SLURM numbers a node's GPUs from 0, and on namespace nodes of one machine the
cluster's task prolog turns those into the machine's numbers (docs/slurm-test-cluster.md).
The CPU cluster runs the same layouts in CI (test_slurm.py, test_slurm_rl.py).
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from helpers import ROOT, TOY, final_state, job_log, metrics, prl, submitted_job

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu, pytest.mark.slurm, pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("slurm_cluster"),
]
STEPS = 6
GPU = [
    f"model.name={ROOT / '.cache/tiny-qwen2'}", "model.dtype=bfloat16",  # the trainer's CUDA attention: no float32
    "inference.gpus_per_node=1", "trainer.gpus_per_node=1", "run.wandb.mode=disabled",
    f"run.max_steps={STEPS}", "trainer.checkpoint.interval=2", "slurm.time=00:20:00",
]
LAYOUTS = {
    # name: (overrides, nodes needed, GPUs per node needed)
    "hetjob": ([], 2, 1),
    "two_inference_nodes": (["inference.nodes=2", "inference.data_parallel=2"], 3, 1),
    # one vLLM server over both inference nodes: node 0 the endpoint, node 1 a headless engine
    "two_inference_nodes_one_server": (["inference.nodes=2", "inference.data_parallel=2",
                                        "inference.multi_node=data_parallel", "slurm.fabric_isolated=true"], 3, 1),
    "trainer_on_two_nodes": (["trainer.nodes=2"], 3, 1),
    "one_node": (["slurm.hetjob=false", "slurm.one_node=true"], 1, 2),
}


def node_devices() -> dict[str, set[str]]:
    """Node -> the device numbers its gres.conf lines give it (/dev/nvidia[2-3] -> {"2", "3"})."""
    devices: dict[str, set[str]] = {}
    for line in Path("/etc/slurm/gres.conf").read_text().splitlines():
        m = re.match(r"NodeName=(\S+) Name=gpu File=/dev/nvidia(?:(\d+)|\[(\d+)-(\d+)\])$", line)
        if m:
            first, last = (int(m[2]), int(m[2])) if m[2] else (int(m[3]), int(m[4]))
            devices[m[1]] = {str(i) for i in range(first, last + 1)}
    return devices


def needs(nodes: int, gpus: int) -> None:
    fit = [n for n, d in node_devices().items() if len(d) >= gpus]
    if len(fit) < nodes:
        pytest.skip(f"needs {nodes} node(s) of {gpus} GPU(s); the cluster has {len(fit)} "
                    f"(tools/slurm_cluster.sh with PRL_SLURM_GPUS=real and fewer nodes)")


def gpus_used(run: Path, attempt: int = 0) -> dict[str, list[tuple[str, set[str]]]]:
    """Component -> (node, CUDA_VISIBLE_DEVICES) of each of its nodes, from prl.run.node's first line."""
    used: dict[str, list[tuple[str, set[str]]]] = {}
    for out in sorted(run.glob(f"logs/attempt_{attempt}/*/*.out")):
        m = re.search(r"leader pid \d+ on ([^\s;]+)(?:; CUDA_VISIBLE_DEVICES=(\S*))?", out.read_text())
        if m:
            used.setdefault(out.parent.name, []).append((m[1], set(filter(None, (m[2] or "").split(",")))))
    return used


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_runs_on_its_gpus(layout, tmp_path, report_at_end):
    overrides, nodes, gpus = LAYOUTS[layout]
    needs(nodes, gpus)
    t0 = time.monotonic()
    r = prl("submit", str(TOY), f"run.output_dir={tmp_path}", *GPU, *overrides, cwd=tmp_path)
    job_id, run = submitted_job(r), tmp_path / "toy"
    st = final_state(job_id, timeout=900)
    seconds = time.monotonic() - t0
    assert st.state == "COMPLETED", job_log(run)
    assert [m["step"] for m in metrics(run, 0)] == list(range(STEPS))
    used, devices = gpus_used(run), node_devices()
    lines = [f"{name}: " + ", ".join(f"{node} GPU {','.join(sorted(g))}" for node, g in where)
             for name, where in sorted(used.items())]
    report_at_end(f"GPU layout {layout}: job {job_id} COMPLETED, submit -> done {seconds:.0f}s", "\n".join(lines))
    inference, trainer = used.get("inference", []), used.get("trainer", [])
    want_inf = 2 if layout.startswith("two_inference_nodes") else 1
    want_tr = 2 if layout == "trainer_on_two_nodes" else 1
    assert len(inference) == want_inf and len(trainer) == want_tr, used
    physical = []
    for node, gpu_set in inference + trainer:
        assert len(gpu_set) == 1 and gpu_set <= devices[node], (node, gpu_set, devices)  # its node's own GPU
        physical += list(gpu_set)
    assert len(physical) == len(set(physical)), used  # no GPU given to two components or nodes
    if layout == "one_node":
        assert len({node for node, _ in inference + trainer} | {node for node, _ in used["orchestrator"]}) == 1
    # The trainer ran on CUDA on every rank: torchrun's ranks say where they ran.
    for log in run.glob("logs/attempt_0/trainer/rank_*.log"):
        assert re.search(r"rank \d+/\d+ on cuda", log.read_text()), log
    text = prl("status", str(run), cwd=run).stdout
    assert "COMPLETED" in text and f"last step:   {STEPS}" in text, text


def test_cluster_binds_the_real_gpus():
    """srun --gres=gpu:1 on each node sees that node's own /dev/nvidiaN as CUDA_VISIBLE_DEVICES."""
    devices = node_devices()
    assert devices, "no gres.conf lines for real GPUs: PRL_SLURM_GPUS=real"
    for node, own in devices.items():
        r = subprocess.run(["srun", "-w", node, "-N1", "-n1", f"--gres=gpu:{len(own)}", "bash", "-c",
                            "echo $CUDA_VISIBLE_DEVICES"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert set(r.stdout.strip().split(",")) == own, (node, r.stdout, own)
