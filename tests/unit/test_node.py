"""prl.run.node: a component's orphans end with it, and what an earlier job of the run left on a node
(processes by PID + start time, shared-memory segments, scratch) is cleared before the next starts."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prl.run.procs import alive, process_start

ORPHAN = """
import os, sys, time
if os.fork() == 0:          # the engine core of a server: outlives its parent
    if os.fork() == 0:
        open(sys.argv[1], "w").write(str(os.getpid()))
        time.sleep(300)
    os._exit(0)
time.sleep(float(sys.argv[2]))
os._exit(int(sys.argv[3]))
"""


def node(component, *argv, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "prl.run.node", component, "--", *argv], env=env, **kw)


def wait_file(path: Path, timeout=20) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, path
        time.sleep(0.05)
    return path.read_text()


def test_orphans_of_a_dead_leader_end_and_the_exit_status_is_kept(tmp_path):
    pid_file = tmp_path / "orphan"
    p = node("inference", sys.executable, "-c", ORPHAN, str(pid_file), "1", "11")
    orphan = int(wait_file(pid_file))
    assert p.wait(timeout=30) == 11
    assert process_start(orphan) is None


def test_term_reaches_the_leader_and_everything_ends(tmp_path):
    pid_file = tmp_path / "orphan"
    p = node("inference", sys.executable, "-c", ORPHAN, str(pid_file), "300", "0")
    orphan = int(wait_file(pid_file))
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    assert process_start(orphan) is None


RANK = """
import signal, sys, time
def checkpoint(*_):
    open(sys.argv[1], "w").write("checkpointed")
    sys.exit(42)
