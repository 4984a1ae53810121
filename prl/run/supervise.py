"""The run's lifecycle, written once: start the components, watch them, and end the attempt by the
first rule that applies. The batch script hands over to it; local mode runs the same rules with
plain processes instead of srun.

    python -m prl.run.supervise RUN/config.yaml      # the batch script's last step (needs its environment)

Each time a component exits, in this order:
1. a component stalled (its watchdog wrote `stalled`): the attempt failed with EXIT_STALLED; under
   SLURM with watchdog.requeue the job is requeued instead, within watchdog.max_requeues;
2. the checkpointing component (the trainer) exited after a requested checkpoint (`preempted`): after
   TERM (preemption, scancel; local: Ctrl-C) the attempt ends, 0; after USR1 (the time limit is near)
   the job requeues itself within slurm.max_requeues (else EXIT_MAX_REQUEUES); local: ends, 0;
3. shutting down after TERM: another component's exit is expected; wait for the checkpoint;
4. the trainer's exit once the final checkpoint is complete is a success, whatever its status;
5. a server's exit, or any non-zero status: the component whose leader died first (prl.run.node's
   `first_failure`) failed, and the attempt ends with its exit status (11/12/13);
6. only servers are left: the run is complete, 0; after TERM without the final checkpoint (SLURM killed
   the trainer before its checkpoint was done) the attempt stopped, 0, and the next one resumes.

Signals reach this process as stop requests: the batch shell alone gets SLURM's warning signal
(`--signal=B:USR1`) and appends a line to `stop_requested`, which the trainer's ranks and this
supervisor read; a local run's supervisor takes SIGINT/SIGTERM itself and writes the same line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prl.config import envref
from prl.run import fence, launches, protocol
from prl.run.attempt import Attempt
from prl.run.rundir import RunDir, is_complete

STOP_GRACE_S = 30.0
"""How long srun steps get, after SIGTERM, to end their tasks before the batch script exits."""
POLL_S = 0.2
SLURM_TIMEOUT_S = 60.0
"""How long `scontrol requeue` may take before the supervisor counts it as failed."""


@dataclass
class Running:
    name: str
    popen: subprocess.Popen


@dataclass(frozen=True)
class Requeue:
    """Under SLURM: the job may requeue itself (the run directory counts the requeues)."""
    job_id: str
    max_requeues: int
    """slurm.max_requeues: requeues after a time-limit checkpoint."""
    on_stall: bool
    """watchdog.requeue: a stall requeues the job too, within `stall_max_requeues`."""
    stall_max_requeues: int


@dataclass(frozen=True)
class Outcome:
    why: str
    """The attempt's `ended` marker and last line: complete, failed, stalled, preempted, ..."""
    code: int
    requeue_marker: str | None = None
    """Set when the job should requeue itself: the marker this requeue counts under."""
    budget: int = 0
    budget_code: int = 0
    """The exit status when the budget of `requeue_marker` requeues is spent."""


class Launcher:
    """Starts a component and stops them all: srun in the batch job, local processes otherwise."""

    def start(self, name: str) -> subprocess.Popen:
        raise NotImplementedError

    def stop(self, procs: list[Running]) -> None:
        raise NotImplementedError


