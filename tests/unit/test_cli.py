"""`prl` end to end as a user runs it, with sbatch/squeue/sacct/scancel replaced at the subprocess
boundary by small scripts on PATH (the real cluster is exercised in test_slurm.py)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, fake_commands, prl
from prl.run import launches

TOY = str(ROOT / "configs/toy.yaml")


def make_model_dir(path: Path) -> Path:
    """What the pre-submit model check looks for (prl.control.checks.check_model), without weights."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "tokenizer.json").write_text("{}")
    return path


@pytest.fixture(autouse=True)
def toy_model_here(tmp_path):
    """configs/toy.yaml names `.cache/tiny-qwen2`, relative to the directory prl runs in (tmp_path)."""
    return make_model_dir(tmp_path / ".cache/tiny-qwen2")


@pytest.fixture
def fake_slurm(tmp_path):
    """sbatch prints job ids 1001, 1002, ... and records its argv (`--test-only` runs apart: they
    answer like SLURM, exit 1 when slurm_state/testonly.fail holds a message); squeue/sacct/scancel
    answer from files."""
    state = tmp_path / "slurm_state"
    state.mkdir()
    scripts = {
        "sbatch": f'if [ "$1" = --test-only ]; then cat > {state}/testonly.script; '
                  f'if [ -f {state}/testonly.fail ]; then cat {state}/testonly.fail >&2; exit 1; fi; '
                  f'echo "sbatch: Job 1000 to start at now" >&2; exit 0; fi\n'
                  f'echo "$@" >> {state}/sbatch.argv\nif [ -f {state}/sbatch.fail ]; then echo "sbatch: error: invalid partition specified: gpu" >&2; exit 1; fi\n'
                  f'n=$(($(cat {state}/next 2>/dev/null || echo 1000) + 1)); echo $n > {state}/next; echo "$n;cluster"',
        "squeue": f"cat {state}/squeue 2>/dev/null || true",
        "sacct": f"cat {state}/sacct 2>/dev/null || true",
        "scancel": f'echo "$@" >> {state}/scancel.argv',
    }
    return fake_commands(tmp_path / "bin", **scripts), state


