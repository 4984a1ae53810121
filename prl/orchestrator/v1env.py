"""A verifiers v1 environment (`api: v1`) as the orchestrator sees it: its environment worker
(prl.orchestrator.v1worker, in the environment's own Python) behind the classic environment's surface
(get_dataset, get_eval_dataset, sampling_args, run_group), so data order, seeds, advantages, drops,
evals, ratios and completions files are the same code for both APIs (docs/environments.md).

The worker is this process's child, owned by PID: started when the environment is loaded, its death is
the orchestrator's (an error naming the environment), and it ends when the orchestrator does (its stdin
closes at exit, and it is waited for). The run's secret reaches it in its environment, never on its
command line. With an environment server (the entry's server_workers), the worker sends each episode to
it through verifiers v1's client, at the address the envserver component wrote (server_address).
Its answers are read by a daemon thread, not a task of the event loop: a thread of the
loop's executor blocked on the pipe kept asyncio.run from returning after the last batch (Python 3.11
waits for that executor without a limit), and a daemon thread serves the loops of evals as well.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from prl.config import ConfigError, EnvironmentConfig, envref
from prl.run.attempt import Attempt
from prl.run.home import env_worker_python
from prl.run.protocol import ENV_SERVERS

WORKER = "prl.orchestrator.v1worker"
KEY_VAR = "PRL_V1_SERVER_KEY"
"""prl.orchestrator.v1worker.KEY_VAR (that module imports verifiers v1; this one must not)."""
HOME = Path(__file__).resolve().parents[2]
"""On the worker's PYTHONPATH: it imports prl.orchestrator.v1worker from here."""


def sampling_body(sampling: dict) -> dict:
    """The orchestrator's sampling args (prl.orchestrator.rollouts.sampling_args) as v1 SamplingConfig
    fields: vLLM sampling params; the chat-route-only keys stay behind."""
    args = {k: v for k, v in sampling.items() if k not in ("extra_body", "logprobs")}
    extra = {k: v for k, v in (sampling.get("extra_body") or {}).items() if k != "return_token_ids"}
    return args | extra


class V1Env:
    """One v1 environment and its worker; `path` names its config entry in errors; `seed_key` is the
    rollout input's field with its sampling seed (prl.orchestrator.dataset.SEED_KEY)."""

    sampling_args: dict
    """The taskset's `sampling_args` attribute if it has one (the worker reports it), else {}: merged under
    `orchestrator.sampling` as a classic environment's are (prl.orchestrator.rollouts.sampling_args)."""

    def __init__(self, cfg: EnvironmentConfig, path: str, model: str, secret: str, seed_key: str,
                 server_timeout_s: float | None = None):
        """`server_timeout_s`: the episodes run in the run's environment server (the envserver component),
        whose address this waits for that long (watchdog.ready_timeout_s); None: in the worker."""
        self.seed_key, self.path, self.label, self.pending, self.next_id = seed_key, path, cfg.label, {}, 0
        python = env_worker_python(cfg.python)
        if not os.access(python, os.X_OK):
            raise ConfigError(f"{path}.python: {python} is not an executable Python (tools/setup.sh makes .venv-v1)")
        env = {**os.environ, KEY_VAR: secret, "PYTHONPATH": os.pathsep.join([str(HOME), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([python, "-m", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True, bufsize=1)
        args = envref.resolve_args(cfg.args, os.environ, f"{path}.args")  # the value goes down a pipe, never written
        setup = {"taskset": {"id": cfg.id, **args}, "env": cfg.env, "harness": cfg.harness, "model": model,
                 "tokenizer": model, "renderer": cfg.renderer or None}
        if server_timeout_s is not None:
            setup |= {"server": server_address(path, server_timeout_s), "server_timeout_s": server_timeout_s}
        self.proc.stdin.write(json.dumps(setup) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{path}: the environment worker of {cfg.id} ({python}) exited with "
                               f"{self.proc.wait()} before it was ready (its log is above)")
        ready = json.loads(line)
        self.sizes, self.seats, self.sampling_args = ready["ready"], ready.get("seats") or [], ready["sampling_args"]
        self.lock = threading.Lock()
        threading.Thread(target=self.read, name=f"v1 worker {cfg.label}", daemon=True).start()
        atexit.register(self.close)

    def get_dataset(self) -> list[dict]:
        return [{"task": i} for i in range(self.sizes["train"])]

    def get_eval_dataset(self, n: int = -1) -> list[dict]:
        count = self.sizes["eval"] if n == -1 else min(n, self.sizes["eval"])
        return [{"task": i, "split": "eval"} for i in range(count)]

    async def run_group(self, group: list[dict], client: Any, model: str, sampling: dict, **_: Any) -> list[dict]:
        """One group's outputs: its rollouts are one request (one task, a seed each) to the worker."""
        answer = asyncio.get_running_loop().create_future()
        with self.lock:
            if self.proc.poll() is not None:
                raise self.exited()
            self.next_id += 1
            self.pending[self.next_id] = answer
            request = {"id": self.next_id, "split": group[0].get("split", "train"), "task": group[0]["task"],
                       "seeds": [row[self.seed_key] for row in group], "sampling": sampling_body(sampling),
                       "url": str(client.client.base_url)}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
        except BrokenPipeError:  # it died since: its reader fails this request, naming the environment
            pass
        reply = await answer
        if "failed" in reply:
            raise RuntimeError(f"{self.path}: the environment worker failed a group: {reply['failed']}")
        # One output per rollout and seat, seat by seat: each carries its rollout's (episode's) example.
        return [output | {"example_id": group[output.get("episode", i)].get("example_id")}
                for i, output in enumerate(reply["rollouts"])]

    def read(self) -> None:
        """(its thread) Hand each answer to its request, in the request's loop; the worker's end fails
        every request still waiting."""
        for line in self.proc.stdout:
            reply = json.loads(line)
            with self.lock:
                future = self.pending.pop(reply["id"], None)
            if future is not None:
                settle(future, reply)
        error = self.exited()
        with self.lock:
            waiting, self.pending = list(self.pending.values()), {}
        for future in waiting:
            settle(future, error)

    def exited(self) -> RuntimeError:
        return RuntimeError(f"{self.path}: the environment worker exited with {self.proc.wait()} (its log is above)")

    def close(self) -> None:
        """End the worker: its stdin closes, it finishes and exits; killed if it has not within 10 s."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def server_address(path: str, timeout_s: float, poll_s: float = 0.2) -> str:
    """The address of entry `path`'s environment server, from the attempt's env_servers file, which the
    envserver writes once it listens (prl.orchestrator.v1server); RuntimeError after `timeout_s`."""
    marker, deadline = Attempt.current().marker(ENV_SERVERS), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if marker.is_file():
            addresses = json.loads(marker.read_text())
            if path not in addresses:
                raise RuntimeError(f"{path}: the environment server serves {sorted(addresses)}, not this entry")
            return addresses[path]
        time.sleep(poll_s)
    raise RuntimeError(f"{path}.server_workers: the environment server did not listen within {timeout_s:g} s "
                       f"(watchdog.ready_timeout_s; no {marker}): see the envserver's log")


def settle(future: asyncio.Future, outcome: dict | Exception) -> None:
    """Resolve `future` from another thread; a loop that has ended has nobody waiting on it."""
    def resolve() -> None:
        if not future.done():
            (future.set_exception if isinstance(outcome, Exception) else future.set_result)(outcome)
    try:
        future.get_loop().call_soon_threadsafe(resolve)
    except RuntimeError:  # the loop is closed
        pass
