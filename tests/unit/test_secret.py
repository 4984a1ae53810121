"""The run's secret (prl.run.secret) and where the servers listen: attacks of another user of the
cluster on the files, without a server (the server's routes: test_inference.py, on the shared CPU
server; on the test cluster: test_slurm_rl.py::test_complete_run_hetjob)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import ROOT, TOY, prl

from prl.config import ConfigError, envref, load_config
from prl.control.cli import main
from prl.inference.server import export_environment, listen_host
from prl.run import secret


def dry_run(tmp_path, *overrides):
    r = prl("submit", str(TOY), f"run.output_dir={tmp_path / 'out'}", f"model.name={ROOT / '.cache/tiny-qwen2'}",
            *overrides, "--dry-run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return tmp_path / "out/toy", r


def test_submit_makes_a_private_secret_written_nowhere_else(tmp_path):
    run, r = dry_run(tmp_path)
    path = secret.path_of(run)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.getuid()
    value = secret.read(run)
    assert len(value) >= 32 and value not in r.stdout + r.stderr
    for f in run.rglob("*"):
        if f.is_file() and f != path:
            assert value.encode() not in f.read_bytes(), f
    # --resume keeps the run's secret: a requeued job's servers and clients still agree
    run2, _ = dry_run(tmp_path, "--resume")
    assert run2 == run and secret.read(run) == value


def test_the_run_directory_is_its_owners_alone_unless_shared_with_the_group(tmp_path):
    run, _ = dry_run(tmp_path)
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    run.chmod(0o755)  # a run made before runs were private, resumed
    dry_run(tmp_path, "--resume")
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    dry_run(tmp_path, "--resume", "run.group_readable=true")
    assert stat.S_IMODE(run.stat().st_mode) == 0o750


def test_a_secret_others_could_read_or_replace_is_refused(tmp_path):
    run = tmp_path / "run"
    value = secret.ensure(run)
    assert secret.ensure(run) == value  # made once
    path = secret.path_of(run)
    path.chmod(0o640)
    with pytest.raises(SystemExit, match="only it can read"):
        secret.read(run)
    path.unlink()
    planted = tmp_path / "planted"
    planted.write_text("x" * 40 + "\n")
    planted.chmod(0o600)
    path.symlink_to(planted)  # another user's link to a file whose content they know
    with pytest.raises(SystemExit, match="not a plain file"):
        secret.read(run)
    with pytest.raises(SystemExit, match="not a plain file"):
        secret.ensure(run)
    path.unlink()
    path.write_text("short\n")
    path.chmod(0o600)
    with pytest.raises(SystemExit, match="too short"):
        secret.read(run)
    if os.getuid() == 0:
        path.write_text("y" * 40 + "\n")
        os.chown(path, 65534, 65534)
        with pytest.raises(SystemExit, match="uid 65534"):
            secret.read(run)
    path.unlink()
    with pytest.raises(SystemExit, match="missing"):
        secret.read(run)


def config(tmp_path, *overrides):
    (tmp_path / "c.yaml").write_text(f"run: {{name: r, output_dir: '{tmp_path}'}}\nmodel: {{name: /models/m}}\n"
                                     "orchestrator: {environment: {id: e}}\n")
    return load_config(tmp_path / "c.yaml", list(overrides))


def test_the_server_takes_the_runs_secret_by_environment(tmp_path):
    cfg = config(tmp_path)
    environ: dict[str, str] = {}
    export_environment(cfg, environ)
    assert environ["VLLM_API_KEY"] == secret.read(tmp_path / "r")
    environ = {"PRL_RUN_DIR": str(tmp_path / "elsewhere")}  # the batch script's run directory wins
    export_environment(cfg, environ)
    assert environ["VLLM_API_KEY"] == secret.read(tmp_path / "elsewhere")


def test_where_the_server_listens(tmp_path, monkeypatch):
    assert listen_host(config(tmp_path), {}) == "127.0.0.1"  # local mode, one machine
    local_in_allocation = {"SLURM_JOB_ID": "5", "PRL_INFERENCE_URLS": "http://127.0.0.1:8011/v1"}
    assert listen_host(config(tmp_path), local_in_allocation) == "127.0.0.1"  # prl submit --local in salloc
    assert listen_host(config(tmp_path, "inference.host=10.1.2.3"), {"SLURM_JOB_ID": "5"}) == "10.1.2.3"
    monkeypatch.setattr(socket, "gethostname", lambda: "node7")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: {"node7": "10.0.0.7"}[name])
    assert listen_host(config(tmp_path), {"SLURM_JOB_ID": "5"}) == "10.0.0.7"
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # Debian's /etc/hosts
    assert listen_host(config(tmp_path), {"SLURM_JOB_ID": "5"}) == "0.0.0.0"

    def unknown(name):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "gethostbyname", unknown)
    assert listen_host(config(tmp_path), {"SLURM_JOB_ID": "5"}) == "0.0.0.0"


def test_a_bad_host_names_the_key(tmp_path):
    for host in ("", "x;rm", "$(id)", "a/b", "a\nb"):
        with pytest.raises(ConfigError, match="inference.host"):
            config(tmp_path, f"inference.host={host!r}" if host else "inference.host=''")
    r = prl("submit", str(TOY), "inference.host=a b", "--dry-run", f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert r.returncode == 2 and "inference.host" in r.stderr and not (tmp_path / "toy").exists(), r.stderr


TOKEN = "hf_tok3n-that-must-stay-out-of-every-file"


def test_a_secret_named_by_oc_env_travels_by_the_jobs_environment_only(tmp_path, monkeypatch):
    """`${oc.env:NAME}` in an env section stays a reference in config.yaml, job.sbatch and --dry-run's
    output (the batch script expands it on the node, and stops naming the key when it is unset);
    the server and the launchers resolve it from their own environment; a default applies when unset."""
    refs = ["env.HF_TOKEN=${oc.env:PRL_TEST_TOKEN}", "inference.env.TOKEN2=${oc.env:PRL_TEST_TOKEN}",
            "trainer.env.W=${oc.env:PRL_TEST_UNSET,none}"]
    monkeypatch.setenv("PRL_TEST_TOKEN", TOKEN)
    monkeypatch.delenv("PRL_TEST_UNSET", raising=False)
    run, r = dry_run(tmp_path, *refs)
    assert TOKEN not in r.stdout + r.stderr
    assert not [f for f in run.rglob("*") if f.is_file() and TOKEN.encode() in f.read_bytes()]
    assert 'export HF_TOKEN="${PRL_TEST_TOKEN?env.HF_TOKEN: PRL_TEST_TOKEN is not set in the job environment}"' \
        in (run / "job.sbatch").read_text()
    cfg = load_config(run / "config.yaml")
    assert cfg.env["HF_TOKEN"] == "${oc.env:PRL_TEST_TOKEN}" and cfg.trainer.env["W"] == "${oc.env:PRL_TEST_UNSET,none}"
    environ = {"PRL_TEST_TOKEN": TOKEN, "PRL_RUN_DIR": str(run)}
    export_environment(cfg, environ)
    assert environ["HF_TOKEN"] == environ["TOKEN2"] == TOKEN
    assert envref.resolve(cfg.trainer.env, {}, "trainer.env") == {"W": "none"}
    with pytest.raises(ConfigError, match=r"^env\.HF_TOKEN: .* PRL_TEST_TOKEN is not set"):
        export_environment(cfg, {"PRL_RUN_DIR": str(run)})
    line = next(x for x in (run / "job.sbatch").read_text().splitlines() if x.startswith("export HF_TOKEN="))
    for script, fails in (("export PRL_TEST_TOKEN=x; ", False), ("unset PRL_TEST_TOKEN; ", True)):
        done = subprocess.run(["bash", "-c", script + line + "; echo $HF_TOKEN"], capture_output=True, text=True)
        assert (done.returncode != 0) == fails and ("env.HF_TOKEN" in done.stderr) == fails, done.stderr
        assert done.stdout == ("" if fails else "x\n")


MARK = "Zq7-SECRET-xj9"
"""A marker value: no vowel but E, so that prl.envs.toy's reward of "ooo" under it is 0."""
EVERYWHERE = f"""defaults: [{TOY}]
env: {{AUTH: "Bearer ${{oc.env:PRL_MARK}}"}}
inference: {{env: {{NESTED: "${{oc.env:PRL_TEST_UNSET,${{oc.env:PRL_MARK}}}}"}}}}
slurm: {{setup: ["export FROM_SETUP=\\"${{oc.env:PRL_MARK}}\\""]}}
trainer: {{slurm: {{setup: ["export FROM_TRAINER_SETUP=${{oc.env:PRL_MARK}}"]}}}}
orchestrator: {{environment: {{id: prl.envs.toy, args: {{target_chars: "${{oc.env:PRL_MARK}}"}}}}}}
"""


