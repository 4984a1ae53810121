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
        "inference.data_parallel=16", "inference.port=8123", "orchestrator.batch_size=640",
    ]),
    "hostile": ("configs/toy.yaml", [
        f"run.output_dir={HOSTILE_DIR}", "run.name=toy;$(id) 'q'", "slurm.setup=[module load cuda/12.4,source '/opt/a b/activate']",
        "slurm.extra_sbatch=[--mail-type=END]", "env.HF_HOME=/shared/hf cache $x", "trainer.env.NCCL_DEBUG=INFO",
        "slurm.job_name=j'x", "model.name=/models/m",
    ]),
}


def render_case(name: str) -> str:
    from prl.config import load_config
    from prl.render import render_job
    from prl.submit import resolve

    config, overrides = CASES[name]
    cfg = resolve(load_config(ROOT / config, overrides))
    return render_job(cfg, python=PYTHON, prl_home=PRL_HOME)
