"""The environment server (an entry's `server_workers`, docs/environments.md) as the rest of prl sees it: the
config key and its checks, the `envserver` component it adds to a run (its environment, its place beside
the orchestrator, its exit status), jobs/envserver.py at its subprocess boundary (a script in place of
the v1 Python: the secret by environment only, a private socket directory removed however the server
ends, its status passed on), and the orchestrator's side waiting for the server's address. The real
server, through a whole run and a kill -9: tests/integration/test_v1_envs.py.

    pytest tests/unit/test_envserver.py
"""

import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

from helpers import ROOT

from prl.config import ConfigError, load_config, to_yaml
from prl.orchestrator.v1env import KEY_VAR, V1Env, server_address
from prl.run import protocol
from prl.run.launch import Wiring, component_env, srun_command
from prl.run.procs import descendants

TOY_V1 = ROOT / "configs/toy_v1.yaml"
SERVED = "orchestrator.environment.server_workers=2"


def test_a_served_entry_adds_the_envserver_component_and_only_then():
    assert load_config(TOY_V1).components == ("inference", "trainer", "orchestrator")
    assert load_config(TOY_V1, [SERVED]).components[-1] == "envserver"
    evals = "orchestrator.eval.environments=[{id: prl_toy_v1, api: v1, server_workers: 1}]"
    cfg = load_config(TOY_V1, [evals])
    assert cfg.components[-1] == "envserver" and list(cfg.orchestrator.served_environments) == [
        "orchestrator.eval.environments[0]"]


@pytest.mark.parametrize("overrides,key,says", [
    (["orchestrator.environment.server_workers=-1"], "orchestrator.environment.server_workers", ">= 0"),
    (["orchestrator.environment.server_workers=two"], "orchestrator.environment.server_workers", ""),
    (["orchestrator.environment=null", "orchestrator.environments=[{id: prl.envs.toy, server_workers: 1}]"],
     "orchestrator.environments[0].server_workers", "v1 environments only"),
    (["orchestrator.environment=null", "orchestrator.environments=[{id: prl_toy_v1, api: v1, server_workers: 1}, "
      "{id: prl_toy_v1, api: v1, name: b, server_workers: 1, python: /other/python}]"],
     "orchestrator.environments[1].python", "in one Python"),
])
def test_bad_server_settings_are_refused_naming_the_key(overrides, key, says):
    with pytest.raises(ConfigError, match=f"^{re.escape(key)}") as e:
        load_config(TOY_V1, overrides)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_envserver_runs_beside_the_orchestrator_in_its_environment():
    """Its step overlaps the orchestrator's on the orchestrator's node (a unix socket reaches no further),
    in every layout; it takes the orchestrator's `env`."""
    for layout, where in ((["orchestrator.placement=own_node"], "--het-group=2"),
                          (["orchestrator.placement=trainer_node"], "--nodelist=$MASTER_ADDR"),
                          (["slurm.hetjob=false", "orchestrator.placement=own_node"], "--nodelist=$PRL_ORCHESTRATOR_NODES")):
        cfg = load_config(TOY_V1, [SERVED, "orchestrator.env.A=1", *layout])
        command = srun_command(cfg, "envserver", Wiring.symbolic())
        assert where in command and "--overlap" in command and "--mem=0" in command, command
        assert component_env(cfg, "envserver", "py")["A"] == "1"


def test_the_envserver_is_a_server_with_an_exit_status_of_its_own():
    comp = protocol.BY_NAME["envserver"]
    assert comp.must_stay_up and comp.exit_code == 18 and comp.het_group == protocol.BY_NAME["orchestrator"].het_group
    assert len({c.exit_code for c in protocol.COMPONENTS} | {14, 15, 16, 17}) == len(protocol.COMPONENTS) + 4


FAKE_SERVER = """#!{python}
import json, os, pathlib, signal, sys, time
setup = json.loads(os.environ["PRL_V1_SERVERS"])
scratch = pathlib.Path(setup["scratch"])
(scratch / "0.sock").write_text("")
pathlib.Path(setup["marker"]).write_text(json.dumps({{s["path"]: "ipc://" + str(scratch / "0.sock") for s in setup["servers"]}}))
print(json.dumps({{"setup": setup, "key": os.environ["{key}"], "argv": sys.argv, "mode": oct(scratch.stat().st_mode)}}),
      flush=True)
if os.environ.get("FAKE_EXIT"):
    sys.exit(int(os.environ["FAKE_EXIT"]))
time.sleep(60)
"""


