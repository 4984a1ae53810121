"""Environment server entry point (the `envserver` component): verifiers v1's environment server for every
environment entry with `server_workers` > 0, on the orchestrator's node (docs/environments.md).

    python jobs/envserver.py RUN/config.yaml

Runs prl.orchestrator.v1server in the entries' Python (`python`, verifiers>=0.4) as its child, with the run's
secret in its environment (its episodes' TrainClient sends it to vLLM) and its sockets in a directory made
here, 0700, in the node's private scratch (TMPDIR: prl.run.node), removed here when the server ends however
it ends (a kill -9 included); TERM and INT are passed on. Its exit status is the server's (a signal: 128+N).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from prl.config import envref, load_config
from prl.run import protocol
from prl.run.attempt import Attempt
from prl.run.home import env_worker_python
from prl.run.secret import server_key

HOME = Path(__file__).resolve().parents[1]


def setup(cfg, scratch: Path, marker: Path) -> dict:
    """What prl.orchestrator.v1server serves: one server per served entry, named by its config path."""
    servers = [{"path": path, "taskset": {"id": env.id, **envref.resolve_args(env.args, os.environ, f"{path}.args")},
                "env": env.env, "harness": env.harness, "workers": env.server_workers}
               for path, env in cfg.orchestrator.served_environments.items()]
    return {"marker": str(marker), "scratch": str(scratch), "servers": servers}


def main(config_path: str) -> int:
    from prl.orchestrator.v1env import KEY_VAR
    from prl.orchestrator.v1server import SETUP_VAR

    cfg = load_config(config_path)
    python = env_worker_python(next(iter(cfg.orchestrator.served_environments.values())).python)
    scratch = Path(tempfile.mkdtemp(prefix="envserver-"))  # 0700, a fresh name: nobody can have planted it
    env = {**os.environ, KEY_VAR: server_key(cfg),
           SETUP_VAR: json.dumps(setup(cfg, scratch, Attempt.current().marker(protocol.ENV_SERVERS))),
           "PYTHONPATH": os.pathsep.join([str(HOME), os.environ.get("PYTHONPATH", "")])}
    try:
        child = subprocess.Popen([python, "-m", "prl.orchestrator.v1server"], env=env)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _: child.send_signal(signum))
        rc = child.wait()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"envserver: the environment server ({python}) exited with {rc}", file=sys.stderr, flush=True)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the resolved RUN/config.yaml")
    sys.exit(main(parser.parse_args().config))
