"""`prl status`, `prl runs` and the progress they show, from fake run directories; squeue/sacct are
replaced at the subprocess boundary (tests/unit/test_cli.py's fake_slurm) or their parsing is fed rows."""

import dataclasses
import itertools
import json
import time

import pytest
from helpers import fake_commands, fake_run, prl

from prl.control import slurm
from prl.control.progress import Progress
from prl.run import launches
from prl.run.rundir import RunDir

# --- slurm: het components in any order -------------------------------------------------------

HET_ROWS = [slurm.JobState("1001+0", "FAILED", "00:01:00", "node1", "12:0"),
            slurm.JobState("1001+1", "FAILED", "00:01:00", "node[2-3]", "1:0"),
            slurm.JobState("1001+2", "CANCELLED", "00:01:00", "node4", "0:15")]


@pytest.mark.parametrize("rows", list(itertools.permutations(HET_ROWS)))
def test_a_het_job_is_its_leader_whatever_the_row_order(rows):
    (st,) = slurm._fold(list(rows)).values()
    assert (st.job_id, st.state, st.exit_code) == ("1001", "FAILED", "12:0")
    assert st.het_nodes == ((0, "node1"), (1, "node[2-3]"), (2, "node4"))


def test_a_plain_job_keeps_its_first_row_and_has_no_het_nodes():
    rows = [slurm.JobState("7", "COMPLETED", nodes="n1"), slurm.JobState("7", "REQUEUED", nodes="n2"),
            slurm.JobState("7.batch", "COMPLETED")]
    assert slurm._fold(rows) == {"7": slurm.JobState("7", "COMPLETED", nodes="n1")}


# --- progress ---------------------------------------------------------------------------------

def test_progress_counts_steps_over_attempts_with_median_eta_and_age(tmp_path):
    p = Progress.of(fake_run(tmp_path, steps=4, step_s=2.0, last_age_s=3.0))
    assert (p.steps_done, p.max_steps, p.median_step_s, p.eta_s) == (4, 10, 2.0, 12.0)
    assert 2.5 < p.last_step_age_s < 10 and p.reward == pytest.approx(0.3) and not p.stalled
    assert p.line().startswith("step 4/10 | reward 0.300 | 2.0 s/step | ETA 12s | last step ")


def test_trainer_idle_and_gpu_peak_show_when_the_trainer_reports_them(tmp_path):
    rd = fake_run(tmp_path, steps=4, attempts=1)
    path = rd.logs / "attempt_0/trainer/metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    # step 0 waited for vLLM to start (0.9 of it); the median (of 0.9, 0.25, 0.5, 0.3) is what the run does now
    waits, peaks = [90.0, 0.5, 1.0, 0.6], [38.0, 52.4, 52.4, float("nan")]
    path.write_text("".join(json.dumps(r | {"perf/step_s": 2.0 if r["step"] else 100.0, "perf/wait_s": w,
                                            "perf/peak_memory_gib": m}) + "\n" for r, w, m in zip(records, waits, peaks)))
    p = Progress.of(rd)
    assert p.trainer_idle == pytest.approx(0.4) and p.peak_memory_gib == 52.4
    assert "| trainer idle 40% | trainer GPU peak 52.4 GiB |" in p.line()
    assert Progress.from_dict(p.as_dict()) == p
    # a CPU run (no peak), and a status record written before these fields existed
    p = Progress.of(fake_run(tmp_path, name="cpu"))
    assert p.trainer_idle is None and p.peak_memory_gib is None and "idle" not in p.line()
    old = {k: v for k, v in p.as_dict().items() if k not in ("trainer_idle", "peak_memory_gib")}
    assert Progress.from_dict(old) == p


def test_a_stall_shows(tmp_path):
    p = Progress.of(fake_run(tmp_path, step_s=2.0, last_age_s=600))
    assert p.stalled and "last step 10m00s ago (stalled?)" in p.line()
    assert "stalled" not in p.line(live=False) and "ETA" not in p.line(live=False)


def test_no_metrics_yet(tmp_path):
    p = Progress.of(fake_run(tmp_path, steps=0, attempts=1))
    assert p.line() == "step 0/10"


# --- prl status / prl runs through the CLI, SLURM faked -----------------------------------------

@pytest.fixture
def fake_slurm(tmp_path):
    """squeue and sacct answer what slurm_state/{squeue,sacct} hold."""
    state = tmp_path / "slurm_state"
    state.mkdir()
    bodies = {name: f"cat {state}/{name} 2>/dev/null || true" for name in ("squeue", "sacct")}
    return fake_commands(tmp_path / "bin", **bodies), state


def submitted(rd: RunDir, job_id: str) -> None:
    launches.record_submission(rd, job_id, ["prl", "submit"])


