"""Configs whose rendered job scripts are kept as golden files in tests/golden/.

Regenerate (only when a change to the script is intended): python tools/regen_golden.py
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOSTILE_DIR = "/shared/o u't $HOME;rm -rf x"
PYTHON = "/opt/venvs/prl env/bin/python"
PRL_HOME = "/opt/prl"

CASES: dict[str, tuple[str, list[str]]] = {
    "hetjob": ("configs/hendrycks_math.yaml", ["run.output_dir=/shared/runs", "slurm.partition=gpu", "slurm.account=rl"]),
    "homogeneous": ("configs/hendrycks_math.yaml", ["run.output_dir=/shared/runs", "slurm.hetjob=false"]),
    "trainer_node_multinode": ("configs/hendrycks_math.yaml", [
        "run.output_dir=/shared/runs", "orchestrator.placement=trainer_node", "trainer.nodes=4", "inference.nodes=2",
        "inference.data_parallel=16", "inference.port=8123", "orchestrator.batch_size=640", "run.compile_cache=false",
    ]),
    "hostile": ("configs/toy.yaml", [
        f"run.output_dir={HOSTILE_DIR}", "run.name=toy;$(id) 'q'", "slurm.setup=[module load cuda/12.4,source '/opt/a b/activate']",
        "slurm.extra_sbatch=[--mail-type=END]", "env.HF_HOME=/shared/hf cache $x", "trainer.env.NCCL_DEBUG=INFO",
        "slurm.job_name=j'x", "model.name=/models/m",
        "trainer.slurm.setup=[echo 'a;$b' >&2,false && x]", "inference.slurm.srun_args=[--container-mounts=/o u:/m $x]",
        "orchestrator.slurm.python=/o py/python'3",
    ]),
    "one_node": ("configs/one_node_8gpu.yaml", ["run.output_dir=/shared/runs", "slurm.partition=gpu"]),
    # Two inference nodes of 2 GPUs, each replica a server of its own: 4 URLs, ports 8000 and 8001 per node.
    "replica_servers": ("configs/hendrycks_math.yaml", [
        "run.output_dir=/shared/runs", "inference.nodes=2", "inference.gpus_per_node=2", "inference.data_parallel=4",
        "inference.replica_servers=true",
    ]),
    # An SFT job: the trainer alone on two GPU nodes (slurm.hetjob's default plays no part).
    "sft": ("configs/sft_toy.yaml", ["run.output_dir=/shared/runs", "slurm.partition=gpu", "trainer.nodes=2",
                                     "trainer.gpus_per_node=8", "sft.data=/shared/data/chat.parquet"]),
    # The README's cluster example with a CPU-partition orchestrator, a container for inference and
    # per-component batch options.
    "per_component": ("configs/hendrycks_math.yaml", [
        "run.output_dir=/shared/runs", "slurm.partition=gpu", "slurm.account=rl", "slurm.python=/shared/venv/bin/python",
        "orchestrator.placement=own_node", "orchestrator.slurm.partition=cpu", "orchestrator.slurm.exclusive=false",
        "orchestrator.slurm.mem=16G", "orchestrator.slurm.account=''", "trainer.slurm.time=08:00:00",
        "trainer.slurm.gpu_type=h100", "trainer.slurm.gres=nvme:1", "trainer.slurm.setup=[module load cuda/12.4]",
        "inference.slurm.qos=high", "inference.slurm.python=/usr/bin/python3",
        "inference.slurm.srun_args=[--container-image=/shared/images/vllm.sqsh,--container-mounts=/shared:/shared]",
    ]),
    # A v1 environment served by an environment server of 4 workers beside an orchestrator of its own node,
    # in one allocation split by node index: the envserver's step overlaps the orchestrator's, on its node.
    "envserver": ("configs/toy_v1.yaml", ["run.output_dir=/shared/runs", "slurm.hetjob=false",
                                          "orchestrator.placement=own_node", "orchestrator.environment.server_workers=4"]),
}


def render_launch(name: str) -> str:
    """The supervisor's srun steps of the case, with the job's variables by name."""
    from prl.config import load_config
    from prl.control.submit import resolve
    from prl.run.launch import Wiring, srun_plan

    config, overrides = CASES[name]
    cfg = resolve(load_config(ROOT / config, overrides))
    return srun_plan(cfg, Wiring.symbolic(), cfg.slurm.python or PYTHON)


def render_case(name: str) -> str:
    from prl.config import load_config
    from prl.control.render import render_job
    from prl.control.submit import resolve

    config, overrides = CASES[name]
    cfg = resolve(load_config(ROOT / config, overrides))
    return render_job(cfg, python=PYTHON, prl_home=PRL_HOME)
