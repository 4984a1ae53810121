"""One component on one node: first clear what an earlier job of the run left on this node, then run
the component, and when it ends (or is told to), end every process it started.

    srun ... python -m prl.run.node trainer -- torchrun ... jobs/trainer.py RUN/config.yaml

Clusters that track a job's processes by parent PID lose vLLM's engine core and workers when the API
server dies: they are re-parented to init and keep the GPUs. This process makes itself their
subreaper, so every orphan of the component is re-parented here and stays findable, and it records
them (PID + start time) and the shared-memory segments they map under RUN/nodes/HOST/, so the next
job of the run can end and remove exactly those, by PID and path, never by name, even if this
process was killed with SIGKILL.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prl.run import protocol
from prl.run.attempt import Attempt
from prl.run.files import write_atomic
from prl.run.procs import alive, descendants, process_start, reap_orphans, shm_paths, signal_procs

RECORD_EVERY_S = 5.0
"""How often the component's process list and shared-memory segments are recorded."""
LEFTOVER_GRACE_S = 5.0
"""SIGTERM to SIGKILL for what a component leaves running once its leader has ended: its leader is
gone, so nothing of it has work left to finish."""
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphans of the component are re-parented to this process instead of init (Linux >= 3.4)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


JOB_ID = re.compile(r"\d+(_\d+)?")
"""A SLURM job id as the records hold it (array tasks: JOB_TASK)."""
SHM = Path("/dev/shm")


def job_tmp(job_id: str) -> Path:
    """Node-local scratch of one job (TMPDIR, triton, inductor and torch-extension caches, torchelastic),
    by name: the batch script points the compile caches there (run.compile_cache=false)."""
    return Path(f"/tmp/prl-{job_id}")


