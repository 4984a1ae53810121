"""`prl eval`: which steps, bad input, the job array it submits (sbatch replaced at the subprocess
boundary). The evals themselves run against real vLLM in tests/integration/test_e2e_local.py (`--local`, online)
and tests/cluster/test_slurm_rl.py (the array on the test cluster).

    pytest tests/unit/test_eval.py        # a few seconds
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, fake_commands, prl

from prl.control.evaluate import missing_steps, parse_steps
from prl.run import launches
from prl.run.rundir import RunDir



@pytest.fixture
def run(tmp_path) -> RunDir:
    """A toy run directory (prl submit --dry-run) whose trainer saved weights 2 and 4 (and left 6 half-written)."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_text("{}")
    out = tmp_path / "runs; 'x' $y"
    r = prl("submit", str(ROOT / "configs/toy.yaml"), "--dry-run", f"run.output_dir={out}", f"model.name={model}",
            cwd=tmp_path, path_prefix=fake_sbatch(tmp_path))  # its --test-only agrees: no cluster decides here
    assert r.returncode == 0, r.stderr
    rd = RunDir(out / "toy")
    for step in (2, 4, 6):
        (rd.weights_dir(step)).mkdir(parents=True)
        if step != 6:
            (rd.weights_dir(step) / "COMPLETE").touch()
    return rd


def fake_sbatch(tmp_path: Path, fail: bool = False) -> Path:
    """sbatch that keeps its argv and script under tmp_path/sbatch and answers job id 77 (or fails); an
    srun beside it, which submitit looks for on PATH before it submits, and which nothing here runs."""
    state = tmp_path / "sbatch"
    state.mkdir(exist_ok=True)
    answer = 'if [ "$1" = --parsable ]; then echo "77;cluster"; else echo "Submitted batch job 77"; fi'
    body = (f'if [ "$1" = --test-only ]; then exit 0; fi\necho "$@" >> {state}/argv\ncp "${{@: -1}}" {state}/script\n'
            + ('echo "sbatch: error: invalid partition specified: gpu" >&2; exit 1' if fail else answer))
    return fake_commands(tmp_path / "bin", sbatch=body, srun='echo "srun: not in a job here" >&2; exit 1')


def test_steps_parse_and_missing_ones_are_named(run):
    assert parse_steps("4, 2,4") == [2, 4]
    with pytest.raises(ValueError, match="'x' is not a step number"):
        parse_steps("2,x")
    with pytest.raises(ValueError, match="'' is not a step number"):
        parse_steps("2,")
    assert missing_steps(run, [0, 2, 4, 6, 8]) == [6, 8]  # 0 is model.name; 6 has no COMPLETE marker


@pytest.mark.parametrize("args,message", [
    (["--steps", "2,6"], "prl: error: --steps: no saved weights for step 6 (saved: 2, 4)\n"),
    (["--steps", "2,-1"], "prl: error: --steps: '-1' is not a step number (e.g. --steps 10,20)\n"),
    (["--steps", "9", "--local"], "prl: error: --steps: no saved weights for step 9 (saved: 2, 4)\n"),
])
def test_bad_steps_exit_2_with_one_line_and_nothing_submitted(run, tmp_path, args, message):
    bin_dir = fake_sbatch(tmp_path)
    r = prl("eval", str(run.path), *args, cwd=tmp_path, path_prefix=bin_dir)
    assert (r.returncode, r.stderr, r.stdout) == (2, message, "")
    assert not (tmp_path / "sbatch" / "argv").exists() and not run.evals.exists()


def test_steps_and_all_exclude_each_other(run, tmp_path):
    r = prl("eval", str(run.path), "--steps", "2", "--all", cwd=tmp_path)
    assert r.returncode == 2 and "not allowed with argument" in r.stderr and not run.evals.exists()


