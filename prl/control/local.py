"""Local mode: the same run, its three programs as processes on this machine, no SLURM.

    prl submit configs/toy.yaml --local

Same run directory, attempt logs and environment contract as the batch job, and the same lifecycle:
prl.run.supervise's Supervisor with local processes instead of srun steps (the first component to fail
ends the run, exit status 11/12/13 names it; no requeues). Children run in their own sessions and are
ended by process tree and group on the way out, so nothing is left behind, Ctrl-C and a closed
terminal (SIGHUP) included.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from prl.config import Config, ConfigError, envref
from prl.control import fork
from prl.control.progress import LiveLine
from prl.control.submit import PRL_HOME, prepare, write_run_dir
from prl.run import fence, launches, protocol
from prl.run.attempt import Attempt
from prl.run.launch import beside_cpu_vllm, local_command
from prl.run.procs import descendants, process_start, signal_procs
from prl.run.rundir import RunDir, complete_steps, not_private
from prl.run.supervise import Launcher, Running, Supervisor


CHECKPOINT_WAIT_S = 120.0
"""After an interrupt, how long the trainer may take to checkpoint before everything is stopped."""


def gpu_count() -> int:
    """GPUs on this machine, from nvidia-smi (no torch import in the control plane)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return out.stdout.count("GPU ") if out.returncode == 0 else 0


def visible_gpus(environ: dict[str, str], count: int) -> list[str]:
    """The GPUs local mode may use: those CUDA_VISIBLE_DEVICES lists (indices or UUIDs), or all `count`.

    A user who sets CUDA_VISIBLE_DEVICES=2,3 on a shared workstation means those two: handing the
    components 0 and 1 would land the run on a colleague's GPUs. An empty value hides every GPU, as
    CUDA reads it, and so does a negative entry for itself and what follows it (`-1` is the usual way
    to hide them all); on a machine without GPUs the variable names none."""
    if count == 0:
        return []
    if "CUDA_VISIBLE_DEVICES" not in environ:
        return [str(i) for i in range(count)]
    gpus = [gpu.strip() for gpu in environ["CUDA_VISIBLE_DEVICES"].split(",") if gpu.strip()]
    hidden = next((i for i, gpu in enumerate(gpus) if gpu.startswith("-")), len(gpus))
    return gpus[:hidden]