def job_scratch(job_id: str) -> Path:
    """The job's scratch on this node: job_tmp if it is this user's private directory (made 0700
    here, or made by another of the job's components on this node), else a fresh one of a random name
    beside it (mkdtemp: 0700, made by this call, so nobody can have planted it). Anyone on the node can
    create /tmp/prl-JOB for coming job ids (issue 53): neither a failed start nor their files."""
    try:
        return private_dir(job_tmp(job_id))
    except SystemExit as e:
        fresh = Path(tempfile.mkdtemp(prefix=f"{job_tmp(job_id).name}-", dir=job_tmp(job_id).parent))
        print(f"{e}; using {fresh} instead", flush=True)
        return fresh


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user can write to: made 0700, or, when it exists, used only if
    it is a real directory (no link) of this user that nobody else can write to. Anyone on the node
    can create /tmp/prl-JOB before the job starts and leave code there that the run would load
    (Triton's compiled launchers), so anything else is refused (SystemExit), never repaired."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise SystemExit(f"prl.run.node: {path} exists and is not this user's private directory (owner uid "
                         f"{st.st_uid}, {stat.filemode(st.st_mode)}): refusing to use it; remove it and resubmit")
    return path


def owned_dir(path: Path) -> bool:
    """A real directory (no link) of this user."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def recorded_shm(path: str) -> bool:
    """Whether a path from a record is a segment directly in /dev/shm (what Record.write puts there):
    a record that names anything else is not acted on."""
    p = Path(path)
    return p.parent == SHM and p.name not in ("", ".", "..")


class Record:
    """RUN/nodes/HOST/JOB.COMPONENT.json: what this component runs on this node, kept current."""

    def __init__(self, run_dir: Path, job_id: str, component: str):
        self.dir = run_dir / "nodes" / os.uname().nodename
        self.path = self.dir / f"{job_id}.{component}.json"
        self.job_id = job_id

    scratch: Path | None = None
    """The job's scratch on this node when it is not job_tmp (job_scratch): the next job removes it."""

    def write(self, procs: list[tuple[int, int]], shm: set[str]) -> None:
        record = {"job_id": self.job_id, "procs": procs, "shm": sorted(shm)}
        write_atomic(self.path, json.dumps(record | ({"scratch": self.scratch.name} if self.scratch else {})))

    def clear_earlier(self) -> list[str]:
        """End the processes and remove the segments and scratch that earlier jobs recorded here."""
        done = []
        for path in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            try:
                old = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(old, dict) or not JOB_ID.fullmatch(str(old.get("job_id"))) or old["job_id"] == self.job_id:
                continue
            done += end_procs([tuple(p) for p in old.get("procs", [])], grace_s=5)
            for shm in old.get("shm", []):
                if recorded_shm(shm) and os.path.lexists(shm):
                    os.unlink(shm)
                    done.append(f"removed {shm}")
            for scratch in scratches(old):
                shutil.rmtree(scratch, ignore_errors=True)
                done.append(f"removed {scratch}")
            path.unlink(missing_ok=True)
        return done


def scratches(old: dict) -> list[Path]:
    """An earlier job's scratch directories on this node that are this user's: job_tmp, and the one
    of a random name it used instead (only a name job_scratch makes, directly beside job_tmp)."""
    tmp = job_tmp(old["job_id"])
    named = str(old.get("scratch", ""))
    fresh = [tmp.parent / named] if named.startswith(f"{tmp.name}-") and "/" not in named and ".." not in named else []
    return [path for path in [tmp, *fresh] if owned_dir(path)]  # another user's directory of that name stays


def end_procs(procs: list[tuple[int, int]], grace_s: float) -> list[str]:
    """SIGTERM, up to `grace_s` to exit, then SIGKILL; returns what was ended."""
    live = alive(procs)
    signal_procs(live, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(live) and time.monotonic() < deadline:
        reap_orphans()
        time.sleep(0.1)
    signal_procs(live, signal.SIGKILL)
    return [f"ended pid {pid}" for pid, _ in live]


class Node:
    def __init__(self, component: str, argv: list[str], record: Record | None):
        self.component, self.argv, self.record = component, argv, record
        self.child: subprocess.Popen | None = None
        self.asked_to_stop = False

    def forward(self, signum: int, frame: object) -> None:
        """TERM/INT/HUP go to the leader, which shuts its own children down in order (vLLM's API
        server); what it leaves ends in `finish`. The trainer's leader, torchrun, ignores TERM (it would
        SIGKILL the ranks 30 s later, mid-checkpoint): TERM goes to the ranks, which checkpoint and exit."""
        if self.child is None:
            return
        self.asked_to_stop = True
        if self.component == "trainer" and signum == signal.SIGTERM:
            signal_procs(descendants(self.child.pid), signum)
            return
        try:
            self.child.send_signal(signum)
        except ProcessLookupError:
            pass

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.forward)
        # Checkpoint requests travel as the stop_requested file (prl.run.protocol), not as signals: a
        # USR1 that reaches this step anyway (scancel --signal=USR1 without --batch) must not kill
        # the leader (torchrun dies of it) or ranks that have no handler yet. Inherited by the leader.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        env = _child_env()
        if self.record is not None and Path(env["TMPDIR"]) != job_tmp(self.record.job_id):
            self.record.scratch = Path(env["TMPDIR"])  # a fresh name (job_scratch): the next job removes it
        self.child = subprocess.Popen(self.argv, env=env,
                                      preexec_fn=_ignore_term if self.component == "trainer" else None)
        gpus = f"; CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in env else ""
        # One write (the newline inside it): the leader is already running and writes to the same
        # output; with PYTHONUNBUFFERED print's text and its end are two writes, and the leader's line
        # could land between them.
        print(f"prl.run.node: {self.component} leader pid {self.child.pid} on {os.uname().nodename}{gpus}\n",
              end="", flush=True)
        last = 0.0
        while (rc := self.child.poll()) is None:
            if self.record is not None and time.monotonic() - last > RECORD_EVERY_S:
                procs = [(self.child.pid, process_start(self.child.pid) or 0), *descendants(os.getpid())]
                self.record.write(procs, shm_paths(procs))
                last = time.monotonic()
            reap_orphans(self.child)
            time.sleep(0.2)
        if rc != 0 and not self.asked_to_stop:
            record_first_failure(self.component, rc)
        self.finish()
        return rc if rc >= 0 else 128 - rc

    def finish(self) -> None:
        """Whatever the leader left behind (vLLM's engine core after a kill -9, a hung rank) ends."""
        left = descendants(os.getpid())
        if left:
            print(f"prl.run.node: {self.component} left {len(left)} process(es); ending them", flush=True)
            end_procs(left, LEFTOVER_GRACE_S)
        reap_orphans()
        if self.record is not None:
            self.record.write([], set())


def record_first_failure(component: str, rc: int) -> None:
    """protocol.FIRST_FAILURE, unless another component's leader died first (os.link never replaces)."""
    attempt = Attempt.current()
    if attempt is None or attempt.has(protocol.PREEMPTED) or attempt.has(protocol.STALLED):
        return  # a requested checkpoint or a stall: not a failure of this kind
    tmp = attempt.marker(f".{protocol.FIRST_FAILURE}.{os.getpid()}")
    tmp.write_text(f"{component} {rc if rc >= 0 else 128 - rc} {os.uname().nodename}\n")
    try:
        os.link(tmp, attempt.marker(protocol.FIRST_FAILURE))
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def _ignore_term() -> None:
    """torchrun inherits an ignored TERM (and leaves it out of --signals-to-handle)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def gpu_slice(visible: str | None, part: str) -> str:
    """The FIRST:COUNT slice of a CUDA_VISIBLE_DEVICES list (indices or UUIDs, as SLURM set it)."""
    first, count = (int(x) for x in part.split(":"))
    ids = [x for x in (visible or "").split(",") if x]
    if first + count > len(ids):
        raise SystemExit(f"prl.run.node: {protocol.GPU_SLICE_ENV}={part} needs {first + count} GPUs, but this step "
                         f"was given CUDA_VISIBLE_DEVICES={visible!r}")
    return ",".join(ids[first:first + count])


def _child_env() -> dict[str, str]:
    """TMPDIR in the job's node-local scratch: torchelastic's and others' temp dirs land where the
    next job of the run removes them (Record.clear_earlier). PRL_NODE_RANK: this node's place among
    the component's nodes (srun's one task per node: SLURM_PROCID), so that each node of a
    several-node server logs to a rank_R.log of its own. PRL_GPU_SLICE (the one-node layout): this
    component's part of the GPUs the step was given."""
    env = dict(os.environ)
    env.setdefault(protocol.NODE_RANK_ENV, env.get("SLURM_PROCID", "0"))
    if part := env.pop(protocol.GPU_SLICE_ENV, None):
        env["CUDA_VISIBLE_DEVICES"] = gpu_slice(env.get("CUDA_VISIBLE_DEVICES"), part)
    if job_id := env.get("SLURM_JOB_ID"):
        env["TMPDIR"] = str(job_scratch(job_id))
        env |= moved_to_scratch(env, job_tmp(job_id), Path(env["TMPDIR"]))
        env |= compile_caches(env, Path(env["TMPDIR"]))
    for var in LOCAL_CACHES:
        if var not in env:  # local mode (the batch script sets them)
            env[var] = str(private_dir(user_cache(protocol.COMPILE_CACHES[var])))
    return env