def test_no_saved_weights_at_all(tmp_path, run):
    for step in (2, 4):
        (run.weights_dir(step) / "COMPLETE").unlink()
    r = prl("eval", str(run.path), "--all", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("prl: error: ") and "no saved weights" in r.stderr


def test_all_submits_one_submitit_array_task_per_saved_version(run, tmp_path):
    """submitit's array: its script asks for one node per task, exports the run's environment, and
    each task's pickled call is jobs/eval.py of its own step."""
    import pickle

    bin_dir = fake_sbatch(tmp_path)
    r = prl("eval", str(run.path), "--all", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("submitted job array 77: steps 2, 4 ->")
    script = (tmp_path / "sbatch" / "script").read_text()
    assert script == (run.eval_array_dir / "77_submission.sh").read_text()
    for line in ("#SBATCH --array=0-1%2", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --time=00:30:00",
                 "#SBATCH --job-name=toy-eval"):
        assert line + "\n" in script, line
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export PRL_RUN_DIR="))
    out = subprocess.run(["bash", "-c", exports + '\nprintf %s "$PRL_RUN_DIR"'], capture_output=True, text=True).stdout
    assert out == str(run.path)  # the hostile run directory, byte for byte
    calls = []
    for task in (0, 1):
        with open(run.eval_array_dir / f"77_{task}_submitted.pkl", "rb") as f:
            delayed = pickle.load(f)
        calls.append((delayed.function.__module__, delayed.function.__name__, delayed.args))
    assert calls == [("prl.control.evaluate", "run_step", (str(run.config), step)) for step in (2, 4)]
    entry = json.loads(run.eval_submissions.read_text())
    assert entry["job_id"] == "77" and entry["steps"] == [2, 4]
    assert launches.job_ids(run) == []  # not one of the run's jobs: prl status and prl cancel keep to training


def test_default_is_the_newest_saved_version_and_step_0_is_the_base_model(run, tmp_path):
    import pickle

    bin_dir = fake_sbatch(tmp_path)
    for args, step in (((), 4), (("--steps", "0"), 0)):
        assert prl("eval", str(run.path), *args, cwd=tmp_path, path_prefix=bin_dir).returncode == 0
        script = (tmp_path / "sbatch" / "script").read_text()
        assert "--array" not in script  # one version: a plain job
        with open(run.eval_array_dir / "77_submitted.pkl", "rb") as f:
            assert pickle.load(f).args == (str(run.config), step)


def test_refused_submission_records_nothing(run, tmp_path):
    r = prl("eval", str(run.path), "--steps", "2", cwd=tmp_path, path_prefix=fake_sbatch(tmp_path, fail=True))
    assert r.returncode == 1 and "invalid partition" in r.stderr
    assert not run.eval_submissions.exists() and list(run.eval_array_dir.iterdir()) == []


def test_eval_program_refuses_incomplete_weights(run, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "jobs/eval.py"), str(run.config), "6"], capture_output=True,
                       text=True, env={**os.environ, "PRL_RUN_DIR": str(run.path)})
    assert r.returncode == 2 and "weights/step_6 is not complete" in r.stderr and not run.evals.exists()


def test_the_eval_server_keeps_expert_parallelism_where_it_has_gpus_to_spread_the_experts_over(tmp_path):
    """jobs/eval.py serves a version with one server over one node's GPUs: with the run's
    inference.expert_parallel where that server has several (vLLM's switch on its command line), without it
    on one GPU (a run of one server over two one-GPU nodes, multi_node=data_parallel, which it serves on one)."""
    import importlib.util

    from prl.config import load_config
    from prl.inference.server import vllm_args

    spec = importlib.util.spec_from_file_location("eval_job", ROOT / "jobs/eval.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    toy, ep = ROOT / "configs/toy.yaml", "inference.expert_parallel=true"
    two = job.serving_config(load_config(toy, [ep, "inference.nodes=2", "inference.gpus_per_node=2"]), "/w/step_2")
    assert two.inference.engine_ranks() == 2 and "--enable-expert-parallel" in vllm_args(two, {})
    joined = load_config(toy, [ep, "inference.nodes=2", "inference.gpus_per_node=1", "inference.multi_node=data_parallel",
                               "slurm.fabric_isolated=true"])
    one = job.serving_config(joined, "/w/step_2")
    assert (one.inference.nodes, one.inference.multi_node, one.inference.expert_parallel) == (1, "servers", False)
    assert "--enable-expert-parallel" not in vllm_args(one, {})