def test_status_of_a_running_het_job(tmp_path, fake_slurm):
    bin_dir, state = fake_slurm
    rd = fake_run(tmp_path)
    submitted(rd, "1001")
    (rd.checkpoints / "step_2").mkdir(parents=True)
    (rd.checkpoints / "step_2/COMPLETE").touch()
    (rd.checkpoints / "step_4").mkdir()  # incomplete: not listed
    (rd.path / "evals").mkdir()
    (rd.path / "evals/step_2.json").write_text('{"reward_mean": 0.25, "n": 64}')
    (rd.path / "wandb_id").write_text("abc123\n")
    (rd.path / "wandb/offline-run-20260101_000000-abc123").mkdir(parents=True)
    (state / "squeue").write_text("1001+2|RUNNING|5:00|node4|None|N/A|x\n1001+1|RUNNING|5:00|node[2-3]|None|N/A|x\n"
                                  "1001+0|RUNNING|5:00|node1|None|N/A|x\n")
    r = prl("status", str(rd.path), path_prefix=bin_dir)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "job:         1001 RUNNING 5:00\n" in out
    assert "nodes:       inference node1; trainer node[2-3]; orchestrator node4" in out
    assert "progress:    step 4/10 | reward 0.300 | 2.0 s/step | ETA 12s | last step " in out
    assert "checkpoints: step_2\n" in out
    assert "evals:       step 2 reward 0.250" in out
    assert f"wandb:       run id abc123 (offline); upload with: wandb sync {rd.path}/wandb/offline-run-*" in out

    data = json.loads(prl("status", str(rd.path), "--json", path_prefix=bin_dir).stdout)
    assert data["job"]["nodes"] == {"inference": "node1", "trainer": "node[2-3]", "orchestrator": "node4"}
    assert data["progress"]["steps_done"] == 4 and data["progress"]["eta_s"] == 12.0 and data["live"]
    assert data["checkpoints"] == [2] and data["evals"][0]["reward_mean"] == 0.25


def test_status_names_the_failed_component_from_the_leader_row(tmp_path, fake_slurm):
    bin_dir, state = fake_slurm
    rd = fake_run(tmp_path)
    submitted(rd, "1001")
    # As an accounting database may return them: the leader (the batch script, exit 12) not first.
    (state / "sacct").write_text("1001+2|CANCELLED by 0|00:01:00|node4|0:15\n1001+1|FAILED|00:01:00|node2|1:0\n"
                                 "1001+0|FAILED|00:01:00|node1|12:0\n")
    r = prl("status", str(rd.path), path_prefix=bin_dir)
    assert "job:         1001 FAILED 00:01:00 exit=12:0 (trainer failed)" in r.stdout
    assert "ETA" not in r.stdout  # nothing runs


def test_status_of_a_pending_job(tmp_path, fake_slurm):
    bin_dir, state = fake_slurm
    rd = fake_run(tmp_path, steps=0, attempts=0)
    submitted(rd, "1001")
    (state / "squeue").write_text("1001+0|PENDING|0:00||Resources|2026-11-23T12:00:00|x\n"
                                  "1001+1|PENDING|0:00||Resources|2026-11-23T12:00:00|x\n")
    out = prl("status", str(rd.path), path_prefix=bin_dir).stdout
    assert "1001 PENDING (Resources), expected start 2026-11-23T12:00:00" in out and "held" not in out
    # A job requeued onto a node that still held its last launch's steps (the test cluster's node DOWN for
    # 3 s, then RESUME): SLURM holds it, and it waits for a release, not for resources.
    (state / "squeue").write_text("1001|PENDING|0:00||launch failed requeued held|N/A|x\n")
    out = prl("status", str(rd.path), path_prefix=bin_dir).stdout
    assert ("1001 PENDING (launch failed requeued held), expected start N/A: held, it starts only once released "
            "(scontrol release 1001)") in out, out


def test_runs_lists_every_run_with_its_state(tmp_path, fake_slurm):
    bin_dir, state = fake_slurm
    out_dir = tmp_path / "out"
    a, b, c = fake_run(out_dir, "a"), fake_run(out_dir, "b", steps=10), fake_run(out_dir, "c", steps=0, attempts=0)
    submitted(a, "1001")
    (b.logs / "attempt_1/ended").write_text("run complete\n")
    (out_dir / "not-a-run").mkdir()
    (state / "squeue").write_text("1001|RUNNING|5:00|node1|None|N/A|x\n")
    r = prl("runs", str(out_dir), path_prefix=bin_dir)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [x.split()[0] for x in lines] == ["a", "b", "c"]
    assert "RUNNING (job 1001)" in lines[0] and "step 4/10" in lines[0] and "ETA" in lines[0]
    assert "run complete" in lines[1] and "step 10/10" in lines[1]
    assert "not started" in lines[2]
    rows = json.loads(prl("runs", str(out_dir), "--json", path_prefix=bin_dir).stdout)
    assert [r["run"] for r in rows] == ["a", "b", "c"]


