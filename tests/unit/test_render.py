"""Rendered job scripts: golden files, shell syntax, quoting of hostile values, layout per config."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # render_cases.py
from render_cases import CASES, HOSTILE_DIR, ROOT, render_case, render_launch  # noqa: E402

from prl.config import ConfigError, load_config  # noqa: E402
from prl.control.render import eval_array_parameters, render_job, sbatch_groups  # noqa: E402
from prl.control.submit import resolve  # noqa: E402
from prl.run.launch import Wiring, srun_plan  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_golden_file(name):
    expected = (GOLDEN / f"{name}.sbatch").read_text()
    assert render_case(name) == expected, f"regenerate with tools/regen_golden.py if intended ({name})"


@pytest.mark.parametrize("name", sorted(CASES))
def test_srun_steps_match_golden_file(name):
    """The supervisor's srun step of each component (prl.run.launch), as --dry-run shows them."""
    expected = (GOLDEN / f"{name}.launch").read_text()
    assert render_launch(name) == expected, f"regenerate with tools/regen_golden.py if intended ({name})"


@pytest.mark.parametrize("name", sorted(CASES))
def test_is_valid_bash(name):
    result = subprocess.run(["bash", "-n"], input=render_case(name), text=True, capture_output=True)
    assert result.returncode == 0, result.stderr


def test_eval_array_takes_the_inference_groups_resources_setup_and_environment():
    """`prl eval`'s submitit parameters: one node per version with the inference group's options."""
    cfg = resolve(load_config(ROOT / "configs/hendrycks_math.yaml", [
        "inference.nodes=2", "inference.data_parallel=16", "inference.slurm.partition=big", "slurm.partition=gpu",
        "slurm.account=acct", "inference.slurm.extra_sbatch=[--comment=x y, --requeue]", "trainer.slurm.gres=nvme:1",
        "inference.slurm.setup=[module load vllm]", "inference.env={HF_HOME: /a b/$c}"]))
    params = eval_array_parameters(cfg)
    assert (params["nodes"], params["ntasks_per_node"]) == (1, 1)  # one node per version
    assert params["additional_parameters"] == {
        "time": "04:00:00", "gpus_per_node": 8, "partition": "big", "account": "acct", "exclusive": True,
        "comment": "x y", "requeue": True}  # hendrycks_math.yaml: 4 hours, whole nodes
    setup = params["setup"]
    assert setup[0].startswith("module load vllm || { echo 'setup failed: module load vllm' >&2; exit 15; }")
    # The environment, in bash: values byte for byte; a failing setup line ends the task with status 15.
    out = subprocess.run(["bash", "-c", "\n".join(setup[1:]) + '\nprintf "%s|%s" "$HF_HOME" "$PRL_RUN_DIR"'],
                         capture_output=True, text=True, check=True).stdout
    assert out == f"/a b/$c|{cfg.run.run_dir}"
    failing = subprocess.run(["bash", "-c", setup[0].replace("module load vllm", "false", 1)], capture_output=True, text=True)
    assert failing.returncode == 15 and "setup failed: module load vllm" in failing.stderr


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
    plan = srun_plan(cfg, Wiring.symbolic())
    assert "--nnodes=4 --nproc-per-node=8" in plan
    assert "srun --het-group=2" in plan


def test_no_weight_broadcast_port_is_exported_trainer_rank_0_records_the_one_it_picks():
    """The broadcast's store listens on a port the system picks when trainer rank 0 starts, recorded in
    the attempt's directory (prl.run.broadcast.Access); a port derived from the job id, exported to the
    whole job, is one any user of the cluster can compute."""
    for how in ("filesystem", "broadcast"):
        script = render_job(resolve(load_config(ROOT / "configs/hendrycks_math.yaml", [f"inference.weight_transfer={how}"])),
                            python="/p", prl_home="/h")
        assert "WEIGHTS_PORT" not in script and "25000" not in script


def test_homogeneous_fallback_splits_one_allocation():
    cfg = resolve(load_config(ROOT / "configs/hendrycks_math.yaml", ["slurm.hetjob=false", "trainer.nodes=2",
                                                                      "orchestrator.placement=own_node"]))
    (group,) = sbatch_groups(cfg)
    assert "--nodes=4" in group  # 1 inference + 2 trainer + 1 orchestrator
    text = render_job(cfg, python="/p", prl_home="/h")
    assert "hetjob" not in text.replace("slurm.hetjob", "")
    assert 'TRAINER_NODES=("${NODES[@]:1:2}")' in text
    assert 'ORCHESTRATOR_NODES=("${NODES[@]:3:1}")' in text
    # The supervisor places each srun step on its slice of the allocation.
    assert 'PRL_TRAINER_NODES=$(IFS=,; echo "${TRAINER_NODES[*]}"); export PRL_TRAINER_NODES' in text
    assert "--nodelist=$PRL_TRAINER_NODES" in srun_plan(cfg, Wiring.symbolic())