LOCAL_CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")
"""Local mode's compile caches, where the environment names none: in ~/.cache/prl, each under its
protocol.COMPILE_CACHES name (C++ extensions stay in torch's default under HOME).

Inductor's: torch's own default, /tmp/torchinductor_USER, is a name anyone on the machine can create
first and fill with compiled modules that this user's runs would then load; FlashAttention 4's
default, /tmp/USER/flash_attention_cute_dsl_cache, the same.
Triton's: left unset, Inductor points the variable at its own cache while it compiles, so where vLLM
compiles the model, at vLLM's compile directory, but not where it loads the model compiled before.
vLLM's sampler kernels, which Triton compiles at the first batches, went to that directory at the
first start and were looked for in ~/.triton/cache at the next, and compiled again: a warm-up of
14-20 s instead of 1 s (1 x H200, 1.5B; benchmarks/reports/server-start-phases-1.5b_h200_2026-11-28.md). Named, the
first start that loaded the compiled model warmed up in 1 s (2 x H200; h200x2-2026-11-28e, with ~/.triton/cache
named: the same mechanism). Triton also builds its launchers there, native code the run loads:
a directory only this user can write, as under SLURM (RUN/cache/triton or the job's scratch)."""


def moved_to_scratch(env: dict[str, str], named: Path, scratch: Path) -> dict[str, str]:
    """The compile caches the batch script pointed into job_tmp, in the scratch job_scratch chose."""
    if scratch == named:
        return {}
    return {var: str(scratch / env[var].removeprefix(f"{named}/")) for var in protocol.COMPILE_CACHES
            if env.get(var, "").startswith(f"{named}/")}


def user_cache(name: str) -> Path:
    """~/.cache/prl/NAME, kept across runs (its parents made as needed)."""
    parent = Path.home() / ".cache" / "prl"
    parent.mkdir(parents=True, exist_ok=True)
    return parent / name


def compile_caches(env: dict[str, str], scratch: Path) -> dict[str, str]:
    """The compile caches (protocol.COMPILE_CACHES) that the batch script pointed into the run's
    RUN/cache (run.compile_cache) or run.compile_cache_dir, where later jobs find what this one compiled (the
    trainer's torch.compile, Triton's kernels, C++ extensions): kept there if that directory is
    this user's alone (else refused, as the scratch is: whoever can write there could leave code for
    the run to load) and takes file locks, by which Inductor and Triton serialize their writers (a
    Lustre mounted without flock takes none): else moved to the job's scratch, saying so. A cache the
    config's env points elsewhere stays where it points."""
    kept = env.get(protocol.COMPILE_CACHE_ENV)
    ours = [var for var, name in protocol.COMPILE_CACHES.items() if kept and env.get(var) == f"{kept}/{name}"]
    if not ours:
        return {}
    Path(kept).parent.mkdir(parents=True, exist_ok=True)  # run.compile_cache_dir's; made under the job's umask
    cache = private_dir(Path(kept))
    try:
        takes_locks(cache)
        return {}
    except OSError as e:
        print(f"prl.run.node: compile caches in {scratch}, not {cache}: it takes no file lock ({e.strerror or e})",
              flush=True)
        return {var: str(scratch / protocol.COMPILE_CACHES[var]) for var in ours}


def takes_locks(directory: Path) -> None:
    """An exclusive flock on a file of this process's own in `directory` (no other holds it), then
    its release and removal; OSError where the file system takes no lock."""
    path = directory / f".lock-{os.uname().nodename}-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m prl.run.node COMPONENT -- COMMAND...", file=sys.stderr)
        return 2
    become_subreaper()
    run_dir, job_id = os.environ.get("PRL_RUN_DIR"), os.environ.get("SLURM_JOB_ID")
    record = Record(Path(run_dir), job_id, args[0]) if run_dir and job_id else None
    if record is not None:
        for line in record.clear_earlier():
            print(f"prl.run.node: left by an earlier job: {line}", flush=True)
    return Node(args[0], args[2:], record).run()


if __name__ == "__main__":
    raise SystemExit(main())