def test_runs_without_dir_lists_where_submit_puts_runs(tmp_path, fake_slurm, monkeypatch):
    """Not the current directory: run.output_dir's default, resolved as prl submit resolves it."""
    from prl.config import RunConfig, load_config
    from prl.control.submit import resolve

    bin_dir, _ = fake_slurm
    default = {f.name: f.default for f in dataclasses.fields(RunConfig)}["output_dir"]
    config = tmp_path / "c.yaml"
    config.write_text(f"run: {{name: a}}\nmodel: {{name: m}}\norchestrator: {{environment: {{id: prl.envs.toy}}}}\n")
    cwd, other = tmp_path / "here", tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # resolve() takes a relative output_dir from the current directory, as prl submit does
    submitted_to = resolve(load_config(config)).run.run_dir
    assert submitted_to == cwd / default / "a"
    fake_run(submitted_to.parent, "a")
    fake_run(cwd, "not-listed")  # a run directory in the current directory itself is not under the default

    r = prl("runs", path_prefix=bin_dir, cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in r.stdout.splitlines()] == ["a"]
    assert f"runs under {cwd / default} (run.output_dir's default)" in r.stderr

    other.mkdir()
    r = prl("runs", path_prefix=bin_dir, cwd=other)
    assert r.returncode == 2 and f"no DIR given, and {other / default} (run.output_dir's default" in r.stderr


def test_runs_says_unknown_when_squeue_fails(tmp_path, fake_slurm):
    bin_dir, _ = fake_slurm
    fake_commands(bin_dir, squeue="echo 'squeue: error: Unable to contact slurm controller' >&2\nexit 1")
    submitted(fake_run(tmp_path / "out", "a"), "1001")
    r = prl("runs", str(tmp_path / "out"), path_prefix=bin_dir)
    assert "UNKNOWN (SLURM did not answer)" in r.stdout


# --- the local run's live line -------------------------------------------------------------------

class Term:
    """A stream that says whether it is a terminal, and keeps what was written."""

    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def add_step(rd: RunDir, step: int) -> None:
    with open(rd.logs / "attempt_1/trainer/metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "time": time.time(), "perf/step_s": 2.0, "rollout/reward_mean": 0.5}) + "\n")


def test_live_line_in_a_log_file_is_one_line_per_step(tmp_path):
    from prl.control.progress import LiveLine

    rd = fake_run(tmp_path, steps=4)
    term = Term(tty=False)
    live = LiveLine(rd, term, every_s=0)
    live.update()
    live.update()  # no new step: nothing new
    add_step(rd, 4)
    live.update()
    lines = term.text.splitlines()
    assert [x.split(" | ")[0] for x in lines] == ["step 4/10", "step 5/10"] and "\r" not in term.text
    assert "ETA 10s" in lines[1]


def test_live_line_on_a_terminal_is_redrawn_in_place_and_cleared(tmp_path):
    from prl.control.progress import LiveLine

    rd = fake_run(tmp_path, steps=0, attempts=2)
    term = Term(tty=True)
    live = LiveLine(rd, term, every_s=0)
    live.update()
    assert term.text == "\r\x1b[Kstep 0/10 | waiting for the first step"
    add_step(rd, 0)
    live.update()
    assert term.text.endswith("\r\x1b[Kstep 1/10 | reward 0.500 | 2.0 s/step | ETA 18s | last step 0s ago")
    live.clear()
    assert term.text.endswith("\r\x1b[K") and "\n" not in term.text


def test_status_shows_the_newest_steps_truncation_rate_per_environment(tmp_path):
    from prl.control.status import status_lines

    rd = fake_run(tmp_path, steps=3, attempts=1)
    path = rd.logs / "attempt_0/trainer/metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    shares = [(0.5, 0.0), (0.25, 0.125), (0.75, 0.0)]
    path.write_text("".join(json.dumps(r | {"env/toy/truncated_frac": a, "env/rev/truncated_frac": b,
                                            "rollout/overlong_masked": 6.0 * a}) + "\n"
                            for r, (a, b) in zip(records, shares)))
    line = next(x for x in status_lines(rd) if x.startswith("truncated:"))
    assert line == f"truncated:   rev 0%, toy 75% of step {records[-1]['step']}'s rollouts (4 masked)"
    assert not any(x.startswith("truncated:") for x in status_lines(fake_run(tmp_path, name="old")))  # no such metrics
