"""Local mode: the same run, its three programs as processes on this machine, no SLURM.

    prl submit configs/toy.yaml --local

Mirrors the batch script (templates/job.sbatch.j2): same run directory, same attempt logs, same
environment contract, same rule that the first component to fail ends the run (exit status 11/12/13
names it). Children run in their own sessions and are ended by process-group id on the way out,
so nothing is left behind, Ctrl-C included.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from prl import protocol
from prl.config import Config, ConfigError
from prl.progress import LiveLine
from prl.procs import descendants, process_start, signal_procs
from prl.rundir import is_complete
from prl.submit import PRL_HOME, prepare, write_run_dir


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count() -> int:
    """GPUs on this machine, from nvidia-smi (no torch import in the control plane)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return out.stdout.count("GPU ") if out.returncode == 0 else 0


def gpu_assignment(cfg: Config, available: int) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES per component: inference first, then the trainer, on GPUs of their own.

    When the machine has too few GPUs for both but enough for each, both share the first ones
    (e.g. one GPU): vLLM then must leave room for the trainer (`inference.gpu_memory_utilization`).
    """
    n_inf, n_tr = cfg.inference.gpus_per_node, cfg.trainer.gpus_per_node
    if n_inf + n_tr == 0:
        return {}
    ids = [str(i) for i in range(available)]
    if n_inf + n_tr <= available:
        return {"inference": ",".join(ids[:n_inf]), "trainer": ",".join(ids[n_inf:n_inf + n_tr])}
    if max(n_inf, n_tr) > available:
        raise ConfigError(f"inference.gpus_per_node/trainer.gpus_per_node: local mode needs {n_inf} + {n_tr} GPUs "
                          f"(inference + trainer, shared if need be); this machine has {available}")
    print(f"inference and trainer share GPU(s) {','.join(ids[:max(n_inf, n_tr)])}: vLLM takes "
          f"{cfg.inference.gpu_memory_utilization:.0%} of their memory (inference.gpu_memory_utilization)")
    return {"inference": ",".join(ids[:n_inf]), "trainer": ",".join(ids[:n_tr])}


def shared_gpus(gpus: dict[str, str]) -> bool:
    """Whether inference and trainer were given a GPU in common (gpu_assignment)."""
    ids = {name: set(gpus.get(name, "").split(",")) - {""} for name in ("inference", "trainer")}
    return bool(ids["inference"] & ids["trainer"])


def commands(cfg: Config, config_path: Path) -> dict[str, list[str]]:
    py, jobs = sys.executable, PRL_HOME / "jobs"
    probe = cfg.run.mode == "probe"

    def entry(name: str) -> list[str]:
        return [str(jobs / "probe.py"), name] if probe else [str(jobs / f"{name}.py")]

    torchrun = [py, "-m", "torch.distributed.run", protocol.TORCHRUN_SIGNALS, "--nnodes=1", f"--nproc-per-node={max(cfg.trainer.gpus_per_node, 1)}",
                "--rdzv-backend=static", "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT", "--node-rank=0"]
    return {
        "inference": [py, *entry("inference"), str(config_path)],
        "trainer": [*torchrun, *entry("trainer"), str(config_path)],
        "orchestrator": [py, *entry("orchestrator"), str(config_path)],
    }


def base_env(cfg: Config, run_dir: Path, attempt: int, log_dir: Path) -> dict[str, str]:
    port = cfg.inference.port
    env = dict(os.environ) | cfg.env
    env |= {
        "PRL_RUN_DIR": str(run_dir), "PRL_LOG_DIR": str(log_dir), "PRL_ATTEMPT": str(attempt),
        "PRL_HOME": str(PRL_HOME), "PRL_PYTHON": sys.executable, "PRL_NODE_RANK": "0",
        "PRL_INFERENCE_URLS": f"http://127.0.0.1:{port}/v1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
        "DATA_PARALLEL_ADDRESS": "127.0.0.1", "DATA_PARALLEL_RPC_PORT": str(free_port()),
    }
    if cfg.inference.weight_transfer == "broadcast":
        env[protocol.WEIGHTS_PORT_ENV] = str(free_port())  # trainer rank 0's handshake store (prl.broadcast)
    return env


def start(name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> Proc:
    (log_dir / name).mkdir(parents=True, exist_ok=True)
    out = open(log_dir / name / "local.out", "ab")
    argv = [a.replace("$MASTER_ADDR", env["MASTER_ADDR"]).replace("$MASTER_PORT", env["MASTER_PORT"]) for a in argv]
    # prl.node, as on a cluster node: orphans of the component (vLLM's engine core after its API
    # server died) are re-parented to it and end with it.
    argv = [sys.executable, "-m", "prl.node", name, "--", *argv]
    popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(PRL_HOME),
                             start_new_session=True)
    out.close()
    print(f"started {name} (pid {popen.pid}); log: {log_dir / name / 'local.out'}")
    return Proc(name, popen)


def _signal_tree(p: Proc, tree: list[tuple[int, int]], sig: int) -> None:
    """Signal the component's process group and every process it started that still lives; the
    start time guards against a PID reused since the tree was taken."""
    signal_procs(tree, sig)
    try:
        os.killpg(p.popen.pid, sig)
    except ProcessLookupError:
        pass


def stop_all(procs: list[Proc], grace_s: float = 15) -> None:
    """Stop every component: SIGTERM to each leader first (vLLM's API server and torchrun shut their
    own children down in order), then SIGTERM to whatever of its tree is left, then SIGKILL."""
    # Taken before any signal: once a leader dies its children are re-parented and untraceable.
    trees = {p.popen.pid: descendants(p.popen.pid) for p in procs}
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _signal_tree(p, trees[p.popen.pid], signal.SIGTERM)  # stragglers, or a leader that ignored it
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _signal_tree(p, trees[p.popen.pid], signal.SIGKILL)
        p.popen.wait()


def checkpoint_trainer(procs: list[Proc], log_dir: Path, timeout_s: float = 120) -> None:
    """Ask the trainer to checkpoint (the stop_requested file its ranks poll, also while they are
    still starting), then wait for it to save and exit."""
    (log_dir / protocol.STOP_REQUEST).write_text(f"INT {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
    for p in procs:
        if p.name == "trainer" and p.popen.poll() is None:
            try:
                p.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                print(f"trainer did not checkpoint within {timeout_s:.0f}s", file=sys.stderr)


def first_failure(log_dir: Path) -> tuple[str, str] | None:
    """(component, status) that prl.node recorded as the first leader to die, if any."""
    words = (log_dir / protocol.FIRST_FAILURE).read_text().split() if (log_dir / protocol.FIRST_FAILURE).exists() else []
    return (words[0], words[1]) if len(words) >= 2 and words[0] in protocol.BY_NAME else None


def ended(log_dir: Path, why: str, procs: list[Proc], rc: int) -> int:
    """Stop everything and record why the attempt ended (prl status shows it)."""
    (log_dir / protocol.ENDED).write_text(why + "\n")
    stop_all(procs)
    return rc


def supervise(procs: list[Proc], log_dir: Path, finished: Path, poll_s: float = 0.5, live=None) -> int:
    """Wait until trainer and orchestrator finish (success) or any component fails or stalls.
    `finished`: the final checkpoint; once it is complete the run is, whatever the trainer's exit.
    `live`: the progress line (prl.progress.LiveLine), redrawn every poll."""
    running = list(procs)
    while True:
        if live is not None:
            live.update()
        for p in list(running):
            rc = p.popen.poll()
            if rc is None:
                continue
            if live is not None:
                live.clear()
            running.remove(p)
            print(f"{p.name} exited with status {rc}")
            if (stalled := log_dir / protocol.STALLED).exists():
                (log_dir / protocol.FAILED).write_text(stalled.read_text())
                print(f"stalled: {stalled.read_text().strip()}", file=sys.stderr)
                return ended(log_dir, f"stalled: {stalled.read_text().strip()}", procs, protocol.EXIT_STALLED)
            if p.name == "trainer" and (log_dir / protocol.PREEMPTED).exists():
                print("trainer checkpointed on request; resume with: prl submit CONFIG --local --resume")
                return ended(log_dir, "stopped: checkpointed on request", procs, 0)
            if p.name == "trainer" and is_complete(finished):
                rc = 0  # a signal during the trainer's shutdown does not fail a finished run
            if p.name == "inference" or rc != 0:
                name, rc = first_failure(log_dir) or (p.name, rc)
                (log_dir / protocol.FAILED).write_text(f"{name} failed with exit status {rc}\n")
                print(f"{name} failed with exit status {rc}; stopping the run", file=sys.stderr)
                return ended(log_dir, f"failed: {name} exited {rc}", procs, protocol.BY_NAME[name].exit_code)
        if all(p.name == "inference" for p in running):
            print("run complete")
            return ended(log_dir, "run complete", procs, 0)
        time.sleep(poll_s)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_local(config_path: str, overrides: list[str], *, resume: bool = False, clean: bool = False,
              dry_run: bool = False, on_start=None) -> int:
    cfg, rd, text = prepare(config_path, overrides, resume=resume, clean=clean, local=True)
    gpus = gpu_assignment(cfg, gpu_count())  # before anything is written: too few GPUs is bad input
    moved = write_run_dir(cfg, rd, text, clean=clean)
    if dry_run:  # as `prl submit --dry-run`: the run directory written, nothing started
        if moved:
            print(f"moved the previous run to {moved}")
        for name, cmd in commands(cfg, rd.config).items():
            extra = f"CUDA_VISIBLE_DEVICES={gpus[name]} " if name in gpus else ""
            print(f"{name}: {extra}{shlex.join(cmd)}")
        again = shlex.join(["prl", "submit", str(config_path), *overrides, "--local"])
        print(f"# dry run: wrote {rd.path}; start with: {again}")
        return 0
    attempt, log_dir = rd.start_attempt()
    rd.record_start(attempt, env={}, pid=os.getpid(), pid_start=process_start(os.getpid()))
    print(f"run directory: {rd.path} (attempt {attempt})")
    if on_start is not None:
        on_start(rd)
    env = base_env(cfg, rd.path, attempt, log_dir)
    if protocol.WEIGHTS_PORT_ENV in env and shared_gpus(gpus):
        env[protocol.WEIGHTS_BACKEND_ENV] = "gloo"  # NCCL refuses two ranks on one GPU
    cmds = commands(cfg, rd.config)
    component_env = {"inference": cfg.inference.env, "trainer": cfg.trainer.env, "orchestrator": cfg.orchestrator.env}
    procs: list[Proc] = []
    live = None
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` of prl tears down like Ctrl-C
    try:
        for name in protocol.NAMES:
            extra = {"CUDA_VISIBLE_DEVICES": gpus[name]} if name in gpus else {}
            procs.append(start(name, cmds[name], env | component_env[name] | extra, log_dir))
        print(f"logs: {log_dir}  (prl logs {shlex.quote(str(rd.path))} -f, or prl watch for all three side by side)")
        live = LiveLine(rd)
        return supervise(procs, log_dir, rd.checkpoint_dir(cfg.run.max_steps), live=live)
    except KeyboardInterrupt:
        if live is not None:
            live.clear()
        print("interrupted: the trainer checkpoints, then every component stops", file=sys.stderr)
        try:
            checkpoint_trainer(procs, log_dir)
        except KeyboardInterrupt:
            pass  # a second Ctrl-C skips the checkpoint
        steps = rd.complete_checkpoints()
        again = shlex.join(["prl", "submit", str(config_path), *overrides, "--local", "--resume"])
        print(f"saved: checkpoints/step_{steps[-1]}" if steps else "no checkpoint was saved", file=sys.stderr)
        print(f"continue with: {again}", file=sys.stderr)
        return 130
    finally:
        stop_all(procs)