def test_oc_env_stays_a_reference_in_every_position_and_reaches_its_program(tmp_path, monkeypatch, capsys):
    """Inside a larger string, as a nested default, in slurm.setup and a component's setup, in an
    environment's args: the marker is in no file of the run, not in --dry-run's output, not in the W&B
    config; the batch script's export, its setup line, the trainer's setup line, the inference
    server's environment and the orchestrator's load_environment each still get it."""
    from prl.orchestrator.dataset import load_env
    from prl.run.launch import setup_lines
    from prl.trainer.metrics import _public_config

    (tmp_path / "c.yaml").write_text(EVERYWHERE)
    monkeypatch.setenv("PRL_MARK", MARK)
    monkeypatch.delenv("PRL_TEST_UNSET", raising=False)
    monkeypatch.chdir(tmp_path)
    rc = main(["submit", str(tmp_path / "c.yaml"), f"run.output_dir={tmp_path / 'out'}",
               f"model.name={ROOT / '.cache/tiny-qwen2'}", "--dry-run"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    run = tmp_path / "out/toy"
    assert MARK not in out.out + out.err and "${oc.env:PRL_MARK}" in (run / "config.yaml").read_text()
    assert not [f for f in run.rglob("*") if f.is_file() and MARK.encode() in f.read_bytes()]
    cfg = load_config(run / "config.yaml")
    assert MARK not in json.dumps(_public_config(cfg))
    assert _public_config(cfg)["orchestrator"]["environment"]["args"] == {"target_chars": "${oc.env:PRL_MARK}"}
    # What each program gets, from its own environment:
    job = (run / "job.sbatch").read_text().splitlines()
    export = next(x for x in job if x.startswith("export AUTH="))
    setup = next(x.split(" || ")[0] for x in job if x.startswith("eval ") and "FROM_SETUP" in x)
    trainer = f"eval {shlex.quote(setup_lines(cfg, 'trainer')[0])}"
    script = f"{export}; {setup}; {trainer}; echo \"$AUTH|$FROM_SETUP|$FROM_TRAINER_SETUP\""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"PRL_MARK": MARK})
    assert done.stdout == f"Bearer {MARK}|{MARK}|{MARK}\n", done.stderr
    done = subprocess.run(["bash", "-c", f"set +u; {setup}"], capture_output=True, text=True, env={})
    assert done.returncode != 0 and "slurm.setup[0]: PRL_MARK is not set" in done.stderr
    environ = {"PRL_MARK": MARK, "PRL_RUN_DIR": str(run)}
    export_environment(cfg, environ)
    assert environ["AUTH"] == f"Bearer {MARK}" and environ["NESTED"] == MARK
    env = load_env(cfg.orchestrator.environment)
    reward = env.rubric._get_reward_funcs()[0]
    assert reward(completion=MARK) == 1.0 and reward(completion="ooo") == 0.0


