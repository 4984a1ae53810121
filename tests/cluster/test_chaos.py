"""Chaos on the test cluster: a toy RL run hit by random events at random moments must still end
COMPLETED with every attempt's per-step losses bitwise equal to the uninterrupted reference run's
(conftest.reference_record), and leave no process on any node. An event that was not delivered
fails the test: no event passes by being skipped.

    sudo bash tools/slurm_cluster.sh up && pytest tests/cluster/test_chaos.py   # one run, as in CI
    PRL_CHAOS_RUNS=10 bash tools/test.sh tests/cluster/test_chaos.py                     # the long setting (root)
    PRL_CHAOS_SEED=1234 PRL_CHAOS_RUNS=3 pytest tests/cluster/test_chaos.py     # replay a failure

The seed is the commit's (`git rev-parse HEAD`), so each commit draws other events and a failure
replays from the seed that its log prints; run n draws from Random(seed * 100 + n). The event log is
printed at the end of pytest's output, pass or fail, and kept as chaos.log in the test's tmp dir.

Events, each verified as delivered:
- usr1, term: `scancel --batch --signal`: the attempt's job.log gains "USR1: checkpoint requested",
  with " (received during setup)" exactly when drawn at `start` (before the script's traps exist),
  and its stop_requested file a "USR1 <time>" line.
- requeue: `scontrol requeue` succeeds, and a new attempt of the same job id starts (jobs.jsonl).
- node_down: a trainer node set DOWN (and back): SLURM requeues the job, as for requeue.
- kill9: `kill -9` of a component's main process, which existed then (a process already gone is
  not a kill: another component is drawn) and died.
Each event strikes the attempt after the one struck before: the job's next attempt or, once its
job has ended short of the run's end, the first attempt of the job `prl resume` submits; a moment
that attempt gets past fails the test. Moments: `start` (its setup, which a `sleep` setup line holds
open for SETUP_S seconds; a kill waits for its component to start), `first_batch` (the trainer has
started), `mid` (after the attempt's first step), `after_last` (right after the final checkpoint;
only ever the last event). A job that ends is continued with `prl resume`, first with `squeue`
failing, which must refuse and change nothing.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import (ROOT, STEPS, fake_commands, final_state, het_groups, hostnames, job_log, losses_by_attempt,
                     metrics, pid_of, prl, submit_rl, submitted_job, wait_for, wait_no_processes)

from prl.control import slurm
from prl.run import launches
from prl.run.protocol import STOP_REQUEST
from prl.run.rundir import RunDir

KINDS = ("usr1", "term", "requeue", "node_down", "kill9")
MOMENTS = ("start", "first_batch", "mid", "after_last")
COMPONENTS = ("inference", "trainer", "orchestrator")
RUNS = int(os.environ.get("PRL_CHAOS_RUNS") or 1)
SETUP_S = 4
DURING_SETUP = " (received during setup)"


def chaos_seed() -> tuple[int, str]:
    """(seed, where it comes from): PRL_CHAOS_SEED, else the checkout's commit."""
    if os.environ.get("PRL_CHAOS_SEED"):
        return int(os.environ["PRL_CHAOS_SEED"]), "PRL_CHAOS_SEED"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        return 0, "no git checkout"
    return int(head.stdout[:8], 16), f"commit {head.stdout[:12]}"


def draw(rng: random.Random) -> list[tuple[str, str]]:
    """Two (kind, moment) events in the order of their moments; after_last only for the last (the
    run is complete there: nothing comes after it)."""
    events = [(rng.choice(KINDS), rng.choice(MOMENTS[:-1])), (rng.choice(KINDS), rng.choice(MOMENTS))]
    return sorted(events, key=lambda e: MOMENTS.index(e[1]))


def signal_lines(attempt_dir: Path, name: str) -> tuple[list[str], int]:
    """(job.log's lines for the batch script's `name` (USR1, TERM) signals, stop_requested's count)."""
    log, stops = attempt_dir / "job.log", attempt_dir / STOP_REQUEST
    lines = [x for x in log.read_text().splitlines() if x.startswith(f"{name}: ")] if log.exists() else []
    count = sum(x.startswith(f"{name} ") for x in stops.read_text().splitlines()) if stops.exists() else 0
    return lines, count