class Supervisor:
    def __init__(self, rd: RunDir, attempt: Attempt, launcher: Launcher, *, max_steps: int,
                 components: tuple[str, ...] = protocol.RL_NAMES, requeue: Requeue | None = None,
                 checkpoint_wait_s: float | None = None, on_poll: Callable[[], None] | None = None,
                 clear: Callable[[], None] | None = None):
        """`components`: the names of those the run starts (Config.components: an SFT job the trainer alone)."""
        self.rd, self.attempt, self.launcher, self.components = rd, attempt, launcher, components
        self.final = rd.checkpoint_dir(max_steps)
        self.requeue, self.checkpoint_wait_s = requeue, checkpoint_wait_s
        self.on_poll, self.clear = on_poll, clear
        self.procs: list[Running] = []
        self.shutdown_since: float | None = None  # when the first TERM/INT stop request was seen

    def say(self, text: str, err: bool = False) -> None:
        if self.clear is not None:
            self.clear()
        print(text, file=sys.stderr if err else sys.stdout, flush=True)

    def start_all(self) -> None:
        self.attempt.write(protocol.LAUNCHED, f"{time.time():.3f}\n")
        for name in self.components:
            self.procs.append(Running(name, self.launcher.start(name)))

    def shutting_down(self) -> bool:
        """A TERM (or a local INT) was requested: the job ends after the checkpoint, no requeue."""
        if self.shutdown_since is None:
            lines = (self.attempt.read(protocol.STOP_REQUEST) or "").splitlines()
            if any(line.split()[:1] in (["TERM"], ["INT"]) for line in lines):
                self.shutdown_since = time.monotonic()
        return self.shutdown_since is not None

    def run(self) -> int:
        """Start every component, supervise them to the attempt's end; the job's exit status."""
        try:
            self.start_all()
            outcome = self.watch()
        except BaseException:
            self.launcher.stop(self.procs)
            raise
        return self.end(outcome)

    def watch(self, poll_s: float = POLL_S) -> Outcome:
        running = list(self.procs)
        while True:
            if self.on_poll is not None:
                self.on_poll()
            terminated = self.shutting_down()
            for r in list(running):
                if (rc := r.popen.poll()) is None:
                    continue
                running.remove(r)
                self.say(f"{r.name} exited with status {rc}")
                if (outcome := self.on_exit(r.name, rc, terminated)) is not None:
                    return outcome
            if all(protocol.BY_NAME[r.name].must_stay_up for r in running):
                if terminated and not is_complete(self.final):
                    # scontrol requeue / scancel: SLURM killed the trainer before a checkpoint was done
                    return Outcome(f"stopped after SIG{self.shutdown_signal()}: the trainer ended without "
                                   "a checkpoint; the run continues from the newest complete one", 0)
                return Outcome("run complete", 0)
            if terminated and self.checkpoint_wait_s is not None and \
                    time.monotonic() - self.shutdown_since > self.checkpoint_wait_s:
                return Outcome(f"stopped: no checkpoint within {self.checkpoint_wait_s:g}s of the request", 0)
            time.sleep(poll_s)

    def on_exit(self, name: str, rc: int, terminated: bool) -> Outcome | None:
        """The rules of the module docstring, for one component's exit; None: keep going."""
        comp = protocol.BY_NAME[name]
        if (stalled := self.attempt.read(protocol.STALLED)) is not None:
            self.attempt.write(protocol.FAILED, stalled)
            why = f"stalled: {stalled.strip()}"
            if self.requeue is not None and self.requeue.on_stall:
                return Outcome(why, protocol.EXIT_STALLED, protocol.STALL_REQUEUED,
                               self.requeue.stall_max_requeues, protocol.EXIT_STALLED)
            return Outcome(why, protocol.EXIT_STALLED)
        if comp.torchrun and self.attempt.has(protocol.PREEMPTED):
            if terminated:
                return Outcome(f"preempted: checkpointed after SIG{self.shutdown_signal()}", 0)
            if self.requeue is None:
                return Outcome("stopped: checkpointed on request", 0)
            return Outcome("checkpointed before the time limit", 0, protocol.REQUEUED,
                           self.requeue.max_requeues, protocol.EXIT_MAX_REQUEUES)
        if terminated and not comp.torchrun:
            return None
        if comp.torchrun and is_complete(self.final):
            rc = 0  # a signal during the trainer's shutdown does not fail a finished run
        if comp.must_stay_up or rc != 0:
            first = self.first_failure() or (name, rc)
            why = f"{first[0]} failed with exit status {first[1]}"
            if (written := self.attempt.read(protocol.WRITE_FAILED)) is not None:
                why += f": cannot write: {written.strip()}"
            self.attempt.write(protocol.FAILED, why + "\n")
            self.say(f"{why}; stopping the run", err=True)
            return Outcome(f"failed: {first[0]} exited {first[1]}", protocol.BY_NAME[first[0]].exit_code)
        return None

    def shutdown_signal(self) -> str:
        lines = (self.attempt.read(protocol.STOP_REQUEST) or "").splitlines()
        return next((w[0] for w in map(str.split, lines) if w[:1] in (["TERM"], ["INT"])), "TERM")

    def first_failure(self) -> tuple[str, int] | None:
        """(component, status) that prl.run.node recorded as the first leader to die on its own."""
        words = (self.attempt.read(protocol.FIRST_FAILURE) or "").split()
        if len(words) >= 2 and words[0] in protocol.BY_NAME and words[1].lstrip("-").isdigit():
            return words[0], int(words[1])
        return None

    def end(self, outcome: Outcome) -> int:
        """Stop every component, requeue the job if the outcome asks for it, record why it ended."""
        self.launcher.stop(self.procs)
        why, code = outcome.why, outcome.code
        if outcome.requeue_marker is not None:
            why, code = self.requeue_job(outcome)
        self.attempt.write(protocol.ENDED, why + "\n")
        self.say(why, err=code != 0)
        return code

    def requeue_job(self, outcome: Outcome) -> tuple[str, int]:
        """`scontrol requeue` of this job, unless its budget is spent or the run was cancelled."""
        marker = outcome.requeue_marker
        used = sum(1 for n in launches.attempts(self.rd) if self.rd.attempt(n).has(marker))
        if used >= outcome.budget:
            return f"{outcome.why}; requeue budget of {outcome.budget} spent", outcome.budget_code
        if self.rd.cancelled.exists():
            return f"{outcome.why}; run cancelled, not requeued", 0
        self.attempt.write(marker, f"{self.requeue.job_id}\n")
        r = run_quietly(["scontrol", "requeue", self.requeue.job_id])
        if r is None or r.returncode != 0:
            err = "did not answer" if r is None else (r.stderr.strip() or f"exit status {r.returncode}")
            self.attempt.marker(marker).unlink(missing_ok=True)
            return (f"{outcome.why}; scontrol requeue {self.requeue.job_id} failed ({err}): "
                    f"prl resume {self.rd.path} continues the run"), protocol.EXIT_REQUEUE_FAILED
        return f"{outcome.why}; requeueing job {self.requeue.job_id}", outcome.code


