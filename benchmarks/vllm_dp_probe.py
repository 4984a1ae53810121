"""Can vLLM run one data-parallel server across nodes here, and what does it give against independent
servers? Plain `vllm serve` (no prl), two "nodes" of one GPU each on this machine, same model, one run.

    python benchmarks/vllm_dp_probe.py --model /tmp/m15 --json out.json      # a machine of 2+ GPUs

- dp: a head (`--data-parallel-size 2 --data-parallel-size-local 1`, the API endpoint, engine rank 0 on
  GPU 0) and a headless node (`--headless --data-parallel-start-rank 1`, engine rank 1 on GPU 1), joined
  through --data-parallel-address/--data-parallel-rpc-port: what issue 22 item 4 asks prl to wire;
- independent: one server per GPU, requests split between them by the client (what prl does today).
Each serves --requests concurrent completions of exactly --tokens tokens (ignore_eos, T=1) after a
warm-up; completion tokens / wall time. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], gpu: str, log: Path) -> subprocess.Popen:
    env = os.environ | {"CUDA_VISIBLE_DEVICES": gpu, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    return subprocess.Popen(argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited: {[p.returncode for p in procs]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout_s}s")


async def throughput(urls: list[str], model: str, requests: int, tokens: int) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(i: int) -> int:
            r = await client.post(f"{urls[i % len(urls)]}/v1/completions", json={
                "model": model, "prompt": f"Count to a thousand, number {i}:", "max_tokens": tokens,
                "min_tokens": tokens, "ignore_eos": True, "temperature": 1.0, "seed": i})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]
        await asyncio.gather(*(one(i) for i in range(len(urls) * 2)))  # warm-up
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(i) for i in range(requests)))
        return sum(done) / (time.perf_counter() - t0)


def common(model: str, max_len: int) -> list[str]:
    return [model, "--dtype", "bfloat16", "--max-model-len", str(max_len), "--gpu-memory-utilization", "0.8",
            "--seed", "0"]


def run_dp(args, work: Path) -> dict:
    port, rpc = free_port(), free_port()
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
          "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc)]
    head = start([*VLLM, *common(args.model, args.max_len), "--port", str(port), *dp], "0", work / "dp_head.log")
    headless = start([*VLLM, *common(args.model, args.max_len), *dp, "--headless", "--data-parallel-start-rank", "1"],
                     "1", work / "dp_headless.log")
    try:
        ready = wait_healthy(f"http://127.0.0.1:{port}", [head, headless], args.timeout)
        tps = asyncio.run(throughput([f"http://127.0.0.1:{port}"], args.model, args.requests, args.tokens))
        return {"ready_s": round(ready, 1), "tok_s": round(tps)}
    finally:
        stop([head, headless])


def run_independent(args, work: Path) -> dict:
    ports = [free_port(), free_port()]
    procs = [start([*VLLM, *common(args.model, args.max_len), "--port", str(p)], str(g), work / f"ind_{g}.log")
             for g, p in enumerate(ports)]
    try:
        ready = max(wait_healthy(f"http://127.0.0.1:{p}", procs, args.timeout) for p in ports)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        tps = asyncio.run(throughput(urls, args.model, args.requests, args.tokens))
        one = asyncio.run(throughput(urls[:1], args.model, args.requests // 2, args.tokens))
        return {"ready_s": round(ready, 1), "tok_s": round(tps), "one_server_tok_s": round(one)}
    finally:
        stop(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--work", type=Path, default=Path("/tmp/dp-probe"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict = {"gpus": subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines(),
                    "requests": args.requests, "tokens": args.tokens}
    for name, fn in (("independent", run_independent), ("dp", run_dp)):
        try:
            result[name] = fn(args, args.work)
        except Exception as e:  # the log says why; the other layout is still measured
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, result[name], flush=True)
    if "tok_s" in result.get("dp", {}) and "tok_s" in result.get("independent", {}):
        result["dp_vs_independent"] = round(result["dp"]["tok_s"] / result["independent"]["tok_s"], 3)
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
