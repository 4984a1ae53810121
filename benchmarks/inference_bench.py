"""Inference benchmark: server start-up, POST /update_weights latency, batched generation throughput.

    python benchmarks/inference_bench.py configs/toy.yaml model.name=$PWD/.cache/tiny-qwen2 \\
        inference.enforce_eager=true inference.env.VLLM_CPU_KVCACHE_SPACE=1 [--requests 64 --tokens 64]

Starts `jobs/inference.py` locally (stopped by PID at the end) and measures:
- start-up: process start -> GET /health answers 200;
- update: POST /update_weights, alternating between a copy of the model directory and the model
  itself (so every call really swaps), client round trip, median of --updates;
- throughput: --requests concurrent completions of exactly --tokens tokens (ignore_eos, T=1),
  completion tokens / wall time, after one warm-up request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from prl.config import load_config
from prl.inference.standalone import start_server


def time_updates(url: str, headers: dict, paths: list[Path], count: int) -> list[float]:
    """Round-trip seconds of `count` updates cycling through `paths`."""
    seconds = []
    for i in range(count):
        start = time.perf_counter()
        response = httpx.post(f"{url}/update_weights", json={"path": str(paths[i % 2])}, headers=headers, timeout=600)
        response.raise_for_status()
        seconds.append(time.perf_counter() - start)
    return seconds


async def generate(url: str, headers: dict, model: str, requests: int, tokens: int) -> tuple[int, float]:
    """(completion tokens, wall seconds) for `requests` concurrent completions."""
    body = {"model": model, "prompt": "Reverse: the cat sees a red ball", "max_tokens": tokens,
            "temperature": 1.0, "ignore_eos": True, "return_token_ids": True}
    limits = httpx.Limits(max_connections=requests)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:

        async def one(seed: int) -> int:
            response = await client.post("/v1/completions", json={**body, "seed": seed})
            response.raise_for_status()
            return len(response.json()["choices"][0]["token_ids"])

        await one(-1)  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(requests)))
        return sum(counts), time.perf_counter() - start


def machine() -> str:
    """What the figures were measured on (they mean nothing without it)."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    load = os.getloadavg()[0]
    return f"{platform.node()}: CPU {cpu}, {os.cpu_count()} cores, load average {load:.1f} at the end"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--updates", type=int, default=7)
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    with tempfile.TemporaryDirectory() as work:
        model_dir = Path(cfg.model.name).resolve()
        copy = Path(shutil.copytree(model_dir, Path(work) / "weights"))
        start = time.perf_counter()
        server = start_server(args.config, [*args.overrides, f"inference.weights_root={work}"],
                              output=Path(work) / "server.out")
        try:
            server.wait_healthy(timeout_s=900)
            startup = time.perf_counter() - start
            headers = server.headers  # the run's secret (or inference.api_key_env's key)
            updates = time_updates(server.url, headers, [copy, model_dir], args.updates)
            tokens, wall = asyncio.run(generate(server.url, headers, cfg.model.name, args.requests, args.tokens))
        finally:
            server.stop()
    result = {"machine": machine(), "startup_s": round(startup, 2), "update_median_s": round(statistics.median(updates), 4),
              "update_s": [round(s, 4) for s in updates], "requests": args.requests, "tokens": tokens,
              "generate_wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