def gpu_assignment(cfg: Config, available: list[str]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES per component: inference first, then the trainer, on GPUs of their own.

    When the machine has too few GPUs for both but enough for each, both share the first ones
    (e.g. one GPU): vLLM then must leave room for the trainer (`inference.gpu_memory_utilization`).
    """
    n_inf = cfg.inference.gpus_per_node if "inference" in cfg.components else 0
    n_tr = cfg.trainer.gpus_per_node
    if n_inf + n_tr == 0:
        return {}
    ids = list(available)
    if n_inf + n_tr <= len(ids):
        return {"inference": ",".join(ids[:n_inf]), "trainer": ",".join(ids[n_inf:n_inf + n_tr])}
    if max(n_inf, n_tr) > len(ids):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f"{len(ids)} visible here" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
        raise ConfigError(f"inference.gpus_per_node/trainer.gpus_per_node: local mode needs {n_inf} + {n_tr} GPUs "
                          f"(inference + trainer, shared if need be); {where}")
    print(f"inference and trainer share GPU(s) {','.join(ids[:max(n_inf, n_tr)])}: vLLM takes "
          f"{cfg.inference.gpu_memory_utilization:.0%} of their memory (inference.gpu_memory_utilization)")
    return {"inference": ",".join(ids[:n_inf]), "trainer": ",".join(ids[:n_tr])}


def shared_gpus(gpus: dict[str, str]) -> bool:
    """Whether inference and trainer were given a GPU in common (gpu_assignment)."""
    ids = {name: set(gpus.get(name, "").split(",")) - {""} for name in ("inference", "trainer")}
    return bool(ids["inference"] & ids["trainer"])


def commands(cfg: Config, config_path: Path) -> dict[str, list[str]]:
    """Each component's command line on this machine (prl.run.launch builds them, as for srun). The
    trainer's rendezvous: on loopback, at a port it picks when it starts (prl.run.rendezvous)."""
    return {name: local_command(cfg, name, python=sys.executable, home=str(PRL_HOME), config=str(config_path),
                                endpoint="127.0.0.1:0") for name in cfg.components}


def base_env(cfg: Config, run_dir: Path, attempt: int, log_dir: Path) -> dict[str, str]:
    urls = ",".join(f"http://127.0.0.1:{port}/v1" for port in cfg.inference.ports)
    env = dict(os.environ) | envref.resolve(cfg.env, os.environ, "env")
    env |= {
        "PRL_RUN_DIR": str(run_dir), "PRL_LOG_DIR": str(log_dir), "PRL_ATTEMPT": str(attempt),
        "PRL_HOME": str(PRL_HOME), "PRL_PYTHON": sys.executable, protocol.NODE_RANK_ENV: "0",
        "PRL_INFERENCE_URLS": urls, fence.ENV: fence.identity(Attempt(log_dir)) or "",
        "MASTER_ADDR": "127.0.0.1",
    }
    return env


class LocalLauncher(Launcher):
    """Each component as a process group of its own on this machine, under prl.run.node as on a cluster
    node: orphans of the component (vLLM's engine core after its API server died) are re-parented
    to it and end with it."""

    def __init__(self, commands: dict[str, list[str]], envs: dict[str, dict[str, str]], attempt: Attempt):
        self.commands, self.envs, self.attempt = commands, envs, attempt

    def start(self, name: str) -> subprocess.Popen:
        out_path = self.attempt.node_output(name, "local")
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with open(out_path, "ab") as out:
            popen = subprocess.Popen([sys.executable, "-m", "prl.run.node", name, "--", *self.commands[name]],
                                     env=self.envs[name], stdout=out, stderr=subprocess.STDOUT, cwd=str(PRL_HOME),
                                     start_new_session=True)
        print(f"started {name} (pid {popen.pid}); log: {out_path}")
        return popen

    def stop(self, procs: list[Running], grace_s: float = 15) -> None:
        """SIGTERM to each leader first (vLLM's API server and torchrun shut their own children down
        in order), then SIGTERM to whatever of its tree is left, then SIGKILL."""
        # Taken before any signal: once a leader dies its children are re-parented and untraceable.
        trees = {p.popen.pid: descendants(p.popen.pid) for p in procs}
        for p in procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            deadline = time.monotonic() + wait_s
            for p in procs:
                try:
                    p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                _signal_tree(p, trees[p.popen.pid], sig)  # stragglers, or a leader that ignored TERM
        for p in procs:
            p.popen.wait()


def _signal_tree(p: Running, tree: list[tuple[int, int]], sig: int) -> None:
    """Signal the component's process group and every process it started that still lives; the
    start time guards against a PID reused since the tree was taken."""
    signal_procs(tree, sig)
    try:
        os.killpg(p.popen.pid, sig)
    except ProcessLookupError:
        pass


class Interrupts:
    """Ctrl-C, SIGTERM (`prl cancel`, `kill PID`) or SIGHUP (its terminal closed) of a local run: the
    first asks for a checkpoint, written as the batch script writes a signal (prl.run.supervise ends
    the run after it, and the components with it, by PID); a second skips the checkpoint."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, attempt: Attempt):
        self.attempt, self.count = attempt, 0

    def __call__(self, signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            self.detach()
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt
        with open(self.attempt.marker(protocol.STOP_REQUEST), "a") as f:
            f.write(f"INT {time.strftime('%Y-%m-%dT%H:%M:%S')} {signal.Signals(signum).name}\n")
        print("\ninterrupted: the trainer checkpoints, then every component stops (again: stop now)",
              file=sys.stderr, flush=True)

    def detach(self) -> None:
        """The terminal is gone: what the run still says goes to the attempt's job.log, as a batch
        job's does. A write to a hung-up terminal fails (EIO), which would end the run at once,
        without its checkpoint."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:
                pass
        fd = os.open(self.attempt.job_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, sys.stdout.fileno())
        os.dup2(fd, sys.stderr.fileno())
        os.close(fd)


def dry_run_lines(cfg: Config, rd: RunDir, gpus: dict[str, str]) -> list[str]:
    """`--local --dry-run`: each component's command, as it would start."""
    lines = []
    for name, cmd in commands(cfg, rd.config).items():
        extra = f"CUDA_VISIBLE_DEVICES={gpus[name]} " if name in gpus else ""
        lines.append(f"{name}: {extra}{shlex.join(cmd)}")
    return lines


def run_local(config_path: str, overrides: list[str], *, resume: bool = False, clean: bool = False,
              dry_run: bool = False, on_start=None, fork_from: str | None = None) -> int:
    cfg, rd, text = prepare(config_path, overrides, resume=resume, clean=clean, local=True)
    # Before anything is written: too few GPUs is bad input, and so is a checkpoint to fork that is not there.
    gpus = gpu_assignment(cfg, visible_gpus(os.environ, gpu_count()))
    forked = fork.plan(fork_from, cfg, rd) if fork_from else None
    moved = write_run_dir(cfg, rd, text, clean=clean)
    if forked:
        print(f"starts from {fork.apply(forked, rd)} (linked from {forked.checkpoint})")
    if dry_run:  # as `prl submit --dry-run`: the run directory written, nothing started
        if moved:
            print(f"moved the previous run to {moved}")
        print("\n".join(dry_run_lines(cfg, rd, gpus)))
        again = shlex.join(["prl", "submit", str(config_path), *overrides, "--local"])
        print(f"# dry run: wrote {rd.path}; start with: {again}")
        return 0
    if problem := not_private(rd):  # as every launch under SLURM (prl.run.launches.main)
        print(f"not starting: {problem}", file=sys.stderr)
        return 2
    attempt_n, log_dir = launches.start_attempt(rd, environ={})  # local: no job, as in jobs.jsonl
    attempt = Attempt(log_dir)
    launches.record_start(rd, attempt_n, env={}, pid=os.getpid(), pid_start=process_start(os.getpid()))
    print(f"run directory: {rd.path} (attempt {attempt_n})")
    if on_start is not None:
        on_start(rd)
    env = base_env(cfg, rd.path, attempt_n, log_dir)
    if cfg.inference.weight_transfer == "broadcast" and shared_gpus(gpus):
        env[protocol.WEIGHTS_BACKEND_ENV] = "gloo"  # NCCL refuses two ranks on one GPU
    envs = {name: env | envref.resolve(cfg.section(name).env, env, f"{name}.env")
            | ({"CUDA_VISIBLE_DEVICES": gpus[name]} if name in gpus else {}) for name in cfg.components}
    envs["trainer"] |= beside_cpu_vllm(cfg, envs["trainer"], local=True)
    launcher = LocalLauncher(commands(cfg, rd.config), envs, attempt)
    live = LiveLine(rd)
    interrupts = Interrupts(attempt)
    for sig in Interrupts.SIGNALS:
        signal.signal(sig, interrupts)
    sup = Supervisor(rd, attempt, launcher, max_steps=cfg.run.max_steps, components=cfg.components,
                     checkpoint_wait_s=CHECKPOINT_WAIT_S, on_poll=live.update, clear=live.clear)
    try:
        sup.start_all()
        print(f"logs: {log_dir}  (prl logs {shlex.quote(str(rd.path))} -f, or prl watch for all three side by side)")
        rc = sup.end(sup.watch())
    except KeyboardInterrupt:  # the second interrupt: stop now, without the checkpoint
        live.clear()
        launcher.stop(sup.procs)
    except BaseException:
        launcher.stop(sup.procs)
        raise
    if not interrupts.count:
        return rc
    steps = complete_steps(rd.checkpoints)
    again = shlex.join(["prl", "submit", str(config_path), *overrides, "--local", "--resume"])
    print(f"saved: checkpoints/step_{steps[-1]}" if steps else "no checkpoint was saved", file=sys.stderr)
    print(f"continue with: {again}", file=sys.stderr)
    return 130
