"""Rendered job scripts: golden files, shell syntax, quoting of hostile values, layout per config."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from render_cases import CASES, EVAL_CASES, HOSTILE_DIR, ROOT, render_case, render_eval_case  # noqa: E402

from prl.config import ConfigError, load_config  # noqa: E402
from prl.render import render_eval_array, render_job, sbatch_groups  # noqa: E402
from prl.submit import resolve  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "golden"


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_golden_file(name):
    expected = (GOLDEN / f"{name}.sbatch").read_text()
    assert render_case(name) == expected, f"regenerate with tools/regen_golden.py if intended ({name})"


@pytest.mark.parametrize("name", sorted(CASES))
def test_is_valid_bash(name):
    result = subprocess.run(["bash", "-n"], input=render_case(name), text=True, capture_output=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", sorted(EVAL_CASES))
def test_eval_array_matches_golden_file_and_parses(name):
    text = render_eval_case(name)
    assert text == (GOLDEN / f"{name}.sbatch").read_text(), f"regenerate with tools/regen_golden.py if intended ({name})"
    result = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert result.returncode == 0, result.stderr


def test_eval_array_task_picks_its_step_and_keeps_hostile_values():
    """The script's variables in bash, as array task 1 sees them: its step, the run dir byte for byte."""
    text = render_eval_case("eval_hostile")
    head = text[: text.index("# slurm.setup")]
    script = head.replace("set -euo pipefail", "") + 'printf "%s\\n" "$PRL_RUN_DIR" "$PRL_EVAL_STEP"'
    out = subprocess.run(["bash", "-c", script], text=True, capture_output=True, check=True,
                         env={"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_JOB_ID": "7", "PATH": "/usr/bin:/bin"}).stdout
    assert out.splitlines()[-2:] == [f"{HOSTILE_DIR}/toy;$(id) 'q'", "10"]
    assert "#SBATCH --array=0-1\n" in text and "export HF_HOME='/shared/hf cache $x'" in text


def test_eval_array_takes_the_inference_groups_resources_and_setup():
    cfg = resolve(load_config(ROOT / "configs/hendrycks_math.yaml", [
        "inference.nodes=2", "inference.data_parallel=16", "inference.slurm.partition=big", "slurm.partition=gpu",
        "inference.slurm.setup=[module load vllm]", "trainer.slurm.gres=nvme:1"]))
    text = render_eval_array(cfg, [5], python="/p", prl_home="/h")
    assert "#SBATCH --array=0-0\n" in text and "#SBATCH --nodes=1\n" in text  # one node per version
    assert "#SBATCH --partition=big\n" in text and "#SBATCH --gpus-per-node=8\n" in text and "nvme" not in text
    assert "STEPS=(5)" in text and "eval \"$line\"" in text and text.rstrip().endswith("eval 'module load vllm'")


def test_hostile_values_survive_the_shell():
    """Run the script's variable block in bash: the values come back byte for byte."""
    text = render_case("hostile")
    head = text[: text.index("module load")]
    script = "\n".join(line for line in head.splitlines() if line.startswith("export ")) + '\nprintf "%s\\n" "$PRL_RUN_DIR" "$PRL_PYTHON"'
    out = subprocess.run(["bash", "-c", script], text=True, capture_output=True, check=True).stdout.splitlines()
    assert out == [f"{HOSTILE_DIR}/toy;$(id) 'q'", "/opt/venvs/prl env/bin/python"]
    assert "export HF_HOME='/shared/hf cache $x'" in text


def test_hetjob_groups_follow_the_config():
    cfg = resolve(load_config(ROOT / "configs/hendrycks_math.yaml", ["trainer.nodes=4", "inference.nodes=2", "orchestrator.placement=own_node",
                                                                      "inference.data_parallel=16", "orchestrator.batch_size=640"]))
    inf, tr, orch = sbatch_groups(cfg)
    assert "--nodes=2" in inf and "--gpus-per-node=8" in inf
    assert "--nodes=4" in tr and "--exclusive" in tr
    assert "--ntasks=1" in orch and "--cpus-per-task=8" in orch and not any("gpus" in o for o in orch)
    text = render_job(cfg, python="/p", prl_home="/h")
    assert text.count("#SBATCH hetjob") == 2
    assert "--nnodes=4 --nproc-per-node=8" in text
    assert "srun --het-group=2" in text


def test_homogeneous_fallback_splits_one_allocation():
    cfg = resolve(load_config(ROOT / "configs/hendrycks_math.yaml", ["slurm.hetjob=false", "trainer.nodes=2",
                                                                      "orchestrator.placement=own_node"]))
    (group,) = sbatch_groups(cfg)
    assert "--nodes=4" in group  # 1 inference + 2 trainer + 1 orchestrator
    text = render_job(cfg, python="/p", prl_home="/h")
    assert "hetjob" not in text.replace("slurm.hetjob", "")
    assert 'TRAINER_NODES=("${NODES[@]:1:2}")' in text
    assert 'ORCHESTRATOR_NODES=("${NODES[@]:3:1}")' in text


@pytest.mark.parametrize("override", ['run.output_dir=/tmp/a"b', "run.name=a%jb", 'slurm.job_name=x"y'])
def test_values_sbatch_cannot_carry_are_refused(override):
    with pytest.raises(ConfigError, match="^" + override.split("=")[0].replace(".", r"\.") + ": must not contain"):
        load_config(ROOT / "configs/toy.yaml", [override])