def test_dry_run_writes_everything_and_submits_nothing(tmp_path, fake_slurm):
    bin_dir, state = fake_slurm
    out_dir = tmp_path / "runs dir; 'x' $y"
    r = prl("submit", TOY, f"run.output_dir={out_dir}", "--dry-run", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 0, r.stderr
    run = out_dir / "toy"
    assert (run / "config.yaml").is_file() and (run / "job.sbatch").is_file()
    assert r.stdout.startswith("#!/bin/bash") and "sbatch --parsable" in r.stdout
    assert not (state / "sbatch.argv").exists()
    # the written config is the resolved one: absolute paths
    from prl.config import load_config

    assert load_config(run / "config.yaml").run.output_dir == str(out_dir)


@pytest.mark.parametrize("override,message", [
    ("trainer.nodes=0", "trainer.nodes: must be > 0"),
    ("trainer.nodez=1", "trainer.nodez"),
    ("orchestrator.batch_size=63", "orchestrator.batch_size"),
    ("notakeyvalue", "expected key=value"),
])
def test_bad_config_exits_2_and_creates_nothing(tmp_path, fake_slurm, override, message):
    bin_dir, state = fake_slurm
    r = prl("submit", TOY, f"run.output_dir={tmp_path / 'out'}", override, cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 2
    assert message in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()
    assert not (state / "sbatch.argv").exists()


def test_unreadable_config_exits_2(tmp_path):
    r = prl("submit", str(tmp_path / "missing.yaml"), cwd=tmp_path)
    assert r.returncode == 2 and "config file not found" in r.stderr


def test_submit_records_refuses_a_second_submit_and_cleans(tmp_path, fake_slurm):
    bin_dir, state = fake_slurm
    args = ["submit", TOY, f"run.output_dir={tmp_path / 'out'}"]
    r = prl(*args, cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 0, r.stderr
    assert "submitted job 1001" in r.stdout
    run = tmp_path / "out" / "toy"
    (entry,) = [json.loads(line) for line in (run / "submissions.jsonl").read_text().splitlines()]
    assert entry["job_id"] == "1001"
    assert (state / "sbatch.argv").read_text().split() == ["--parsable", str(run / "job.sbatch")]
    assert Path(tmp_path / ".prl-last-run").read_text().strip() == str(run)

    r = prl(*args, cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 2 and "already holds a run" in r.stderr

    r = prl(*args, "--resume", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 0 and "submitted job 1002" in r.stdout
    assert len((run / "submissions.jsonl").read_text().splitlines()) == 2

    r = prl(*args, "--clean", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 0 and "moved the previous run" in r.stdout
    (old,) = (tmp_path / "out").glob("toy.prev-*")
    assert len((old / "submissions.jsonl").read_text().splitlines()) == 2
    assert len((run / "submissions.jsonl").read_text().splitlines()) == 1


def test_sbatch_refusal_leaves_no_run_dir(tmp_path, fake_slurm):
    bin_dir, state = fake_slurm
    (state / "sbatch.fail").touch()
    r = prl("submit", TOY, f"run.output_dir={tmp_path / 'out'}", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 1
    assert "invalid partition" in r.stderr
    assert not (tmp_path / "out" / "toy").exists()


def test_status_and_cancel_use_the_last_run_from_here(tmp_path, fake_slurm):
    bin_dir, state = fake_slurm
    prl("submit", TOY, f"run.output_dir={tmp_path / 'out'}", cwd=tmp_path, path_prefix=bin_dir)
    (state / "squeue").write_text("1001+0|RUNNING|1:02|node1|None|2026-11-23T10:00:00|/x/job.sbatch\n"
                                  "1001+1|RUNNING|1:02|node2|None|2026-11-23T10:00:00|/x/job.sbatch\n")
    r = prl("status", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 0, r.stderr
    assert "1001 RUNNING 1:02\n" in r.stdout
    # Every het group's nodes, named by component (toy.yaml: the orchestrator shares a trainer node).
    assert "nodes:       inference node1; trainer node2; orchestrator (the first trainer node)" in r.stdout
    assert "last submitted from here" in r.stderr
    r = prl("cancel", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 0 and "cancelled 1001" in r.stdout
    assert (state / "scancel.argv").read_text().split() == ["1001"]
    assert json.loads((tmp_path / "out/toy/cancelled").read_text())["jobs"] == ["1001"]

    (state / "squeue").write_text("")
    (state / "sacct").write_text("1001|FAILED|00:00:07|node[1-2]|12:0\n")
    (tmp_path / "out/toy/logs/attempt_0").mkdir(parents=True)
    (tmp_path / "out/toy/logs/attempt_0/failed").write_text("trainer failed with exit status 3\n")
    r = prl("status", str(tmp_path / "out/toy"), cwd="/", path_prefix=bin_dir)
    assert "1001 FAILED" in r.stdout and "exit=12:0 (trainer failed)" in r.stdout
    assert "failed:      trainer failed with exit status 3" in r.stdout


def test_no_run_anywhere_is_a_usage_error(tmp_path):
    r = prl("logs", cwd=tmp_path)
    assert r.returncode == 2 and "no RUN given" in r.stderr


def make_progress(run: Path, ckpts=(2, 4), weights=range(1, 6), rollouts=range(0, 6)):
    for s in ckpts:
        (run / f"checkpoints/step_{s}").mkdir(parents=True)
        (run / f"checkpoints/step_{s}/COMPLETE").touch()
    (run / "checkpoints/step_6").mkdir()  # interrupted write: no marker
    for s in weights:
        (run / f"weights/step_{s}").mkdir(parents=True)
        (run / f"weights/step_{s}/COMPLETE").touch()
    (run / "rollouts").mkdir(exist_ok=True)
    for s in rollouts:
        (run / f"rollouts/step_{s}.pt").write_bytes(b"x")
    (run / "evals/logs").mkdir(parents=True)
    for s in (0, 2, 4):
        (run / f"evals/step_{s}.json").write_text('{"reward_mean": 0.5}')


def test_resume_step_rewinds_and_resubmits(tmp_path, fake_slurm):
    bin_dir, state = fake_slurm
    prl("submit", TOY, f"run.output_dir={tmp_path / 'out'}", cwd=tmp_path, path_prefix=bin_dir)
    run = tmp_path / "out/toy"
    make_progress(run)

    r = prl("resume", "--step", "3", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 2 and "complete: 2, 4" in r.stderr

    (state / "squeue").write_text("1001|RUNNING|0:10|node1|None|N/A|/x/job.sbatch\n")
    r = prl("resume", "--step", "2", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 1 and "still has job 1001 (RUNNING)" in r.stderr
    (state / "squeue").write_text("")

    r = prl("resume", "--step", "2", "--dry-run", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 0, r.stderr
    assert f"would archive {run}/checkpoints/step_4" in r.stdout
    assert f"would remove {run}/rollouts/step_2.pt" in r.stdout and "rollouts/step_1.pt" not in r.stdout
    assert f"would remove {run}/evals/step_4.json" in r.stdout and "evals/step_2" not in r.stdout
    assert (run / "checkpoints/step_4").exists() and (run / "weights/step_5").exists()

    r = prl("resume", "--step", "2", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 0 and "submitted job 1002" in r.stdout and "from step 2" in r.stdout
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["step_1", "step_2"]
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["step_0.pt", "step_1.pt"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2"]
    assert sorted(p.name for p in (run / "evals").iterdir()) == ["logs", "step_0.json", "step_2.json"]  # of kept weights
    (archived,) = (run / "archive").iterdir()
    assert (archived / "step_4/COMPLETE").exists()
    assert [json.loads(x)["job_id"] for x in (run / "submissions.jsonl").read_text().splitlines()] == ["1001", "1002"]


def test_each_launch_continues_from_the_newest_complete_checkpoint(tmp_path):
    from prl.run.rundir import RunDir

    run = tmp_path / "run"
    make_progress(run)
    rd = RunDir(run)
    n, attempt_dir = launches.start_attempt(rd)
    assert n == 0 and os.readlink(run / "logs/latest") == "attempt_0"
    assert not (run / "checkpoints/step_6").exists()  # partial checkpoint dropped
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["step_1", "step_2", "step_3", "step_4"]
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["step_0.pt", "step_1.pt", "step_2.pt", "step_3.pt"]
    assert "removed" in (attempt_dir / "rewind.log").read_text()
    assert launches.start_attempt(rd)[0] == 1


def squeue_fails(bin_dir: Path, how: str = "exit") -> None:
    """squeue that errors out (slurmctld down) or hangs (slurmctld wedged)."""
    body = "sleep 30" if how == "hang" else 'echo "squeue: error: Unable to contact slurm controller" >&2; exit 1'
    fake_commands(bin_dir, squeue=body)


@pytest.mark.parametrize("stderr, recorded, idle", [
    ("squeue: fatal: Could not establish a configuration source", False, True),  # client only, no cluster
    ("squeue: fatal: Could not establish a configuration source", True, False),  # ... but the run had a job
    ("squeue: error: Unable to contact slurm controller", False, False),  # a cluster that does not answer
])
def test_a_machine_without_a_cluster_is_not_a_cluster_that_does_not_answer(tmp_path, monkeypatch, stderr, recorded, idle):
    """A local-only run on a machine with SLURM's client installed but no cluster configured has no
    jobs; the same error for a run that did have a job, or a controller not answering, is unknown."""
    from prl.control import runstate, slurm
    from prl.run.rundir import RunDir

    fake_commands(tmp_path / "bin", squeue=f"echo '{stderr}' >&2\nexit 1")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    rd = RunDir(tmp_path / "run")
    rd.create("run: {}\n", "#!/bin/bash\n")
    if recorded:
        launches.record_submission(rd, "1001", ["prl", "submit"])
    if idle:
        runstate.ensure_idle(rd, "resume")
    else:
        with pytest.raises(slurm.SlurmUnknown, match="cannot tell"):
            runstate.ensure_idle(rd, "resume")


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_slurm_not_answering_is_unknown_and_destructive_commands_refuse(tmp_path, fake_slurm, how):
    bin_dir, state = fake_slurm
    prl("submit", TOY, f"run.output_dir={tmp_path / 'out'}", cwd=tmp_path, path_prefix=bin_dir)
    run = tmp_path / "out/toy"
    make_progress(run)
    before = sorted(str(p) for p in run.rglob("*"))
    squeue_fails(bin_dir, how)
    os.environ["PRL_SLURM_TIMEOUT_S"] = "1"
    try:
        r = prl("status", cwd=tmp_path, path_prefix=bin_dir)
        assert r.returncode == 0 and "1001 UNKNOWN: SLURM did not answer" in r.stdout
        for args in (["resume"], ["resume", "--step", "2"], ["cancel"],
                     ["submit", TOY, f"run.output_dir={tmp_path / 'out'}", "--resume", "trainer.lr=1e-5"],
                     ["submit", TOY, f"run.output_dir={tmp_path / 'out'}", "--clean"]):
            r = prl(*args, cwd=tmp_path, path_prefix=bin_dir)
            assert r.returncode == 1 and "cannot tell" in r.stderr, (args, r.stderr)
    finally:
        del os.environ["PRL_SLURM_TIMEOUT_S"]
    assert sorted(str(p) for p in run.rglob("*")) == before  # nothing removed, archived or rewritten
    assert "lr: 1.0e-05" not in (run / "config.yaml").read_text()
    assert (state / "next").read_text().strip() == "1001" and not (state / "scancel.argv").exists()


def test_a_job_slurm_holds_is_named_with_how_to_release_it(tmp_path, fake_slurm):
    """A requeued job whose launch failed is held (priority 0): it would wait forever. `prl resume` and
    `submit --resume` refuse as for any live job, saying it is held and how to release or cancel it;
    nothing is released or cancelled for the user."""
    bin_dir, state = fake_slurm
    prl("submit", TOY, f"run.output_dir={tmp_path / 'out'}", cwd=tmp_path, path_prefix=bin_dir)
    (state / "squeue").write_text("1001|PENDING|0:00||launch failed requeued held|N/A|/x/job.sbatch\n")
    for args in (["resume"], ["submit", TOY, f"run.output_dir={tmp_path / 'out'}", "--resume"]):
        r = prl(*args, cwd=tmp_path, path_prefix=bin_dir)
        assert r.returncode == 1 and "still has job 1001 (PENDING); SLURM holds 1001 (launch failed requeued held), " \
            "which starts only once released (scontrol release 1001): release it, or cancel it (prl cancel)" in r.stderr, r.stderr
    assert not (state / "scancel.argv").exists()


def test_a_job_sbatched_by_hand_belongs_to_the_run(tmp_path, fake_slurm):
    """Pending: found by its batch script in squeue; started: recorded in jobs.jsonl by the job itself."""
    bin_dir, state = fake_slurm
    prl("submit", TOY, f"run.output_dir={tmp_path / 'out'}", cwd=tmp_path, path_prefix=bin_dir)
    run = tmp_path / "out/toy"
    (state / "squeue").write_text(f"2002|PENDING|0:00||Priority|2026-11-23T12:00:00|{run}/job.sbatch\n"
                                  f"3003|RUNNING|0:01|node9|None|N/A|/elsewhere/job.sbatch\n")
    r = prl("status", cwd=tmp_path, path_prefix=bin_dir)
    assert "2002 PENDING (Priority), expected start 2026-11-23T12:00:00" in r.stdout and "3003" not in r.stdout
    r = prl("resume", "--dry-run", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 1 and "still has job 2002 (PENDING)" in r.stderr
    r = prl("submit", TOY, f"run.output_dir={tmp_path / 'out'}", "--resume", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 1 and "still has job 2002" in r.stderr

    # The job starts: it records itself; squeue no longer shows its script (say, a requeue under a new id).
    env = dict(os.environ, SLURM_JOB_ID="2002", SLURM_RESTART_COUNT="1")
    subprocess.run([sys.executable, "-m", "prl.run.launches", "new-attempt", str(run)], env=env, check=True, capture_output=True)
    (state / "squeue").write_text("2002|RUNNING|0:05|node3|None|N/A|/somewhere/else.sbatch\n")
    r = prl("cancel", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 0 and "cancelled 2002" in r.stdout
    (start,) = [json.loads(x) for x in (run / "jobs.jsonl").read_text().splitlines()]
    assert start["job_id"] == "2002" and start["restart"] == 1 and start["attempt"] == 0


def test_a_cancelled_run_does_not_start_again_until_resumed(tmp_path, fake_slurm):
    bin_dir, state = fake_slurm
    prl("submit", TOY, f"run.output_dir={tmp_path / 'out'}", cwd=tmp_path, path_prefix=bin_dir)
    run = tmp_path / "out/toy"
    (state / "squeue").write_text(f"1001|RUNNING|0:05|node3|None|N/A|{run}/job.sbatch\n")
    assert prl("cancel", cwd=tmp_path, path_prefix=bin_dir).returncode == 0
    for job in (None, "1001"):  # a launch that cannot say which job it is, and a requeue of the cancelled job
        env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"} | ({"SLURM_JOB_ID": job} if job else {})
        r = subprocess.run([sys.executable, "-m", "prl.run.launches", "new-attempt", str(run)], capture_output=True, text=True, env=env)
        assert r.returncode == 3 and "cancelled" in r.stderr and not (run / "logs/attempt_0").exists()
    (state / "squeue").write_text("")
    r = prl("resume", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 0 and not (run / "cancelled").exists()


def test_a_job_submitted_by_hand_after_cancel_continues_the_run(tmp_path, fake_slurm):
    """`prl cancel`, then `sbatch RUN/job.sbatch` (as its header says): the new job clears the mark,
    continues from the newest checkpoint and is the run's job in `prl status`."""
    bin_dir, state = fake_slurm
    prl("submit", TOY, f"run.output_dir={tmp_path / 'out'}", cwd=tmp_path, path_prefix=bin_dir)
    run = tmp_path / "out/toy"
    (run / "checkpoints/step_2").mkdir(parents=True)
    (run / "checkpoints/step_2/COMPLETE").touch()
    (run / "checkpoints/step_3").mkdir()  # cut short by the cancel: the new job drops it
    (state / "squeue").write_text(f"1001|RUNNING|0:05|node3|None|N/A|{run}/job.sbatch\n")
    assert prl("cancel", cwd=tmp_path, path_prefix=bin_dir).returncode == 0
    env = dict(os.environ, SLURM_JOB_ID="1002")
    r = subprocess.run([sys.executable, "-m", "prl.run.launches", "new-attempt", str(run)], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout == "0\n" and "job 1002 continues the run" in r.stderr
    assert not (run / "cancelled").exists() and not (run / "checkpoints/step_3").exists()
    assert (run / "checkpoints/step_2/COMPLETE").exists()
    (state / "squeue").write_text(f"1002|RUNNING|0:01|node4|None|N/A|{run}/job.sbatch\n")
    r = prl("status", str(run), cwd=tmp_path, path_prefix=bin_dir)
    assert "1002 RUNNING" in r.stdout and "1001 RUNNING" not in r.stdout
    # A requeue of the new job starts too: only the cancelled job's own requeues are stopped.
    r = subprocess.run([sys.executable, "-m", "prl.run.launches", "new-attempt", str(run)], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout == "1\n"


def test_an_unreadable_cancel_mark_refuses_every_launch(tmp_path):
    from prl.run.launches import cancelled_jobs

    assert cancelled_jobs('{"jobs": ["5", 6]}') == ["5", "6"]
    assert cancelled_jobs("prl cancel of job 1001, 1002 at 2026-11-20T10:00:00+0000\n") == ["1001", "1002"]  # older runs
    for mark in ("", "garbage", '{"jobs": []}', '{"jobs": "5"}', "[1, 2]"):
        assert cancelled_jobs(mark) is None, mark


def test_status_lists_each_attempt_with_its_checkpoints_and_why_it_ended(tmp_path, fake_slurm):
    bin_dir, state = fake_slurm
    prl("submit", TOY, f"run.output_dir={tmp_path / 'out'}", cwd=tmp_path, path_prefix=bin_dir)
    run = tmp_path / "out/toy"
    for n, job, ckpts, why in ((0, "1001", "step_2\nstep_4\n", "checkpointed before the time limit; requeueing job 1001"),
                               (1, "1001", "step_6\n", None)):
        env = dict(os.environ, SLURM_JOB_ID=job, SLURM_RESTART_COUNT=str(n))
        subprocess.run([sys.executable, "-m", "prl.run.launches", "new-attempt", str(run)], env=env, check=True, capture_output=True)
        (run / f"logs/attempt_{n}/checkpoints_done").write_text(ckpts)
        if why:
            (run / f"logs/attempt_{n}/ended").write_text(why + "\n")
    (state / "squeue").write_text(f"1001|RUNNING|0:30|node2|None|N/A|{run}/job.sbatch\n")
    r = prl("status", str(run), cwd=tmp_path, path_prefix=bin_dir)
    lines = r.stdout.splitlines()
    (a0,) = [x for x in lines if x.startswith("  0: ")]
    (a1,) = [x for x in lines if x.startswith("  1: ")]
    assert "job 1001 on" in a0 and "checkpoints: step_2, step_4; checkpointed before the time limit" in a0
    assert "job 1001 restart 1" in a1 and "checkpoints: step_6; running" in a1


def test_a_closed_pipe_is_quiet(tmp_path):
    model = ROOT / ".cache/tiny-qwen2"
    cmd = f"{sys.executable} -m prl.control.cli submit {TOY} run.output_dir={tmp_path / 'o'} model.name={model} --dry-run | head -1"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=tmp_path)  # toy's model is here
    assert r.stdout == "#!/bin/bash\n" and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr


@pytest.mark.parametrize("group_readable", [False, True])
def test_what_a_command_writes_into_a_run_has_the_runs_mode(tmp_path, group_readable):
    """prl eval, plot and cancel write into the run: under its umask, as its own processes do, whatever
    the user's (here 0: all for everyone); the run's mode says whether its group shares it."""
    from prl.control.cli import find_run
    from prl.run.rundir import RunDir

    rd = RunDir(tmp_path / "run")
    rd.create("{}\n", "#!/bin/bash\n", group_readable=group_readable)
    before = os.umask(0)
    try:
        assert find_run(str(rd.path)) == rd
        (rd.path / "metrics.png").write_bytes(b"png")
        (rd.path / "evals").mkdir()
    finally:
        os.umask(before)
    modes = [(rd.path / "metrics.png").stat().st_mode & 0o777, (rd.path / "evals").stat().st_mode & 0o777]
    assert modes == ([0o640, 0o750] if group_readable else [0o600, 0o700])