def test_compile_cache_dir_is_where_the_job_keeps_its_compile_caches(monkeypatch, tmp_path):
    """run.compile_cache_dir: the batch script points every compile cache there instead of RUN/cache (`~`
    resolved at submit, as the nodes cannot); with run.compile_cache=false it is refused, naming the key."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = resolve(load_config(ROOT / "configs/toy.yaml", ["run.compile_cache_dir=~/.cache/prl/compile"]))
    text = render_job(cfg, python="/p", prl_home="/h")
    assert f"export PRL_COMPILE_CACHE={tmp_path}/.cache/prl/compile\n" in text
    assert 'export TORCHINDUCTOR_CACHE_DIR="$PRL_COMPILE_CACHE"/inductor' in text and "/cache\n" not in text
    with pytest.raises(ConfigError, match=r"^run\.compile_cache_dir: set, but run\.compile_cache is false"):
        load_config(ROOT / "configs/toy.yaml", ["run.compile_cache_dir=/x", "run.compile_cache=false"])
    with pytest.raises(ConfigError, match=r"^run\.compile_cache_dir: must be a non-empty path"):
        load_config(ROOT / "configs/toy.yaml", ["run.compile_cache_dir=' '"])


@pytest.mark.parametrize("override", ['run.output_dir=/tmp/a"b', "run.name=a%jb", 'slurm.job_name=x"y'])
def test_values_sbatch_cannot_carry_are_refused(override):
    with pytest.raises(ConfigError, match="^" + override.split("=")[0].replace(".", r"\.") + ": must not contain"):
        load_config(ROOT / "configs/toy.yaml", [override])


def test_job_log_lists_the_wiring_and_no_other_variable():
    """The script's `env | grep` line (its output goes to job.log) prints an allow-list: a secret
    that reaches the job through a PRL_ variable, or any other, stays out of the log."""
    line = next(ln for ln in render_case("hetjob").splitlines() if ln.startswith("env | grep"))
    env = {"PATH": "/usr/bin:/bin", "PRL_RUN_DIR": "/runs/r", "MASTER_ADDR": "node3", "PRL_INFERENCE_URLS": "http://n:1/v1",
           "PRL_TEST_API_KEY": "s3cret-key", "PRL_RUN_DIR_X": "s3cret-2", "HF_TOKEN": "s3cret-3"}
    out = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True).stdout
    assert out.splitlines() == ["MASTER_ADDR=node3", "PRL_INFERENCE_URLS=http://n:1/v1", "PRL_RUN_DIR=/runs/r"]
    assert "s3cret" not in out


def test_a_prl_planted_in_the_submit_directory_never_runs(tmp_path):
    """python -m puts the working directory first on sys.path; the batch script starts in the submit
    directory (SLURM's default). Its prl programs must run from the run directory instead: run the
    script's head, up to its first `python -m prl...`, in a submit directory holding a planted prl/."""
    run = tmp_path / "out" / "toy"
    cfg = resolve(load_config(ROOT / "configs/toy.yaml", [f"run.output_dir={run.parent}"]))
    text = render_job(cfg, python=sys.executable, prl_home=str(ROOT))
    head = text[: text.index("\n", text.index("-m prl.run.launches new-attempt"))]
    run.mkdir(parents=True, mode=0o700)
    (run / "config.yaml").write_text("")  # new-attempt checks it is the owner's (prl submit writes it)
    (run / "config.yaml").chmod(0o600)
    submit_dir = tmp_path / "shared"
    (submit_dir / "prl").mkdir(parents=True)
    (submit_dir / "prl" / "__init__.py").write_text(f"open({str(tmp_path / 'planted-ran')!r}, 'w')\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "SLURM_JOB_ID": "7"}
    done = subprocess.run(["bash", "-c", head + '\necho "attempt $PRL_ATTEMPT rc $rc cwd $PWD"'], cwd=submit_dir,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout == f"attempt 0 rc 0 cwd {run}\n", done.stderr
    assert not (tmp_path / "planted-ran").exists()