@pytest.fixture
def envserver(tmp_path):
    """jobs/envserver.py of a run whose served entry's `python` is FAKE_SERVER; (start, attempt dir)."""
    python = tmp_path / "python"
    python.write_text(FAKE_SERVER.format(python=sys.executable, key=KEY_VAR))
    python.chmod(0o700)
    run_dir, attempt = tmp_path / "run", tmp_path / "run/logs/attempt_0"
    attempt.mkdir(parents=True)
    cfg = load_config(TOY_V1, [SERVED, f"orchestrator.environment.python={python}", f"run.output_dir={tmp_path}",
                               "run.name=run", "orchestrator.environment.args.target_chars=${oc.env:T_CHARS}"])
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    env = {**os.environ, "PRL_LOG_DIR": str(attempt), "PRL_RUN_DIR": str(run_dir), "T_CHARS": "xyz",
           "TMPDIR": str(tmp_path)}

    def start(**extra) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(ROOT / "jobs/envserver.py"), str(run_dir / "config.yaml")],
                                env=env | extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return start, attempt


def test_the_server_gets_its_setup_and_the_secret_by_environment_in_a_private_directory(envserver):
    start, attempt = envserver
    proc = start(FAKE_EXIT="0")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    seen = json.loads(out.splitlines()[0])
    (server,) = seen["setup"]["servers"]
    assert server == {"path": "orchestrator.environment", "taskset": {"id": "prl_toy_v1", "turns": 2, "target_chars": "xyz"},
                      "env": None, "harness": "prl_chat", "workers": 2}
    secret = (attempt.parent.parent / "secret").read_text().strip()
    assert seen["key"] == secret and secret not in " ".join(seen["argv"]) and secret not in out.replace(seen["key"], "")
    assert seen["mode"] == oct(stat.S_IFDIR | 0o700) and seen["setup"]["marker"] == str(attempt / protocol.ENV_SERVERS)
    assert not os.path.exists(seen["setup"]["scratch"])  # removed once the server ended


@pytest.mark.parametrize("how,status", [("exit", 3), ("kill", 128 + signal.SIGKILL), ("term", 128 + signal.SIGTERM)])
def test_the_servers_end_is_passed_on_and_its_sockets_removed(envserver, how, status):
    """A failing server's status (a kill -9: 137) is the component's, which prl.run.node records and the
    supervisor ends the run on; TERM to the component reaches the server; the socket directory goes."""
    start, attempt = envserver
    proc = start(**({"FAKE_EXIT": "3"} if how == "exit" else {}))
    seen = json.loads(proc.stdout.readline())
    if how == "kill":
        ((child, _),) = descendants(proc.pid)
        os.kill(child, signal.SIGKILL)
    elif how == "term":
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err  # TERM: the fake has no handler and dies of it
    assert not os.path.exists(seen["setup"]["scratch"]), err


def test_the_orchestrator_waits_for_the_servers_address_then_connects_there(tmp_path, monkeypatch):
    monkeypatch.setenv("PRL_LOG_DIR", str(tmp_path))
    marker = tmp_path / protocol.ENV_SERVERS
    threading.Timer(0.5, lambda: marker.write_text(json.dumps({"orchestrator.environment": "ipc:///x/0.sock"}))).start()
    t0 = time.monotonic()
    assert server_address("orchestrator.environment", 10, poll_s=0.05) == "ipc:///x/0.sock"
    assert 0.4 < time.monotonic() - t0 < 5
    with pytest.raises(RuntimeError, match=re.escape("serves ['orchestrator.environment'], not this entry")):
        server_address("orchestrator.environments[1]", 1)
    marker.unlink()
    with pytest.raises(RuntimeError, match=r"^orchestrator.environment.server_workers: .* within 0.3 s"):
        server_address("orchestrator.environment", 0.3, poll_s=0.05)


ECHO_WORKER = f"""#!{sys.executable}
import json, sys
print(json.dumps({{"ready": {{"train": 1, "eval": 1}}, "seats": [], "sampling_args": {{}}}}), flush=True)
sys.stderr.write(sys.stdin.readline())
"""


def test_a_served_entrys_worker_is_told_the_servers_address(tmp_path, monkeypatch, capfd):
    from prl.config import EnvironmentConfig

    monkeypatch.setenv("PRL_LOG_DIR", str(tmp_path))
    (tmp_path / protocol.ENV_SERVERS).write_text(json.dumps({"orchestrator.environment": "ipc:///x/0.sock"}))
    python = tmp_path / "python"
    python.write_text(ECHO_WORKER)
    python.chmod(0o700)
    cfg = EnvironmentConfig(id="fake_v1", api="v1", python=str(python), server_workers=2)
    V1Env(cfg, "orchestrator.environment", "model", "s3cret", "seed", server_timeout_s=5).close()
    setup = json.loads(capfd.readouterr().err.splitlines()[-1])
    assert setup["server"] == "ipc:///x/0.sock" and setup["server_timeout_s"] == 5