def run_quietly(argv: list[str]) -> subprocess.CompletedProcess | None:
    """A SLURM command; None when it hangs past SLURM_TIMEOUT_S or cannot be started."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except (subprocess.TimeoutExpired, OSError):
        return None


class SrunLauncher(Launcher):
    """Each component as one srun step of the batch job (prl.run.launch builds its command line)."""

    def __init__(self, cfg, wiring, batch_python: str):
        self.cfg, self.wiring, self.batch_python = cfg, wiring, batch_python

    def start(self, name: str) -> subprocess.Popen:
        from prl.run.launch import component_env, srun_command

        # The env section's ${oc.env:...} references are resolved here, in the job (prl.config.envref).
        env = dict(os.environ) | envref.resolve(component_env(self.cfg, name, self.batch_python), os.environ,
                                                f"{name}.env")
        popen = subprocess.Popen(srun_command(self.cfg, name, self.wiring), env=env)
        print(f"started {name} (pid {popen.pid}); log: {Path(self.wiring.log_dir) / name}", flush=True)
        return popen

    def stop(self, procs: list[Running]) -> None:
        """SIGTERM to each srun (it passes it to its tasks), then up to STOP_GRACE_S for all to end;
        what is left SLURM ends with the job."""
        for r in procs:
            if r.popen.poll() is None:
                r.popen.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for r in procs:
            try:
                r.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def main(argv: list[str] | None = None) -> int:
    """The batch job's supervisor: its environment is the batch script's (PRL_RUN_DIR, PRL_LOG_DIR,
    SLURM_JOB_ID, MASTER_ADDR, ...); USR1 and TERM arrive ignored (the shell writes them down)."""
    from prl.config import load_config
    from prl.run.launch import Wiring

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m prl.run.supervise RUN/config.yaml", file=sys.stderr)
        return 2
    for sig in (signal.SIGUSR1, signal.SIGTERM):  # the batch shell records them; see the docstring
        signal.signal(sig, signal.SIG_IGN)
    cfg = load_config(args[0])
    env = os.environ
    rd, attempt = RunDir(Path(env["PRL_RUN_DIR"])), Attempt.current()
    env[fence.ENV] = fence.identity(attempt) or ""  # the components' srun steps take it along
    requeue = Requeue(env["SLURM_JOB_ID"], cfg.slurm.max_requeues, cfg.watchdog.requeue, cfg.watchdog.max_requeues)
    launcher = SrunLauncher(cfg, Wiring.from_env(env), batch_python=env["PRL_PYTHON"])
    return Supervisor(rd, attempt, launcher, max_steps=cfg.run.max_steps, components=cfg.components,
                      requeue=requeue).run()


if __name__ == "__main__":
    raise SystemExit(main())
