"""The lifecycle rules of prl.run.supervise, one by one, with real processes as components (each a short
bash script standing in for a component's srun step) and `scontrol` replaced at the subprocess boundary.
The same rules run the batch job (tests/cluster/test_slurm.py, tests/cluster/test_slurm_rl.py, tests/cluster/test_chaos.py on
the test cluster) and local mode (tests/unit/test_local.py)."""

import os
import subprocess
import time
from pathlib import Path

import pytest

from prl.run import launches, protocol, supervise
from prl.run.rundir import RunDir
from prl.run.supervise import Launcher, Requeue, Supervisor

SERVER = "exec sleep 60"


class Scripts(Launcher):
    """Each component a bash script; `stop` ends what still runs, by PID."""

    def __init__(self, scripts: dict[str, str], cwd: Path):
        self.scripts, self.cwd, self.stopped = scripts, cwd, []

    def start(self, name):
        return subprocess.Popen(["bash", "-c", self.scripts.get(name, SERVER)], cwd=self.cwd)

    def stop(self, procs):
        for r in procs:
            if r.popen.poll() is None:
                self.stopped.append(r.name)
                r.popen.kill()
            r.popen.wait()


@pytest.fixture
def run(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.create("{}\n", "#!/bin/bash\n")
    n, _ = launches.new_attempt(rd)
    return rd, rd.attempt(n)


def supervise_with(run, scripts, requeue=None, **kw):
    rd, attempt = run
    launcher = Scripts(scripts, attempt.dir)
    sup = Supervisor(rd, attempt, launcher, max_steps=4, requeue=requeue, **kw)
    return sup.run(), attempt, launcher


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """A stand-in `scontrol` on PATH that records its arguments and exits with $SCONTROL_EXIT."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {calls}\n'
                                      '[ -n "${SCONTROL_HANG:-}" ] && sleep 30\n'
                                      'echo "scontrol: error: $SCONTROL_ERR" >&2; exit "${SCONTROL_EXIT:-0}"\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return calls


def test_run_complete_once_only_the_server_is_left(run):
    rc, attempt, launcher = supervise_with(run, {"trainer": "sleep 0.3", "orchestrator": "exit 0"})
    assert rc == 0 and attempt.read(protocol.ENDED) == "run complete\n"
    assert launcher.stopped == ["inference"] and not attempt.has(protocol.FAILED)


@pytest.mark.parametrize("name, status, code", [("orchestrator", 5, 13), ("trainer", 1, 12), ("inference", 0, 11)])
def test_the_first_failure_ends_the_attempt_with_its_status(run, name, status, code):
    """Any non-zero exit fails the attempt; a server's exit fails it whatever its status."""
    rc, attempt, launcher = supervise_with(run, {name: f"sleep 0.2; exit {status}"})
    assert rc == code
    assert attempt.read(protocol.FAILED) == f"{name} failed with exit status {status}\n"
    assert attempt.read(protocol.ENDED) == f"failed: {name} exited {status}\n"
    assert name not in launcher.stopped and len(launcher.stopped) == 2


def test_an_environment_server_is_a_server_its_death_ends_the_run_with_18(run):
    """The envserver (an entry's server_workers) is supervised as the inference server is: a kill -9 of it
    ends the attempt naming it; once only it and inference are left, the run is complete."""
    everything = (*protocol.RL_NAMES, "envserver")
    rc, attempt, launcher = supervise_with(run, {"envserver": "sleep 0.2; kill -9 $$"}, components=everything)
    assert rc == 18 and attempt.read(protocol.FAILED) == "envserver failed with exit status -9\n"
    assert sorted(launcher.stopped) == ["inference", "orchestrator", "trainer"]
    rd, _ = run
    n, _ = launches.new_attempt(rd)
    rc, attempt, launcher = supervise_with((rd, rd.attempt(n)), {"trainer": "sleep 0.3", "orchestrator": "exit 0"},
                                           components=everything)
    assert rc == 0 and attempt.read(protocol.ENDED) == "run complete\n"
    assert sorted(launcher.stopped) == ["envserver", "inference"]


def test_the_component_that_died_first_is_named_not_the_one_seen_first(run):
    """prl.run.node records the first leader to die; an orchestrator failing after its server is not the cause."""
    _, attempt = run
    attempt.marker(protocol.FIRST_FAILURE).write_text("inference 137 node1\n")
    rc, attempt, _ = supervise_with(run, {"orchestrator": "exit 1"})
    assert rc == 11 and attempt.read(protocol.FAILED) == "inference failed with exit status 137\n"


def test_a_stall_ends_the_attempt_with_16_and_says_what_stalled(run):
    script = f"echo 'orchestrator rank 0: a batch: nothing for 9s (limit 9s)' > {protocol.STALLED}; exit 16"
    rc, attempt, _ = supervise_with(run, {"orchestrator": script})
    assert rc == protocol.EXIT_STALLED
    assert attempt.read(protocol.FAILED).startswith("orchestrator rank 0: a batch")
    assert attempt.read(protocol.ENDED).startswith("stalled: orchestrator rank 0")


def test_a_stall_requeues_within_the_watchdog_budget(run, scontrol):
    script = f"echo 'trainer rank 0: a batch: nothing' > {protocol.STALLED}; exit 16"
    rc, attempt, _ = supervise_with(run, {"trainer": script}, requeue=Requeue("77", 2, True, 1))
    assert rc == protocol.EXIT_STALLED and scontrol.read_text() == "requeue 77\n"
    assert attempt.has(protocol.STALL_REQUEUED) and "requeueing job 77" in attempt.read(protocol.ENDED)
    rd, _ = run
    n, _ = launches.new_attempt(rd)  # the requeued job's attempt stalls too: the budget of 1 is spent
    rc, attempt, _ = supervise_with((rd, rd.attempt(n)), {"trainer": script}, requeue=Requeue("77", 2, True, 1))
    assert rc == protocol.EXIT_STALLED and scontrol.read_text() == "requeue 77\n"
    assert "requeue budget of 1 spent" in attempt.read(protocol.ENDED)


PREEMPTED_TRAINER = f"sleep 0.3; echo checkpointed > {protocol.PREEMPTED}; exit 1"


def test_usr1_checkpoint_requeues_the_job(run, scontrol):
    _, attempt = run
    attempt.marker(protocol.STOP_REQUEST).write_text("USR1 2026-11-26T10:00:00\n")
    rc, attempt, _ = supervise_with(run, {"trainer": PREEMPTED_TRAINER}, requeue=Requeue("77", 1, False, 0))
    assert rc == 0 and scontrol.read_text() == "requeue 77\n" and attempt.has(protocol.REQUEUED)
    assert attempt.read(protocol.ENDED) == "checkpointed before the time limit; requeueing job 77\n"


def test_usr1_checkpoint_with_the_budget_spent_ends_with_14(run, scontrol):
    rc, attempt, _ = supervise_with(run, {"trainer": PREEMPTED_TRAINER}, requeue=Requeue("77", 0, False, 0))
    assert rc == protocol.EXIT_MAX_REQUEUES and not scontrol.exists()
    assert "requeue budget of 0 spent" in attempt.read(protocol.ENDED)


def test_a_cancelled_run_is_not_requeued(run, scontrol):
    rd, _ = run
    rd.cancelled.write_text('{"jobs": ["77"]}\n')
    rc, attempt, _ = supervise_with(run, {"trainer": PREEMPTED_TRAINER}, requeue=Requeue("77", 3, False, 0))
    assert rc == 0 and not scontrol.exists() and not attempt.has(protocol.REQUEUED)
    assert "run cancelled, not requeued" in attempt.read(protocol.ENDED)


@pytest.mark.parametrize("failure", [{"SCONTROL_EXIT": "1", "SCONTROL_ERR": "Requested operation is disabled"},
                                     {"SCONTROL_HANG": "1"}])
def test_a_requeue_that_fails_or_hangs_says_so_and_is_not_counted(run, scontrol, monkeypatch, failure):
    for k, v in failure.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(supervise, "SLURM_TIMEOUT_S", 1.0)
    rc, attempt, _ = supervise_with(run, {"trainer": PREEMPTED_TRAINER}, requeue=Requeue("77", 3, False, 0))
    assert rc == protocol.EXIT_REQUEUE_FAILED and scontrol.read_text() == "requeue 77\n"
    assert not attempt.has(protocol.REQUEUED)  # the budget counts requeues that happened
    ended = attempt.read(protocol.ENDED)
    assert "scontrol requeue 77 failed" in ended and "prl resume" in ended
    assert ("Requested operation is disabled" in ended) if "SCONTROL_ERR" in failure else ("did not answer" in ended)


def test_after_term_the_others_may_exit_and_the_trainers_checkpoint_ends_the_job(run, scontrol):
    """Preemption or scancel: the orchestrator dying first is expected; the job ends once the trainer
    has checkpointed, with no requeue of its own (SLURM decides)."""
    _, attempt = run
    attempt.marker(protocol.STOP_REQUEST).write_text("TERM 2026-11-26T10:00:00\n")
    rc, attempt, _ = supervise_with(run, {"orchestrator": "exit 143", "trainer": PREEMPTED_TRAINER},
                                    requeue=Requeue("77", 3, False, 0))
    assert rc == 0 and not scontrol.exists()
    assert attempt.read(protocol.ENDED) == "preempted: checkpointed after SIGTERM\n"


def test_a_trainer_killed_by_slurm_before_its_checkpoint_is_not_a_complete_run(run):
    """scontrol requeue sends TERM and kills after KillWait: seen on GPUs, the job log said "run complete"."""
    _, attempt = run
    attempt.marker(protocol.STOP_REQUEST).write_text("TERM 2026-11-26T10:00:00\n")
    rc, attempt, _ = supervise_with(run, {"orchestrator": "exit 143", "trainer": "exit 0"})
    assert rc == 0
    assert attempt.read(protocol.ENDED) == ("stopped after SIGTERM: the trainer ended without a checkpoint; "
                                            "the run continues from the newest complete one\n")


def test_a_trainer_killed_after_its_final_checkpoint_completes_the_run(run):
    rd, _ = run
    (rd.checkpoint_dir(4)).mkdir(parents=True)
    (rd.checkpoint_dir(4) / protocol.COMPLETE).touch()
    rc, attempt, _ = supervise_with(run, {"trainer": "kill -TERM $$", "orchestrator": "exit 0"})
    assert rc == 0 and attempt.read(protocol.ENDED) == "run complete\n"


def test_a_local_interrupt_waits_for_the_checkpoint_only_so_long(run):
    _, attempt = run
    attempt.marker(protocol.STOP_REQUEST).write_text("INT 2026-11-26T10:00:00\n")
    t0 = time.monotonic()
    rc, attempt, launcher = supervise_with(run, {}, checkpoint_wait_s=0.5)
    assert rc == 0 and time.monotonic() - t0 < 10 and sorted(launcher.stopped) == sorted(protocol.RL_NAMES)
    assert attempt.read(protocol.ENDED) == "stopped: no checkpoint within 0.5s of the request\n"
