"""Per-component batch options (inference/trainer/orchestrator `.slurm`), the interpreter and srun
options on the compute nodes, and setup lines: config checks, rendering, and the rendered script's
behaviour when setup fails (run in bash with a stand-in interpreter, no SLURM)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # render_cases.py
from render_cases import CASES, ROOT, render_case  # noqa: E402

from prl.config import ConfigError, component_slurm, load_config  # noqa: E402
from prl.control.render import render_job, sbatch_groups  # noqa: E402
from prl.control.submit import resolve  # noqa: E402
from prl.run.launch import Wiring, beside_cpu_vllm, component_env, srun_command, srun_plan, task_command  # noqa: E402

MATH = ROOT / "configs/hendrycks_math.yaml"
GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def cfg_of(*overrides, config=MATH):
    return resolve(load_config(config, list(overrides)))


def test_components_inherit_unset_keys_from_the_slurm_section():
    cfg = cfg_of("slurm.partition=gpu", "slurm.mem=500G", "trainer.slurm.mem=900G", "inference.slurm.partition=''")
    assert component_slurm(cfg, "trainer").mem == "900G"
    assert component_slurm(cfg, "trainer").partition == "gpu"
    assert component_slurm(cfg, "inference").mem == "500G"
    assert component_slurm(cfg, "inference").partition == ""  # "" unsets: the cluster default


def test_each_het_group_gets_its_own_batch_options():
    cfg = cfg_of("slurm.partition=gpu", "slurm.account=rl", "orchestrator.placement=own_node",
                 "orchestrator.slurm.partition=cpu", "orchestrator.slurm.exclusive=false", "orchestrator.slurm.mem=16G",
                 "trainer.slurm.qos=long", "trainer.slurm.extra_sbatch=[--mail-type=END]", "inference.slurm.gpu_type=h100")
    inf, tr, orch = sbatch_groups(cfg)
    assert "--partition=cpu" in orch and "--mem=16G" in orch and "--exclusive" not in orch
    assert "--account=rl" in orch and not any("gpus" in o for o in orch)
    assert "--qos=long" in tr and "--mail-type=END" in tr and "--partition=gpu" in tr and "--exclusive" in tr
    assert "--qos=long" not in inf and "--mail-type=END" not in inf
    assert "--gpus-per-node=h100:8" in inf and "--gpus-per-node=8" in tr


@pytest.mark.parametrize("key", ["partition=cpu", "account=a", "qos=q", "time=01:00:00", "constraint=x",
                                 "mem=1G", "gres=nvme:1", "exclusive=false", "extra_sbatch=[--mail-type=END]"])
def test_homogeneous_layout_refuses_differing_batch_options(key):
    with pytest.raises(ConfigError, match=rf"^orchestrator\.slurm\.{key.split('=')[0]}: the homogeneous layout"):
        load_config(MATH, ["slurm.hetjob=false", "orchestrator.placement=own_node", f"orchestrator.slurm.{key}"])


def test_homogeneous_layout_takes_options_every_component_shares():
    cfg = cfg_of("slurm.hetjob=false", *[f"{c}.slurm.partition=big" for c in ("inference", "trainer", "orchestrator")],
                 "orchestrator.placement=own_node", "trainer.slurm.setup=[module load x]", "inference.slurm.srun_args=[--mpi=none]")
    (group,) = sbatch_groups(cfg)
    assert "--partition=big" in group


def test_orchestrator_on_the_trainer_node_has_no_batch_options():
    with pytest.raises(ConfigError, match=r"^orchestrator\.slurm\.partition: .*placement=own_node"):
        load_config(MATH, ["orchestrator.placement=trainer_node", "orchestrator.slurm.partition=cpu"])
    # srun-level options still apply to it
    cfg = cfg_of("orchestrator.placement=trainer_node", "orchestrator.slurm.srun_args=[--container-image=/i.sqsh]")
    orch = srun_command(cfg, "orchestrator", Wiring.symbolic())
    assert "--container-image=/i.sqsh" in orch and "--overlap" in orch


@pytest.mark.parametrize("override, message", [
    ("trainer.slurm.srun_args=[container-image]", r"trainer\.slurm\.srun_args\[0\]: must be an option"),
    ("inference.slurm.extra_sbatch=[mail]", r"inference\.slurm\.extra_sbatch\[0\]: must be an option"),
    ('orchestrator.slurm.partition=a"b', r"orchestrator\.slurm\.partition: must not contain"),
    ("slurm.python=''", r"slurm\.python: must be an interpreter"),
    ("orchestrator.slurm.cpus=4", r"cpus"),  # not a key: the loader names it
])
def test_bad_component_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(MATH, [override])


def test_interpreter_and_srun_options_per_component():
    cfg = cfg_of("slurm.python=/venv/bin/python", "inference.slurm.python=/usr/bin/python3",
                 "slurm.srun_args=[--container-image=/img/prl.sqsh]", "trainer.slurm.srun_args=[--mpi=pmix]")
    text = render_job(cfg, python="/login/python", prl_home="/h")
    assert "export PRL_PYTHON=/venv/bin/python" in text  # the config wins over the submitting interpreter
    inf, tr, orch = (srun_command(cfg, name, Wiring.symbolic()) for name in ("inference", "trainer", "orchestrator"))
    assert component_env(cfg, "inference", "/venv/bin/python") == {"PRL_PYTHON": "/usr/bin/python3"}
    assert component_env(cfg, "orchestrator", "/venv/bin/python") == {}
    assert "--container-image=/img/prl.sqsh" in inf and "--container-image=/img/prl.sqsh" in orch
    assert "--mpi=pmix" in tr and "--container-image=/img/prl.sqsh" not in tr  # a list replaces
    assert render_job(cfg_of(), python="/login/python", prl_home="/h").count("export PRL_PYTHON=/login/python") == 1


def test_shipped_gpu_configs_keep_the_orchestrator_off_exclusive_gpu_nodes():
    for name in ("hendrycks_math", "reverse_text"):
        groups = sbatch_groups(cfg_of("slurm.partition=gpu", config=ROOT / f"configs/{name}.yaml"))
        assert len(groups) == 2, f"{name}: the orchestrator has a het group of its own"


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_scripts_pass_shellcheck(name):
    if not shutil.which("shellcheck"):
        if os.environ.get("CI") == "true":
            pytest.fail("shellcheck missing in CI: tools/setup.sh installs it (apt-get install shellcheck)")
        pytest.skip("shellcheck not installed")
    # Warnings and errors only: notes (e.g. SC2016 on the deliberate single-quoted `bash -c`) are style.
    r = subprocess.run(["shellcheck", "--severity=warning", "--shell=bash", str(GOLDEN / f"{name}.sbatch")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


# --- the rendered script in bash, up to where setup ends it (a stand-in interpreter, no SLURM) -----

FAKE_PYTHON = """#!/bin/bash
# stand-in for `python -m prl.run.launches new-attempt RUN_DIR`
mkdir -p "$4/logs/attempt_0" && echo 0
"""


def run_script(tmp_path, python, *overrides):
    cfg = cfg_of(f"run.output_dir={tmp_path / 'o u t'}", *overrides, config=ROOT / "configs/toy.yaml")
    script = tmp_path / "job.sbatch"
    script.write_text(render_job(cfg, python=str(python), prl_home=str(ROOT)))
    cfg.run.run_dir.mkdir(parents=True)  # prl submit makes it before sbatch; the job runs from it
    env = {**os.environ, "SLURM_JOB_ID": "7"}
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30)
    return r, cfg.run.run_dir / "logs/attempt_0"


def test_failing_setup_line_ends_the_job_with_status_15_and_says_which(tmp_path):
    python = tmp_path / "py"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    r, attempt = run_script(tmp_path, python, "slurm.setup=[export A=1,echo \"set up $A $UNSET_VAR\",ls /nonexistent-prl,echo never]")
    assert r.returncode == 15
    log = (attempt / "job.log").read_text()
    assert "set up 1" in log and "never" not in log  # setup output lands in the attempt's log (prl logs shows it)
    assert (attempt / "failed").read_text() == "setup failed: ls /nonexistent-prl\n"


def test_failing_attempt_bookkeeping_is_not_masked(tmp_path):
    r, attempt = run_script(tmp_path, "/bin/false")
    assert r.returncode == 15 and not attempt.exists()
    assert "setup failed: /bin/false -m prl.run.launches new-attempt" in r.stderr  # slurm-%j.out


def component_task(cfg, name, python):
    """The shell words srun would run for `name`, with $PRL_PYTHON set as srun would pass it."""
    env = {"PRL_PYTHON": str(python), "PRL_HOME": "/h", "PRL_RUN_DIR": "/r", "PATH": os.environ["PATH"]}
    return subprocess.run(task_command(cfg, name), capture_output=True, text=True, env=env, timeout=30)


def test_component_setup_runs_in_the_shell_that_execs_the_program(tmp_path):
    program = tmp_path / "prog"
    # As $PRL_PYTHON it is first asked to run prl.run.node (`-m prl.run.node NAME -- CMD...`): it runs CMD.
    program.write_text('#!/bin/bash\n[ "$1" = -m ] && { shift 4; exec "$@"; }\necho "program $1 sees A=$A in $PWD"\n')
    program.chmod(0o755)
    cfg = cfg_of(f"orchestrator.slurm.setup=[export A='x y',cd {tmp_path}]")
    r = component_task(cfg, "orchestrator", program)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"program /h/jobs/orchestrator.py sees A=x y in {tmp_path}\n"


def test_failing_component_setup_ends_its_task_with_status_15(tmp_path):
    cfg = cfg_of("trainer.slurm.setup=[echo ok,module load nosuchmodule_prl]")
    r = component_task(cfg, "trainer", "/bin/echo")
    assert r.returncode == 15
    assert "trainer setup failed: module load nosuchmodule_prl" in r.stderr


def test_a_trainer_beside_a_cpu_vllm_runs_one_thread_per_rank_unless_told_otherwise():
    """slurm.one_node with vLLM on CPU: OMP_NUM_THREADS=1 on the trainer's srun line (launch.beside_cpu_vllm);
    an OMP_NUM_THREADS in trainer.env or the job's env wins; vLLM on GPUs, or nodes of its own: nothing."""
    one_node = ("slurm.hetjob=false", "slurm.one_node=true", "inference.gpus_per_node=0", "trainer.nodes=1")
    toy = ROOT / "configs/toy.yaml"
    assert component_env(cfg_of(*one_node, config=toy), "trainer", "p")["OMP_NUM_THREADS"] == "1"
    plan = srun_plan(cfg_of(*one_node, config=toy), Wiring.symbolic()).splitlines()
    assert [line.startswith("trainer: OMP_NUM_THREADS=1 ") for line in plan].count(True) == 1, plan
    assert component_env(cfg_of(*one_node, "trainer.env.OMP_NUM_THREADS=4", config=toy), "trainer", "p")["OMP_NUM_THREADS"] == "4"
    assert "OMP_NUM_THREADS" not in component_env(cfg_of(*one_node, "env.OMP_NUM_THREADS=3", config=toy), "trainer", "p")
    assert "OMP_NUM_THREADS" not in component_env(cfg_of("slurm.hetjob=false", "slurm.one_node=true", "trainer.nodes=1"),
                                                  "trainer", "p")  # hendrycks_math: vLLM on the node's GPUs
    assert "OMP_NUM_THREADS" not in component_env(cfg_of(config=toy), "trainer", "p")  # nodes of its own
    assert "OMP_NUM_THREADS" not in component_env(cfg_of(*one_node, config=toy), "inference", "p")
    # Local mode: every component on this machine; the caller's own OMP_NUM_THREADS wins.
    assert beside_cpu_vllm(cfg_of(config=toy), {}, local=True) == {"OMP_NUM_THREADS": "1"}
    assert beside_cpu_vllm(cfg_of(config=toy), {"OMP_NUM_THREADS": "2"}, local=True) == {}
    assert beside_cpu_vllm(cfg_of(config=MATH), {}, local=True) == {}
