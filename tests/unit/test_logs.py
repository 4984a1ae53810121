"""`prl logs`: prefixes, filters, and follow mode picking up files that appear later."""

import io
import threading
import time
from pathlib import Path

from prl.control.logview import log_files, show_logs
from prl.run.rundir import RunDir


def make_run(tmp_path) -> RunDir:
    rd = RunDir(tmp_path / "run")
    for attempt in (0, 1):
        base = rd.logs / f"attempt_{attempt}"
        (base / "trainer").mkdir(parents=True)
        (base / "inference").mkdir()
        (base / "job.log").write_text(f"job line a{attempt}\n")
        for rank in (0, 1):
            (base / "trainer" / f"rank_{rank}.log").write_text(f"loss a{attempt} r{rank}\n")
        (base / "trainer" / "node1.out").write_text("srun capture\n")
        (base / "inference" / "rank_0.log").write_text("server up\n")
    return rd


def test_every_file_of_the_newest_attempt_with_its_prefix(tmp_path):
    rd = make_run(tmp_path)
    out = io.StringIO()
    show_logs(rd, out=out)
    lines = out.getvalue().splitlines()
    assert "[attempt_1/job] job line a1" in lines
    assert "[attempt_1/trainer/rank_1] loss a1 r1" in lines
    assert "[attempt_1/inference/rank_0] server up" in lines
    assert len(lines) == 5  # the help says "default: the newest"; attempt_0 is left out


def test_every_attempt_when_asked(tmp_path):
    rd = make_run(tmp_path)
    out = io.StringIO()
    show_logs(rd, attempt="all", out=out)
    lines = out.getvalue().splitlines()
    assert "[attempt_0/job] job line a0" in lines and "[attempt_1/job] job line a1" in lines
    assert len(lines) == 2 * 5


def test_filters(tmp_path):
    rd = make_run(tmp_path)
    files = log_files(rd, component="trainer", rank=1, attempt=1)
    assert [f.relative_to(rd.logs).as_posix() for f in files] == ["attempt_1/trainer/rank_1.log"]
    assert [f.name for f in log_files(rd, "job", None, 0)] == ["job.log"]
    assert len(log_files(rd, "trainer", None, None)) == 3
    assert len(log_files(rd, "trainer", None, "all")) == 6


def test_follow_prints_new_lines_and_new_rank_files(tmp_path):
    rd = make_run(tmp_path)
    out = io.StringIO()
    t = threading.Thread(target=show_logs, kwargs=dict(rd=rd, component="trainer", follow=True, poll_s=0.05, out=out), daemon=True)
    t.start()
    time.sleep(0.3)
    with open(rd.logs / "attempt_1/trainer/rank_0.log", "a") as f:
        f.write("step 2 loss 0.5\npartial")
    (rd.logs / "attempt_1/trainer/rank_2.log").write_text("late rank\n")
    deadline = time.time() + 5
    while "late rank" not in out.getvalue() and time.time() < deadline:
        time.sleep(0.05)
    text = out.getvalue()
    assert "[attempt_1/trainer/rank_0] step 2 loss 0.5" in text
    assert "[attempt_1/trainer/rank_2] late rank" in text
    assert "partial" not in text  # only whole lines


def test_slurm_out_is_shown_with_the_job_logs(tmp_path):
    """Before an attempt's job.log exists (its bookkeeping failed), the batch script writes slurm-<id>.out."""
    rd = make_run(tmp_path)
    (rd.logs / "slurm-12.out").write_text("setup failed: python -m prl.run.launches new-attempt\n")
    out = io.StringIO()
    show_logs(rd, component="job", out=out)
    assert "[slurm-12] setup failed: python -m prl.run.launches new-attempt" in out.getvalue().splitlines()
    assert rd.logs / "slurm-12.out" not in log_files(rd, component="trainer", rank=None, attempt=None)


def test_follow_moves_on_to_a_new_attempt(tmp_path):
    rd = make_run(tmp_path)
    out = io.StringIO()
    t = threading.Thread(target=show_logs, kwargs=dict(rd=rd, component="trainer", follow=True, poll_s=0.05, out=out), daemon=True)
    t.start()
    time.sleep(0.3)
    (rd.logs / "attempt_2/trainer").mkdir(parents=True)
    (rd.logs / "attempt_2/trainer/rank_0.log").write_text("requeued and running\n")
    with open(rd.logs / "attempt_1/trainer/rank_0.log", "a") as f:
        f.write("last words of attempt 1\n")  # written after the new attempt appeared: still shown
    deadline = time.time() + 5
    while "last words" not in out.getvalue() or "requeued" not in out.getvalue():
        assert time.time() < deadline, out.getvalue()
        time.sleep(0.05)
    assert "[attempt_2/trainer/rank_0] requeued and running" in out.getvalue()