@pytest.mark.parametrize("override, key", [
    ("run.output_dir=${oc.env:HOME}/runs", "run.output_dir"),
    ("trainer.lr=${oc.env:LR}", "trainer.lr"),
    ("inference.extra_args=[--api-key,'${oc.env:K}']", "inference.extra_args[1]"),
    ("slurm.extra_sbatch=['--comment=${oc.env:K}']", "slurm.extra_sbatch[0]"),
    ("model.name=${env.A}", "model.name"),  # an interpolation that brings env.A's reference here
    ("env.A=${oc.env:K", "override 'env.A"),  # OmegaConf's own parse of the override
    ("env.A=${oc.env:1K}", "env.A"),
    ("env.A=\\${oc.env:K}", "env.A"),
])
def test_a_reference_prl_would_read_at_submit_is_refused_naming_the_key(override, key):
    overrides = [override] + (["env.A=${oc.env:K}"] if "${env.A}" in override else [])
    with pytest.raises(ConfigError) as e:
        load_config(TOY, overrides)
    assert str(e.value).startswith(key) and "\n" not in str(e.value), str(e.value)


def test_a_reference_to_an_unset_variable_is_refused_at_submit_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("PRL_TEST_UNSET", raising=False)
    r = prl("submit", str(TOY), f"run.output_dir={tmp_path / 'out'}", "orchestrator.env.K=${oc.env:PRL_TEST_UNSET}",
            "--dry-run", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "prl: error: orchestrator.env.K: ${oc.env:PRL_TEST_UNSET} but PRL_TEST_UNSET is not set in this environment"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("override, key", [
    ("slurm.setup=['echo ${oc.env:PRL_TEST_UNSET}']", "slurm.setup[0]"),
    ("orchestrator.environment.args.target_chars=x${oc.env:PRL_TEST_UNSET}", "orchestrator.environment.args.target_chars"),
    ("env.A=${oc.env:PRL_TEST_UNSET,${oc.env:PRL_TEST_UNSET}}", "env.A"),
])
def test_an_unset_reference_is_refused_at_submit_wherever_it_stands(tmp_path, monkeypatch, capsys, override, key):
    monkeypatch.delenv("PRL_TEST_UNSET", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["submit", str(TOY), f"run.output_dir={tmp_path / 'out'}", override, "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith(f"prl: error: {key}: ") and not (tmp_path / "out").exists()


def as_stranger(*argv: str) -> subprocess.CompletedProcess:
    """`argv` run as another Unix user of the machine (uid/gid 65534, no groups)."""
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("group_readable", [False, True])
def test_another_unix_user_reads_nothing_of_the_run(group_readable):
    """As uid 65534 on the same machine, in a directory everybody may enter: the run directory cannot
    be listed, and its secret, config and job script cannot be read (0700, or 0750 for the run's group
    with run.group_readable, which the stranger is not in)."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root: acting as another user needs setpriv as root")
        pytest.skip("needs root to act as another user")
    top = Path(tempfile.mkdtemp(prefix="prl-stranger-"))
    try:
        top.chmod(0o755)
        run, _ = dry_run(top, f"run.group_readable={str(group_readable).lower()}")
        assert stat.S_IMODE(run.stat().st_mode) == (0o750 if group_readable else 0o700)
        assert as_stranger("ls", str(top / "out")).returncode == 0  # the stranger does get that far
        for argv in (["ls", str(run)], ["cat", str(run / "secret")], ["cat", str(run / "config.yaml")],
                     ["cat", str(run / "job.sbatch")]):
            r = as_stranger(*argv)
            assert r.returncode != 0 and "Permission denied" in r.stderr, (argv, r.stdout, r.stderr)
    finally:
        shutil.rmtree(top)


WATCH_SUBMIT = r"""
import os, stat, sys
run, loose, argv = sys.argv[1], int(sys.argv[2], 8), sys.argv[3:]
found, looked, busy = [], [0], [False]

def walk():
    if not os.path.lexists(run):
        return
    looked[0] += 1
    for top, dirs, files in os.walk(run):
        for path in [top, *(os.path.join(top, name) for name in dirs + files)]:
            mode = stat.S_IMODE(os.lstat(path).st_mode)
            if mode & 0o077 & ~loose:
                found.append(f"{path} {mode:o}")

def before_each_change(event, args):  # the audit event comes before the call: what the last one did
    if not busy[0] and event in ("open", "os.mkdir", "os.rename", "os.chmod", "os.symlink"):
        busy[0] = True
        try:
            walk()
        finally:
            busy[0] = False

os.umask(0)  # as a user whose umask hides nothing: only prl's own modes can keep the run private
sys.addaudithook(before_each_change)
from prl.control.cli import main
rc = main(argv)
walk()
print(rc, looked[0], *sorted(set(found)), sep="\n")
"""


@pytest.mark.parametrize("group_readable", [False, True])
def test_no_file_or_directory_of_a_run_is_others_at_any_moment_of_submit(tmp_path, group_readable):
    """`prl submit --dry-run` under umask 0, its run directory's tree checked before every open,
    mkdir, rename and chmod of the process (an audit hook) and at its end: no directory or file was
    ever more than its owner's (0700/0600); with run.group_readable, its group may read but never
    write (0750/0640); never anybody else's. Another user who opens a handle in that window keeps it."""
    run = tmp_path / "out/toy"
    argv = ["submit", str(TOY), f"run.output_dir={tmp_path / 'out'}", f"model.name={ROOT / '.cache/tiny-qwen2'}",
            f"run.group_readable={str(group_readable).lower()}", "--dry-run"]
    r = subprocess.run([sys.executable, "-c", WATCH_SUBMIT, str(run), "050" if group_readable else "0", *argv],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    rc, looked, *found = r.stdout.split("# dry run:")[-1].splitlines()[1:]
    assert rc == "0" and found == [], (r.stderr, found)
    assert int(looked) > 10, looked  # the tree was looked at while it was being written, not only at the end
    modes = {stat.S_IMODE(p.lstat().st_mode) for p in [run, *run.rglob("*")]}
    assert modes == ({0o750, 0o640, 0o600} if group_readable else {0o700, 0o600}), modes  # 0600: the secret
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777  # run.output_dir is not the run's


def made_run(tmp_path) -> Path:
    from prl.run.rundir import RunDir

    rd = RunDir(tmp_path / "runs/r")
    rd.create("{}\n", "#!/bin/bash\n")
    return rd.path


def refused(run: Path, capsys) -> str:
    """`new-attempt RUN` (every launch's first command) refuses: status 2, one line, no attempt made."""
    from prl.run import launches

    assert launches.main(["new-attempt", str(run)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and not list(run.glob("logs/attempt_*")), err
    return err


def test_a_launch_refuses_a_run_directory_that_is_not_its_owners_own(tmp_path, capsys, monkeypatch):
    """A link at RUN (a group member's, to a directory of theirs), a run directory or config.yaml
    others may write (a config swapped before a requeue), another user's run directory: the job
    starts nothing and says which path, in one line."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = made_run(tmp_path)
    link = tmp_path / "runs/link"
    link.symlink_to(run)
    assert f"{link}: a symbolic link" in refused(link, capsys)
    for path, mode in ((run, 0o770), (run / "config.yaml", 0o620), (run, 0o702)):
        path.chmod(mode)
        assert f"{path}: others may write it" in refused(run, capsys)
        path.chmod(0o700 if path == run else 0o600)
    (run / "config.yaml").unlink()
    (run / "config.yaml").symlink_to(tmp_path / "elsewhere.yaml")
    assert f"{run / 'config.yaml'}: a symbolic link" in refused(run, capsys)
    (run / "config.yaml").unlink()
    (run / "config.yaml").write_text("{}\n")
    if os.geteuid() == 0:
        os.chown(run, 65534, 65534)
        assert f"{run}: owned by uid 65534" in refused(run, capsys)
        os.chown(run, 0, 0)
    from prl.run import launches

    assert launches.main(["new-attempt", str(run)]) == 0 and (run / "logs/attempt_0").is_dir()


def test_submit_refuses_to_write_through_a_link_or_into_anothers_run(tmp_path):
    """What `prl submit --resume` (or a local run) would write there would land in someone else's
    directory: exit 2, one line naming the path, nothing written."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out/toy").symlink_to(elsewhere)
    for extra in ([], ["--resume"], ["--local", "--resume"]):
        r = prl("submit", str(TOY), f"run.output_dir={tmp_path / 'out'}", f"model.name={ROOT / '.cache/tiny-qwen2'}",
                *extra, "--dry-run", cwd=tmp_path)
        assert r.returncode == 2 and f"{tmp_path / 'out/toy'}: a symbolic link" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and list(elsewhere.iterdir()) == []