def check_signal_line(line: str, name: str, moment: str) -> None:
    """The batch script's record of a signal drawn at `moment`: before its traps exactly at start."""
    want = f"{name}: checkpoint requested" + (DURING_SETUP if moment == "start" else "")
    assert line == want, f"{name.lower()}@{moment}: job.log says {line!r}, not {want!r}"


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_one(pid: Callable[[str], int], rng: random.Random, note: Callable[[str], None]) -> tuple[str, int]:
    """kill -9 of a component drawn by `rng` whose process `pid(component)` exists; one already gone
    is noted and another drawn; none left fails. Waits for the killed process to die."""
    left = list(COMPONENTS)
    while left:
        component = rng.choice(left)
        victim = pid(component)
        try:
            if not alive(victim):  # a zombie takes the signal without error: gone all the same
                raise ProcessLookupError
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            note(f"kill9: {component}'s pid {victim} already gone: drawn again")
            left.remove(component)
            continue
        wait_for(lambda: not alive(victim), 30, f"pid {victim} ({component}) to die after kill -9", poll_s=0.05)
        return component, victim
    pytest.fail("kill9: every component's process was already gone")


def check_losses(run: Path, reference: dict[int, float]) -> None:
    """Every step each attempt logged has the reference's loss, bit for bit; together they cover the run."""
    by_attempt = losses_by_attempt(run)
    for attempt, per_step in by_attempt.items():
        for step, loss in per_step.items():
            assert loss == reference[step], f"attempt {attempt} step {step}: loss {loss!r}, reference {reference[step]!r}"
    assert set().union(*by_attempt.values()) == set(range(STEPS)), by_attempt


class EventLog:
    """Lines printed (captured), appended to a file as they come, and shown at the end of the session."""

    def __init__(self, path: Path):
        self.path, self.lines, self.t0 = path, [], time.monotonic()

    def __call__(self, line: str) -> None:
        line = f"{time.monotonic() - self.t0:5.0f}s {line}"
        self.lines.append(line)
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


@pytest.fixture
def event_log(tmp_path, report_at_end):
    log = EventLog(tmp_path / "chaos.log")
    yield log
    report_at_end(f"chaos event log ({log.path})", "\n".join(log.lines))


