"""The orchestrator's CPU per token-route request: the OpenAI client's `post` (what TokenClient used
before) against prl.orchestrator.http_client.ServerRoutes (aiohttp, what it uses now).

    python benchmarks/orchestrator_http_bench.py [--requests 2000] [--concurrency 64] [--rounds 2]

A server in a process of its own answers POST /prl/generate at once with a 16-token answer (ids and
logprobs, the shape prl's route returns), so what is timed is the client: its process CPU and wall
time for `--requests` requests, `--concurrency` in flight, each client `--rounds` times in turn.
Prints the machine, every round, and the ratio OpenAI / aiohttp of the median CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BODY = {"token_ids": list(range(60)), "sampling_params": {"temperature": 1.0, "max_tokens": 16, "seed": 5},
        "logprobs": True}
ANSWER = {"token_ids": list(range(16)), "logprobs": [-0.5] * 16, "finish_reason": "length"}


def serve(port: int) -> None:
    from aiohttp import web

    async def generate(request):
        await request.json()
        return web.json_response(ANSWER)

    app = web.Application()
    app.router.add_post("/prl/generate", generate)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def with_openai(url: str, requests: int, concurrency: int) -> None:
    from openai import AsyncOpenAI

    client, gate = AsyncOpenAI(base_url=url, api_key="k", max_retries=3), asyncio.Semaphore(concurrency)

    async def one():
        async with gate:
            return await client.post("/prl/generate", body=BODY, cast_to=object)

    await asyncio.gather(*(one() for _ in range(requests)))
    await client.close()


async def with_routes(url: str, requests: int, concurrency: int) -> None:
    from prl.orchestrator.http_client import ServerRoutes

    client, gate = ServerRoutes(url, "k", timeout_s=600), asyncio.Semaphore(concurrency)

    async def one():
        async with gate:
            return await client.post("/prl/generate", BODY)

    await asyncio.gather(*(one() for _ in range(requests)))
    await client.close()


def wait_listening(port: int) -> None:
    for _ in range(200):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit("the stand-in server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = multiprocessing.Process(target=serve, args=(port,), daemon=True)
    server.start()
    wait_listening(port)
    url = f"http://127.0.0.1:{port}"
    print(f"machine: {platform.node()}, {platform.processor() or platform.machine()}, {multiprocessing.cpu_count()} cores; "
          f"{args.requests} requests, {args.concurrency} in flight")
    per_request: dict[str, list[float]] = {"openai": [], "aiohttp": []}
    for round_ in range(args.rounds):
        for name, run in (("openai", with_openai), ("aiohttp", with_routes)):
            wall, cpu = time.perf_counter(), time.process_time()
            asyncio.run(run(url, args.requests, args.concurrency))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            per_request[name].append(1000 * cpu / args.requests)
            print(f"round {round_} {name:8s} wall {wall:6.2f} s  client CPU {cpu:6.2f} s  "
                  f"{per_request[name][-1]:.2f} ms/request  {args.requests / wall:7.0f} requests/s")
    a, b = (statistics.median(per_request[name]) for name in ("openai", "aiohttp"))
    print(f"median client CPU per request: openai {a:.2f} ms, aiohttp {b:.2f} ms; openai / aiohttp = {a / b:.2f}")
    server.terminate()


if __name__ == "__main__":
    main()