signal.signal(signal.SIGTERM, checkpoint)
open(sys.argv[2], "w").write("ready")
time.sleep(300)
"""
TORCHRUN = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', sys.argv[1], *sys.argv[2:]]))"


def test_trainer_term_goes_to_the_ranks_not_to_torchrun(tmp_path):
    """torchrun (here a stand-in that waits for its rank) ignores TERM; the rank gets it, checkpoints
    and exits 42, and torchrun then ends with it: no 30 s SIGKILL in the middle of a checkpoint."""
    done, ready = tmp_path / "done", tmp_path / "ready"
    p = node("trainer", sys.executable, "-c", TORCHRUN, RANK, str(done), str(ready))
    wait_file(ready)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 42 and done.read_text() == "checkpointed"


def test_usr1_does_not_kill_the_leader(tmp_path):
    p = node("trainer", sys.executable, "-c", "import time; time.sleep(2)")
    time.sleep(0.5)
    p.send_signal(signal.SIGUSR1)
    assert p.wait(timeout=30) == 0


def fake_job_ids() -> tuple[str, str]:
    """Two job ids no job of the test cluster has (its ids count from 1, and CI's heavy tests run
    beside these): /tmp/prl-JOB and RUN/nodes records of a real job are never touched."""
    first = 800000 + 2 * (os.getpid() % 40000)
    return str(first), str(first + 1)


def test_the_next_job_clears_what_an_earlier_job_left(tmp_path):
    """Job 1's component is SIGKILLed with its wrapper: its process and shm segment stay behind,
    recorded. Job 2's wrapper on the same node ends and removes exactly those, nothing else."""
    run = tmp_path / "run"
    job1, job2 = fake_job_ids()
    shm = Path(f"/dev/shm/prl-test-{os.getpid()}")
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    hold = ("import mmap, os, sys, time\n"
            "f = open(sys.argv[1], 'w+b'); f.truncate(4096); m = mmap.mmap(f.fileno(), 4096)\n"
            "open(sys.argv[2], 'w').write(str(os.getpid())); time.sleep(300)")
    env1 = dict(os.environ, PRL_RUN_DIR=str(run), SLURM_JOB_ID=job1)
    p1 = node("inference", sys.executable, "-c", hold, str(shm), str(tmp_path / "pid1"), env=env1,
              start_new_session=True)
    left = int(wait_file(tmp_path / "pid1"))
    record = run / "nodes" / os.uname().nodename / f"{job1}.inference.json"
    deadline = time.monotonic() + 20
    while not (record.exists() and str(shm) in record.read_text()):
        assert time.monotonic() < deadline, "the wrapper never recorded the segment"
        time.sleep(0.2)
    os.kill(p1.pid, signal.SIGKILL)  # the wrapper dies without cleaning up: as under `scancel -s KILL`
    p1.wait()
    assert process_start(left) is not None and shm.exists() and Path(f"/tmp/prl-{job1}").is_dir()

    env2 = dict(os.environ, PRL_RUN_DIR=str(run), SLURM_JOB_ID=job2)
    r = subprocess.run([sys.executable, "-m", "prl.run.node", "trainer", "--", "true"], env=env2,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"ended pid {left}" in r.stdout and f"removed {shm}" in r.stdout and f"removed /tmp/prl-{job1}" in r.stdout
    assert process_start(left) is None and not shm.exists() and not record.exists()
    assert alive([(unrelated.pid, process_start(unrelated.pid))])  # only what was recorded
    assert json.loads((record.parent / f"{job2}.trainer.json").read_text())["procs"] == []
    unrelated.kill()
    unrelated.wait()
    subprocess.run(["rm", "-rf", f"/tmp/prl-{job2}"])


def test_the_first_leader_to_die_is_recorded_and_a_later_one_is_not(tmp_path):
    env = dict(os.environ, PRL_LOG_DIR=str(tmp_path))
    assert node("inference", sys.executable, "-c", "import sys; sys.exit(3)", env=env).wait(timeout=30) == 3
    assert node("orchestrator", sys.executable, "-c", "import sys; sys.exit(5)", env=env).wait(timeout=30) == 5
    assert (tmp_path / "first_failure").read_text().split()[:2] == ["inference", "3"]
    (tmp_path / "first_failure").unlink()
    (tmp_path / "preempted").write_text("trainer: checkpoints/step_2\n")  # a requested stop is no failure
    assert node("trainer", sys.executable, "-c", "import sys; sys.exit(1)", env=env).wait(timeout=30) == 1
    assert not (tmp_path / "first_failure").exists()


def test_each_node_of_a_component_gets_its_own_rank(tmp_path):
    """Under srun (one task per node) SLURM_PROCID is the node's place: every node of a two-node
    server logs to its own rank_R.log instead of all to rank_0.log; local mode sets 0 itself."""
    env = {**os.environ, "SLURM_PROCID": "1"}
    env.pop("PRL_NODE_RANK", None)
    script = "import os; print(os.environ['PRL_NODE_RANK'])"
    out = subprocess.run([sys.executable, "-m", "prl.run.node", "inference", "--", sys.executable, "-c", script],
                         env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "1", out.stdout + out.stderr
    env["PRL_NODE_RANK"] = "0"
    out = subprocess.run([sys.executable, "-m", "prl.run.node", "inference", "--", sys.executable, "-c", script],
                         env=env, capture_output=True, text=True, timeout=30)
    assert out.stdout.splitlines()[-1] == "0"


def planted_tmp(owner: int | None = None, mode: int = 0o755, link_to: Path | None = None) -> tuple[str, Path]:
    """/tmp/prl-JOB made before the job starts, as another user of the node could: (job id, path)."""
    job_id = str(900000 + os.getpid() % 90000)
    path = Path(f"/tmp/prl-{job_id}")
    subprocess.run(["rm", "-rf", str(path)], check=True)
    if link_to is not None:
        path.symlink_to(link_to)
        return job_id, path
    path.mkdir()
    path.chmod(mode)
    (path / "triton").mkdir()
    (path / "triton" / "launcher.so").write_text("planted")
    if owner is not None:
        subprocess.run(["chown", "-R", f"{owner}:{owner}", str(path)], check=True)
    return job_id, path


@pytest.mark.parametrize("how", ["another user's", "open to others", "a link"])
def test_a_planted_job_scratch_is_not_used_and_the_component_runs(tmp_path, how):
    """Another user who creates /tmp/prl-JOB first (with a Triton launcher in it) gets nothing: the
    component runs in a fresh private scratch of a random name beside it (TMPDIR, and the compile
    caches the batch script pointed at /tmp/prl-JOB), the line says so, the planted files stay
    unread, and the run's next job on the node removes the fresh scratch (issue 53: every job of the
    node failed at start). Needs root for `chown` in CI."""
    from prl.run.protocol import COMPILE_CACHES
    if how == "another user's" and os.getuid() != 0:
        pytest.skip("making a directory of another user needs root")
    job_id, path = {"another user's": lambda: planted_tmp(owner=65534, mode=0o700),
                    "open to others": lambda: planted_tmp(mode=0o777),
                    "a link": lambda: planted_tmp(link_to=tmp_path)}[how]()
    run, later = tmp_path / "run", str(int(job_id) + 1)
    caches = {var: f"{path}/{name}" for var, name in COMPILE_CACHES.items()}  # run.compile_cache=false
    show = "import os; print('TMPDIR', os.environ['TMPDIR']); print('TRITON', os.environ['TRITON_CACHE_DIR'])"
    try:
        r = subprocess.run([sys.executable, "-m", "prl.run.node", "trainer", "--", sys.executable, "-c", show],
                           env=dict(os.environ, SLURM_JOB_ID=job_id, PRL_RUN_DIR=str(run), **caches),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"{path} exists and is not this user's private directory" in r.stdout
        scratch = Path(next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("TMPDIR ")))
        assert scratch.parent == path.parent and scratch.name.startswith(f"{path.name}-")
        assert scratch.lstat().st_uid == os.getuid() and scratch.stat().st_mode & 0o777 == 0o700
        assert f"TRITON {scratch}/{COMPILE_CACHES['TRITON_CACHE_DIR']}" in r.stdout
        assert (path / "triton" / "launcher.so").read_text() == "planted" if how != "a link" else True
        r = subprocess.run([sys.executable, "-m", "prl.run.node", "trainer", "--", "true"],
                           env=dict(os.environ, SLURM_JOB_ID=later, PRL_RUN_DIR=str(run)), capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and f"removed {scratch}" in r.stdout and not scratch.exists(), r.stdout
        if how != "open to others":  # that one is this user's own: removed with the job's scratch
            assert path.is_symlink() if how == "a link" else path.is_dir()  # another user's name stays
    finally:
        subprocess.run(["rm", "-rf", str(path), f"/tmp/prl-{later}", *map(str, Path("/tmp").glob(f"prl-{job_id}-*"))])


def test_the_job_scratch_is_made_private():
    job_id, path = planted_tmp()
    subprocess.run(["rm", "-rf", str(path)], check=True)
    try:
        r = subprocess.run([sys.executable, "-m", "prl.run.node", "trainer", "--", "sh", "-c", 'echo "$TMPDIR"'],
                           env=dict(os.environ, SLURM_JOB_ID=job_id), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and str(path) in r.stdout.splitlines(), r.stderr  # beside the wrapper's own line
        assert path.stat().st_mode & 0o777 == 0o700 and path.stat().st_uid == os.getuid()
    finally:
        subprocess.run(["rm", "-rf", str(path)])


def test_a_record_naming_other_paths_deletes_nothing(tmp_path):
    """RUN/nodes/HOST/*.json is data: a record whose job id or segments point elsewhere (an edited
    file, another user's) is not acted on."""
    victim_dir, victim_file = tmp_path / "victim", tmp_path / "victim.txt"
    victim_dir.mkdir()
    victim_file.write_text("keep")
    run = tmp_path / "run"
    job1, job2 = fake_job_ids()
    records = run / "nodes" / os.uname().nodename
    records.mkdir(parents=True)
    (records / f"{job1}.inference.json").write_text(json.dumps({"job_id": job1, "procs": [], "shm": [str(victim_file)]}))
    (records / "x.inference.json").write_text(json.dumps(
        {"job_id": f"{job1}/../../..{victim_dir}", "procs": [], "shm": ["/dev/shm/../../" + str(victim_file)]}))
    r = subprocess.run([sys.executable, "-m", "prl.run.node", "trainer", "--", "true"],
                       env=dict(os.environ, PRL_RUN_DIR=str(run), SLURM_JOB_ID=job2), capture_output=True, text=True,
                       timeout=60)
    subprocess.run(["rm", "-rf", f"/tmp/prl-{job2}"])
    assert r.returncode == 0, r.stderr
    assert victim_file.read_text() == "keep" and victim_dir.is_dir() and "removed" not in r.stdout


def kept_cache_env(run: Path, job_id: str, **extra: str) -> dict[str, str]:
    """A component's environment under the batch script with run.compile_cache (RUN/cache)."""
    from prl.run.protocol import COMPILE_CACHE_ENV, COMPILE_CACHES
    cache = run / "cache"
    caches = {var: f"{cache}/{name}" for var, name in COMPILE_CACHES.items()}
    return {**os.environ, "SLURM_JOB_ID": job_id, COMPILE_CACHE_ENV: str(cache), **caches, **extra}


PRINT_CACHES = "import os; print(*(os.environ[v] for v in ('TRITON_CACHE_DIR', 'TORCHINDUCTOR_CACHE_DIR', " \
               "'TORCH_EXTENSIONS_DIR')))"


def test_compile_caches_are_kept_in_the_run_private_and_a_variable_the_config_set_stays(tmp_path):
    """run.compile_cache: the caches stay in RUN/cache (made 0700) for the run's next job; one the
    config's env pointed elsewhere (TRITON_CACHE_DIR here) is left where it points."""
    job_id, scratch = planted_tmp()
    subprocess.run(["rm", "-rf", str(scratch)], check=True)
    env = kept_cache_env(tmp_path, job_id, TRITON_CACHE_DIR=str(tmp_path / "mine"))
    try:
        r = subprocess.run([sys.executable, "-m", "prl.run.node", "trainer", "--", sys.executable, "-c", PRINT_CACHES],
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        cache = tmp_path / "cache"
        mine = str(tmp_path / "mine")
        assert r.stdout.splitlines()[-1].split() == [mine, f"{cache}/inductor", f"{cache}/torch_extensions"]
        assert cache.stat().st_mode & 0o777 == 0o700 and os.listdir(cache) == []  # the lock probe's file is gone
    finally:
        subprocess.run(["rm", "-rf", str(scratch)])


def test_a_shared_compile_cache_dir_is_made_private_with_its_parents(tmp_path):
    """run.compile_cache_dir (~/.cache/prl/compile, say), not there yet: made 0700 with its parents under the
    job's umask and kept, as RUN/cache is; a second run's job uses the same directory as it is."""
    from prl.run import node
    from prl.run.protocol import COMPILE_CACHES
    shared = tmp_path / "home/.cache/prl/compile"
    env = kept_cache_env(tmp_path, "123", PRL_COMPILE_CACHE=str(shared),
                         **{var: f"{shared}/{name}" for var, name in COMPILE_CACHES.items()})
    old = os.umask(0o077)
    try:
        for _ in range(2):
            assert node.compile_caches(env, tmp_path / "scratch") == {}
    finally:
        os.umask(old)
    assert [p.stat().st_mode & 0o777 for p in (shared, shared.parent, shared.parent.parent)] == [0o700] * 3
    assert os.listdir(shared) == []


def test_a_run_cache_open_to_others_is_refused_and_nothing_runs(tmp_path):
    """Whoever can write to RUN/cache could leave code there for the run to load: not used, not repaired."""
    (tmp_path / "cache").mkdir(mode=0o777)
    (tmp_path / "cache").chmod(0o777)
    job_id, scratch = planted_tmp()
    subprocess.run(["rm", "-rf", str(scratch)], check=True)
    ran = tmp_path / "ran"
    try:
        r = subprocess.run([sys.executable, "-m", "prl.run.node", "trainer", "--", "touch", str(ran)],
                           env=kept_cache_env(tmp_path, job_id), capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and f"{tmp_path / 'cache'} exists and is not this user's private directory" in r.stderr
        assert not ran.exists()
    finally:
        subprocess.run(["rm", "-rf", str(scratch)])


def test_a_run_cache_that_takes_no_lock_gives_way_to_the_job_scratch(tmp_path, monkeypatch, capsys):
    """A shared file system without flock (Lustre mounted without it): Inductor's and Triton's locks
    would fail mid-compile, so the caches go to the job's scratch, with a line saying why."""
    import errno
    import fcntl

    from prl.run import node
    env = kept_cache_env(tmp_path, "123")

    def no_lock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(fcntl, "flock", no_lock)
    moved = node.compile_caches(env, tmp_path / "scratch")
    assert moved == {"TRITON_CACHE_DIR": f"{tmp_path}/scratch/triton",
                     "TORCHINDUCTOR_CACHE_DIR": f"{tmp_path}/scratch/inductor",
                     "TORCH_EXTENSIONS_DIR": f"{tmp_path}/scratch/torch_extensions",
                     "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": f"{tmp_path}/scratch/flash_attn_cute"}
    assert f"not {tmp_path / 'cache'}: it takes no file lock (No locks available)" in capsys.readouterr().out
    assert os.listdir(tmp_path / "cache") == []
    monkeypatch.undo()
    assert node.compile_caches(env, tmp_path / "scratch") == {}
    assert node.compile_caches({k: v for k, v in env.items() if k != "PRL_COMPILE_CACHE"}, tmp_path / "scratch") == {}


def test_local_mode_compiles_into_a_private_cache_of_the_user_not_a_shared_tmp_name(tmp_path):
    """Torch's default inductor cache, /tmp/torchinductor_USER, can be made first by anyone on the
    machine; a component in local mode compiles into ~/.cache/prl/inductor (0700) instead, kept
    across runs; a cache directory the user chose stays; one open to others is refused. Triton's
    likewise, ~/.cache/prl/triton, named so that vLLM's compile and its load of that compile look in
    one place (prl.run.node.LOCAL_CACHES); FlashAttention 4's, ~/.cache/prl/flash_attn_cute."""
    unset = ("SLURM_JOB_ID", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["HOME"] = str(tmp_path)
    script = "import os; print(*(os.environ[v] for v in ('TORCHINDUCTOR_CACHE_DIR', 'TRITON_CACHE_DIR'," \
             " 'FLASH_ATTENTION_CUTE_DSL_CACHE_DIR')))"

    def seen(**extra):
        return subprocess.run([sys.executable, "-m", "prl.run.node", "trainer", "--", sys.executable, "-c", script],
                              env={**env, **extra}, capture_output=True, text=True, timeout=60)
    r = seen()
    cache, triton, fa4 = (tmp_path / ".cache/prl" / name for name in ("inductor", "triton", "flash_attn_cute"))
    assert r.returncode == 0 and r.stdout.splitlines()[-1].split() == [str(cache), str(triton), str(fa4)], r.stderr
    assert all(d.stat().st_mode & 0o777 == 0o700 for d in (cache, triton, fa4))
    mine = seen(TORCHINDUCTOR_CACHE_DIR="/x/mine", TRITON_CACHE_DIR="/x/triton", FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="/x/fa")
    assert mine.stdout.splitlines()[-1].split() == ["/x/mine", "/x/triton", "/x/fa"]
    for refused in (cache, triton):
        refused.chmod(0o777)
        r = seen()
        assert r.returncode != 0 and f"{refused} exists and is not this user's private directory" in r.stderr
        refused.chmod(0o700)