class Chaos:
    """One chaos run: its run directory, its current job and the attempts struck so far."""

    def __init__(self, run: Path, job_id: str, note: EventLog, tmp: Path):
        self.run, self.rd, self.job_id, self.note, self.tmp = run, RunDir(run), job_id, note, tmp
        self.struck = -1
        self.final = run / f"checkpoints/step_{STEPS}/COMPLETE"
        self.asked = (0.0, True)

    def active(self) -> bool:
        """Whether the current job is queued or running, asked at most every 2 s (squeue and sacct
        take CPU from the run on a 2-core machine)."""
        if time.monotonic() - self.asked[0] > 2:
            st = slurm.job_states([self.job_id]).get(self.job_id)
            self.asked = (time.monotonic(), st is None or st.state in slurm.ACTIVE)  # None: not known yet
        return self.asked[1]

    def next_attempt(self) -> int:
        """The newest attempt after the one struck last, once it has started (resuming the run if
        its job ended short of the run's end)."""
        deadline = time.monotonic() + 900
        while not (newer := [s for s in launches.start_records(self.rd) if s["attempt"] > self.struck]):
            if not self.active():
                assert not self.final.exists(), "the run completed before the next event's attempt started"
                self.resume()
            assert time.monotonic() < deadline, "no new attempt within 900s"
            time.sleep(0.1)
        assert str(newer[-1]["job_id"]) == self.job_id, f"attempt {newer[-1]} is not of job {self.job_id}"
        return newer[-1]["attempt"]

    def reach(self, attempt: int, moment: str) -> None:
        """Wait for `moment` of `attempt`; fails if the attempt ends first."""
        d = self.run / f"logs/attempt_{attempt}"
        assert not self.final.exists(), f"the run is complete: {moment} of attempt {attempt} will not come"
        arrived = {"start": lambda: True, "first_batch": (d / "trainer/rank_0.log").exists,
                   "mid": lambda: metrics(self.run, attempt), "after_last": self.final.exists}[moment]

        def ready() -> bool:
            if arrived():
                return True
            newer = any(s["attempt"] > attempt for s in launches.start_records(self.rd))
            assert not newer and self.active(), f"attempt {attempt} ended before {moment}"
            return False

        wait_for(ready, 900, f"{moment} of attempt {attempt}")

    def hit(self, kind: str, moment: str, rng: random.Random) -> None:
        attempt = self.next_attempt()
        self.reach(attempt, moment)
        what = {"usr1": self.signal, "term": self.signal, "requeue": self.requeue, "node_down": self.node_down,
                "kill9": self.kill9}[kind](kind, moment, attempt, rng)
        self.note(f"{kind}@{moment}: job {self.job_id} attempt {attempt}: {what}")
        self.struck = attempt

    def signal(self, kind: str, moment: str, attempt: int, rng) -> str:
        name, d = kind.upper(), self.run / f"logs/attempt_{attempt}"
        lines, stops = signal_lines(d, name)
        slurm.scancel([self.job_id], signal=name, batch=True)

        def recorded():
            now = signal_lines(d, name)
            return now if len(now[0]) > len(lines) and now[1] > stops else None

        line = wait_for(recorded, 120, f"the batch script to record {name}")[0][len(lines)]
        check_signal_line(line, name, moment)
        return f"delivered: {line!r}"

    def requeue(self, kind: str, moment: str, attempt: int, rng) -> str:
        r = subprocess.run(["scontrol", "requeue", self.job_id], capture_output=True, text=True)
        assert r.returncode == 0, f"scontrol requeue {self.job_id} failed: {r.stderr}"
        return self.requeued(attempt)

    def node_down(self, kind: str, moment: str, attempt: int, rng: random.Random) -> str:
        show = subprocess.run(["scontrol", "show", "job", self.job_id], capture_output=True, text=True, check=True)
        victim = rng.choice(hostnames(het_groups(show.stdout)[1]["NodeList"]))  # het group 1: the trainer's
        subprocess.run(["scontrol", "update", f"NodeName={victim}", "State=DOWN", "Reason=chaos"], check=True)
        time.sleep(3)
        subprocess.run(["scontrol", "update", f"NodeName={victim}", "State=RESUME"], check=True)
        return f"{victim} down: " + self.requeued(attempt)

    def requeued(self, attempt: int) -> str:
        def again():
            return [s for s in launches.start_records(self.rd) if s["attempt"] > attempt and str(s["job_id"]) == self.job_id]

        start = wait_for(again, 300, f"job {self.job_id} to start again after attempt {attempt}")[0]
        return f"requeued: attempt {start['attempt']} (restart {start['restart']})"

    def kill9(self, kind: str, moment: str, attempt: int, rng: random.Random) -> str:
        component, pid = kill_one(lambda c: pid_of(self.run, attempt, c), rng, self.note)
        return f"{component} pid {pid} killed"

    def resume(self) -> None:
        st = slurm.job_states([self.job_id]).get(self.job_id)
        self.note(f"job {self.job_id} ended {st and st.state} {st and st.exit_code}: prl resume")
        wait_no_processes(self.run)
        self.job_id, self.asked = resume_refusing_unknown_first(self.run, self.tmp), (0.0, True)

    def finish(self) -> None:
        """Resume until the run's job ends COMPLETED with the final checkpoint (three resumes at most)."""
        for _ in range(4):
            st = final_state(self.job_id, timeout=900)
            if self.final.exists() and st.state == "COMPLETED":
                return
            self.resume()
        pytest.fail(f"run {self.run} not complete after three resumes")


def resume_refusing_unknown_first(run: Path, tmp: Path) -> str:
    """`prl resume` with squeue failing changes nothing (exit 1); then the real one: its job id."""
    bin_dir = fake_commands(tmp / "broken-slurm",
                            squeue="echo 'squeue: error: slurm_load_jobs error: Socket timed out' >&2\nexit 1")
    before = sorted(str(p) for p in run.rglob("*") if "logs" not in p.parts)
    r = prl("resume", str(run), cwd=run, path_prefix=bin_dir)
    assert r.returncode == 1 and "cannot tell" in r.stderr, r.stderr
    assert sorted(str(p) for p in run.rglob("*") if "logs" not in p.parts) == before
    return submitted_job(prl("resume", str(run), cwd=run))


