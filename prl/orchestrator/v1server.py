"""The environment server: verifiers v1's own (`verifiers.v1.serve`) for every environment entry with
`server_workers` > 0, in the entries' Python (verifiers>=0.4). jobs/envserver.py, the run's `envserver`
component, starts it and hands it its setup in the environment variable SETUP_VAR (never argv):

    PRL_V1_SERVERS='{"marker": ..., "scratch": ..., "servers": [...]}' .venv-v1/bin/python -m prl.orchestrator.v1server

Each entry gets one server on a unix socket, ipc://SCRATCH/N.sock, SCRATCH a 0700 directory that
jobs/envserver.py made for it in the node's private scratch (and removes): only this user can connect, so
nobody else on the node can have the server run episodes, which send the run's secret to the URL a
request names. `server_workers: 1` is one EnvServer in this process; N > 1 a static EnvServerPool of N
worker processes, their own sockets in SCRATCH too (v1 would put them in /tmp, where a kill -9 leaves them).
Once every server listens, the addresses go to the attempt's `env_servers` file (prl.run.protocol), which
the orchestrator's environment workers wait for. A pool worker that dies ends the server with status 1
(v1's broker would route requests to it and wait forever); SIGTERM ends it cleanly.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import sys
import tempfile

SETUP_VAR = "PRL_V1_SERVERS"
"""The environment variable with the server's setup (JSON)."""
QUIET = ("httpx", "aiohttp.access", "verifiers.v1.rollout")
"""Loggers that write a line per request or episode: the server's log keeps their warnings only."""
WATCH_S = 1.0
"""How often the pool workers are checked."""


def log_setup() -> None:
    """Logging for this process and every pool worker (spawned: v1 hands them this function), whose heap
    (verifiers v1, imported to unpickle the worker's target) is frozen out of the collector here: at exit
    the final collection walked it for 10-13 s per worker on 2 cores, past the pool's 10 s join and the
    supervisor's grace, and a stop took 22 s; frozen (here and in serve), 2.3 s (2 workers, no episode run)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    gc.freeze()


def build(entry: dict, address: str, scratch: str):
    """The server of one entry, bound to `address`: the env config the environment worker would play
    (prl.orchestrator.v1worker.env_data), served by one EnvServer or a pool of `workers`."""
    from verifiers.v1.serve import EnvServer, EnvServerPool, env_config_data
    from verifiers.v1.utils.loaders import env_config_type, resolve_env_config

    from prl.orchestrator.v1worker import env_data, seats_of

    seats = seats_of(env_config_type(entry["taskset"]["id"], entry.get("env") or ""))
    config = resolve_env_config(env_data(entry, entry["taskset"], seats))
    if entry["workers"] == 1:
        return EnvServer(config=config, address=address)
    pool = EnvServerPool({"config_data": env_config_data(config)}, entry["workers"], address, log_setup, elastic=False)
    os.rmdir(pool._ipc_dir)  # made by v1 in /tmp; its workers' sockets go to the private scratch instead
    pool._ipc_dir = tempfile.mkdtemp(prefix="pool-", dir=scratch)
    return pool


async def watch_pools(servers: list) -> str:
    """Returns (a reason) when a pool worker has died."""
    while True:
        for server in servers:
            for w in getattr(server, "workers", []):
                if not w["process"].is_alive():
                    return f"pool worker {w['index']} (pid {w['process'].pid}) exited with {w['process'].exitcode}"
        await asyncio.sleep(WATCH_S)


async def serve(setup: dict) -> int:
    servers, addresses = [], {}
    for i, entry in enumerate(setup["servers"]):
        servers.append(build(entry, f"ipc://{setup['scratch']}/{i}.sock", setup["scratch"]))
        addresses[entry["path"]] = servers[-1].address
    gc.freeze()  # what the servers were built of lives to the end (log_setup says why)
    tasks = [asyncio.create_task(s.run()) for s in servers]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [t.cancel() for t in tasks])
    marker = setup["marker"]
    with open(f"{marker}.tmp{os.getpid()}", "w") as f:
        json.dump(addresses, f)
    os.replace(f"{marker}.tmp{os.getpid()}", marker)
    logging.getLogger(__name__).info(f"environment servers up: {addresses}")
    watch = asyncio.create_task(watch_pools(servers))
    done, _ = await asyncio.wait([*tasks, watch], return_when=asyncio.FIRST_COMPLETED)
    for task in [*tasks, watch]:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)  # each server shuts down (pools end their workers)
    if watch in done:
        print(f"prl.orchestrator.v1server: {watch.result()}; stopping", file=sys.stderr, flush=True)
        return 1
    return 0 if all(t.cancelled() or t.exception() is None for t in tasks) else 1


def main() -> int:
    log_setup()
    return asyncio.run(serve(json.loads(os.environ[SETUP_VAR])))


if __name__ == "__main__":
    sys.exit(main())
