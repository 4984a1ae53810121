"""Episodes per second of a verifiers v1 environment: played in the environment worker (the orchestrator's
child, `server_workers: 0`) against verifiers v1's environment server with N pool workers
(`server_workers: N`, prl.orchestrator.v1server), against one real vLLM server.

    python benchmarks/v1_env_server_bench.py configs/toy_v1.yaml model.name=$PWD/.cache/tiny-qwen3 \\
        orchestrator.environment.env=prl_toy_duo --modes 0,1,2 --groups 16 --rounds 3

Starts `jobs/inference.py` with the config (stopped by PID at the end); then for each mode (0: the worker,
N: a server of N workers) the orchestrator's side of the environment (prl.orchestrator.v1env.V1Env, as a
run loads it) sends `--groups` groups of `orchestrator.rollouts_per_example` episodes at once, as a
batch's requests go out, `--rounds` times after one warm-up round (imports, connections, the first
compiled shapes), and times each round. An episode of a multi-seat env is one episode (all its seats'
traces). Prints one JSON line per mode and a table: episodes/s of each round and their median, how
many of the episodes errored, and the CPU milliseconds an episode took in the environment worker, the
environment server (its pool included) and vLLM over the timed rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from prl.config import envref, load_config
from prl.inference.standalone import start_server
from prl.orchestrator.rollouts import sampling_args
from prl.orchestrator.v1env import HOME, KEY_VAR, V1Env
from prl.orchestrator.v1server import SETUP_VAR
from prl.run import protocol
from prl.run.home import env_worker_python
from prl.run.procs import descendants

PATH = "orchestrator.environment"


def start_env_server(cfg, workers: int, key: str, work: Path) -> subprocess.Popen:
    """prl.orchestrator.v1server for the config's environment, as jobs/envserver.py starts it; its
    env_servers file in `work` (this process's PRL_LOG_DIR, where V1Env looks for it), its sockets in
    `work`/scratch (removed with `work`)."""
    env_cfg = cfg.orchestrator.environment
    taskset = {"id": env_cfg.id, **envref.resolve_args(env_cfg.args, os.environ, f"{PATH}.args")}
    scratch = work / "scratch"
    scratch.mkdir(mode=0o700)
    setup = {"marker": str(work / protocol.ENV_SERVERS), "scratch": str(scratch),
             "servers": [{"path": PATH, "taskset": taskset, "env": env_cfg.env, "harness": env_cfg.harness,
                          "workers": workers}]}
    env = {**os.environ, KEY_VAR: key, SETUP_VAR: json.dumps(setup), "PYTHONPATH": str(HOME)}
    with open(work / "envserver.out", "w") as out:
        return subprocess.Popen([env_worker_python(env_cfg.python), "-m", "prl.orchestrator.v1server"], env=env,
                                stdout=out, stderr=subprocess.STDOUT)


async def one_round(env: V1Env, url: str, model: str, sampling: dict, groups: int, rollouts: int, first: int):
    """(episodes, errored, wall seconds) of `groups` groups sent at once."""
    client = SimpleNamespace(client=SimpleNamespace(base_url=f"{url}/v1/"))
    tasks = env.get_dataset()
    start = time.perf_counter()
    outputs = await asyncio.gather(*(env.run_group(
        [{"task": tasks[(first + g) % len(tasks)]["task"], "seed": (first + g) * rollouts + r} for r in range(rollouts)],
        client, model, sampling) for g in range(groups)))
    wall = time.perf_counter() - start
    episodes = {(g, o.get("episode", i)) for g, out in enumerate(outputs) for i, o in enumerate(out)}
    errors = {(g, o.get("episode", i)): o["error"] for g, out in enumerate(outputs) for i, o in enumerate(out)
              if o.get("error")}
    if errors:
        print(f"errored: {len(errors)} episodes, e.g. {next(iter(errors.values()))}", flush=True)
    return len(episodes), len(errors), wall


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the live processes `pids` have used so far."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    return [pid, *(p for p, _ in descendants(pid))]


def measure(cfg, workers: int, server, args, work: Path) -> dict:
    """One mode: warm-up round, then the timed rounds; the CPU seconds per episode of the environment
    worker, of the environment server (its pool included) and of vLLM over the timed rounds."""
    os.environ["PRL_LOG_DIR"] = str(work)
    proc = start_env_server(cfg, workers, server.key, work) if workers else None
    env = None
    try:
        env = V1Env(cfg.orchestrator.environment, PATH, cfg.model.name, server.key, "seed",
                    server_timeout_s=600 if workers else None)
        sampling = sampling_args(cfg.orchestrator.sampling, env)
        rpe = cfg.orchestrator.rollouts_per_example
        play = [lambda i=i: asyncio.run(one_round(env, server.url, cfg.model.name, sampling, args.groups, rpe,
                                                  i * args.groups)) for i in range(args.rounds + 1)]
        rounds = [play[0]()]  # warm-up
        sides = {"worker": [env.proc.pid], "server": tree(proc.pid) if proc else [], "vllm": tree(server.process.pid)}
        before = {side: cpu_s(pids) for side, pids in sides.items()}
        rounds += [round_() for round_ in play[1:]]
        cpu = {side: cpu_s(pids) - before[side] for side, pids in sides.items()}
    finally:
        if env is not None:
            env.close()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    timed = rounds[1:]
    rates = [round(n / wall, 2) for n, _, wall in timed]
    episodes = sum(n for n, _, _ in timed)
    return {"mode": "worker" if not workers else f"server, {workers} worker(s)", "server_workers": workers,
            "episodes_per_round": timed[0][0], "errored": sum(e for _, e, _ in timed),
            "warmup_s": round(rounds[0][2], 2), "episodes_per_s": rates, "median_episodes_per_s": statistics.median(rates),
            **{f"{side}_cpu_ms_per_episode": round(1000 * seconds / episodes, 1) for side, seconds in cpu.items()}}


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return f"{platform.node()}: CPU {cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--modes", default="0,1,2", help="server_workers per mode, comma-separated (0: the worker); "
                        "repeat them (0,2,0,2) on a machine whose load changes")
    parser.add_argument("--groups", type=int, default=16, help="groups sent at once per round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mode, after one warm-up round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        overrides = [*args.overrides, f"run.output_dir={work}"]
        cfg = load_config(args.config, overrides)
        server = start_server(args.config, overrides, output=Path(work) / "vllm.out")
        try:
            server.wait_healthy(timeout_s=900)
            results = []
            for i, workers in enumerate(map(int, args.modes.split(","))):  # a mode may come again (0,2,0,2)
                (Path(work) / f"mode{i}").mkdir()
                results.append(measure(cfg, workers, server, args, Path(work) / f"mode{i}"))
                print(json.dumps(results[-1]), flush=True)
        finally:
            server.stop()
    print(f"\n{machine()}\n| mode | episodes a round | episodes/s per round | median | errored | CPU ms an episode: "
          "worker / server / vLLM |\n| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['mode']} | {r['episodes_per_round']} | {', '.join(map(str, r['episodes_per_s']))} | "
              f"{r['median_episodes_per_s']} | {r['errored']} | {r['worker_cpu_ms_per_episode']} / "
              f"{r['server_cpu_ms_per_episode']} / {r['vllm_cpu_ms_per_episode']} |")


if __name__ == "__main__":
    main()