@pytest.mark.slurm
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first run also waits for the session's reference run
@pytest.mark.parametrize("n", range(RUNS))
def test_chaos(reference_record, tmp_path, event_log, n):
    assert reference_record.state.state == "COMPLETED", job_log(reference_record.run)
    seed, origin = chaos_seed()
    rng = random.Random(seed * 100 + n)
    events = draw(rng)
    event_log(f"chaos run {n}: PRL_CHAOS_SEED={seed} ({origin}); events {events}")
    run, job_id = submit_rl(tmp_path, f"slurm.setup=[sleep {SETUP_S}]")
    chaos = Chaos(run, job_id, event_log, tmp_path)
    try:
        for kind, moment in events:
            chaos.hit(kind, moment, rng)
        chaos.finish()
    finally:  # a failing run must not hold the cluster's nodes for the tests after it
        subprocess.run(["scancel", *launches.job_ids(RunDir(run))], capture_output=True)
    wait_no_processes(run)
    check_losses(run, reference_record.losses)
    event_log(f"chaos run {n}: COMPLETED; every attempt's losses are the reference's ({losses_by_attempt(run)})")


# --- the checks themselves, without a cluster ---------------------------------------------------

def test_only_the_last_event_may_come_after_the_last_checkpoint():
    for seed in range(200):
        events = draw(random.Random(seed))
        assert [MOMENTS.index(m) for _, m in events] == sorted(MOMENTS.index(m) for _, m in events)
        assert events[0][1] != "after_last"


def test_a_signal_counts_once_recorded_and_only_as_drawn_around_the_traps(tmp_path):
    (tmp_path / "job.log").write_text(f"job 7 attempt 0\nUSR1: checkpoint requested{DURING_SETUP}\n"
                                      "TERM: checkpoint requested\nrun complete\n")
    (tmp_path / STOP_REQUEST).write_text("USR1 2026-01-01T00:00:00\nTERM 2026-01-01T00:00:09\n")
    assert signal_lines(tmp_path, "USR1") == ([f"USR1: checkpoint requested{DURING_SETUP}"], 1)
    assert signal_lines(tmp_path / "no attempt", "TERM") == ([], 0)
    check_signal_line(f"USR1: checkpoint requested{DURING_SETUP}", "USR1", "start")
    check_signal_line("TERM: checkpoint requested", "TERM", "mid")
    for line, moment in (("USR1: checkpoint requested", "start"), (f"USR1: checkpoint requested{DURING_SETUP}", "mid")):
        with pytest.raises(AssertionError, match="not"):
            check_signal_line(line, "USR1", moment)


def test_a_kill_of_a_process_already_gone_is_drawn_again_and_none_left_fails():
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        notes = []
        pids = {"inference": gone.pid, "trainer": gone.pid, "orchestrator": sleeper.pid}
        assert kill_one(pids.get, random.Random(0), notes.append) == ("orchestrator", sleeper.pid)
        assert sleeper.wait(5) == -signal.SIGKILL and len(notes) <= 2
        with pytest.raises(pytest.fail.Exception, match="already gone"):
            kill_one(lambda component: gone.pid, random.Random(0), notes.append)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_every_attempts_losses_are_compared_not_only_the_newest(tmp_path):
    def attempt(n: int, steps: dict[int, float]) -> None:
        d = tmp_path / f"logs/attempt_{n}/trainer"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "train/loss": {x}}}\n' for s, x in steps.items()))

    reference = {s: 1.0 / (s + 1) for s in range(STEPS)}
    attempt(0, {0: reference[0], 1: 0.123})  # step 1 ran again in attempt 1, this time right
    attempt(1, {s: reference[s] for s in range(1, STEPS)})
    with pytest.raises(AssertionError, match="attempt 0 step 1"):
        check_losses(tmp_path, reference)
    (tmp_path / "logs/attempt_0/trainer/metrics.jsonl").write_text(f'{{"step": 0, "train/loss": {reference[0]}}}\n')
    check_losses(tmp_path, reference)
    (tmp_path / "logs/attempt_1/trainer/metrics.jsonl").write_text(f'{{"step": 1, "train/loss": {reference[1]}}}\n')
    with pytest.raises(AssertionError):  # steps 2.. never ran
        check_losses(tmp_path, reference)


def test_the_seed_is_the_commits_unless_given(monkeypatch):
    monkeypatch.setenv("PRL_CHAOS_SEED", "1234")
    assert chaos_seed() == (1234, "PRL_CHAOS_SEED")
    monkeypatch.delenv("PRL_CHAOS_SEED")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    want = (int(head.stdout[:8], 16), f"commit {head.stdout[:12]}") if head.returncode == 0 else (0, "no git checkout")
    assert chaos_seed() == want
