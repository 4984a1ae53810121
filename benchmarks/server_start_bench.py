"""How long prl's inference servers take to start on K GPUs of one machine, and what they then generate,
for each way of running K vLLM replicas there.

    python benchmarks/server_start_bench.py --preset qwen2-1.5b --gpus 3 --variants servers,dp,servers,dp-api1
    python benchmarks/server_start_bench.py --model DIR --gpus 2 --variants dp,servers   # any model directory

Variants (each started by prl's own `python jobs/inference.py CONFIG`, so with prl's vLLM flags):
- `dp`: one server with vLLM's data parallelism over the K GPUs (what inference.data_parallel=K runs:
  vLLM then starts K API-server processes, K engine processes and a worker process under each);
- `dp-api1`: the same with `--api-server-count 1` (one front end for the K engines);
- `dp-uni`: the same with `--distributed-executor-backend uni` (each engine runs its model itself);
- `servers`: K independent servers, one per GPU, each on its own port (vLLM's single-GPU path).
A variant may be listed twice: the first start of a model shape compiles it, later ones load the
compile cache, as a requeued attempt of a run does.

Per variant: seconds from the start to every server answering /health (with --no-batches, only that), then the loop's batch (the toy
task's first 256 prompts x 1024 tokens, each with its seed, sampled logprobs, token ids in and out:
`POST /prl/generate`, the token route) twice, spread round-robin over the servers: the first batch's
seconds (one-time costs of the first requests included) and the second's tok/s; then the same batch
without logprobs (what trainer.behaviour_logprobs=recompute asks). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

import httpx
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rl_bench import build_model, machine  # noqa: E402
from rl_bench_engine import prompt_ids, step0_inputs  # noqa: E402

from prl.inference.standalone import LocalServer, start_server  # noqa: E402
from prl.orchestrator.dataset import SEED_KEY  # noqa: E402

VARIANT_ARGS = {"dp": [], "dp-api1": ["--api-server-count", "1"], "dp-uni": ["--distributed-executor-backend", "uni"]}
PORT = 18400


def server_config(model: Path, work: Path, gpus: int, extra_args: list[str], max_model_len: int) -> Path:
    """A run config for jobs/inference.py: `gpus` GPUs and replicas (on a machine without any: vLLM on CPU)."""
    on_gpu = shutil.which("nvidia-smi") is not None
    config = {
        "run": {"name": "start-bench", "output_dir": str(work / "runs"), "wandb": {"mode": "disabled"}},
        "model": {"name": str(model), "dtype": "bfloat16", "max_model_len": max_model_len},
        "inference": {"gpus_per_node": gpus if on_gpu else 0, "data_parallel": gpus, "gpu_memory_utilization": 0.85,
                      "extra_args": extra_args},
        "orchestrator": {"environment": {"id": "prl.envs.toy"}},
    }
    path = work / f"start-bench-{gpus}-{'_'.join(a.strip('-') for a in extra_args) or 'plain'}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start(variant: str, args: argparse.Namespace, model: Path, run: int) -> list[LocalServer]:
    """The variant's servers, started at once (each its own process group, output under --work)."""
    max_len = args.completion_tokens + 512
    if variant == "servers":
        config = server_config(model, args.work, 1, [], max_len)
        return [start_server(config, output=args.work / f"{variant}{run}-gpu{i}.out", port=PORT + i,
                             log_dir=args.work / f"logs-{variant}{run}-{i}", env={"CUDA_VISIBLE_DEVICES": str(i)})
                for i in range(args.gpus)]
    config = server_config(model, args.work, args.gpus, VARIANT_ARGS[variant], max_len)
    visible = ",".join(str(i) for i in range(args.gpus))
    return [start_server(config, output=args.work / f"{variant}{run}.out", port=PORT,
                         log_dir=args.work / f"logs-{variant}{run}", env={"CUDA_VISIBLE_DEVICES": visible})]


async def batch(servers: list[LocalServer], bodies: list[dict]) -> dict:
    """Every request at once, request i to server i mod K (the orchestrator's round robin by group)."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(headers=servers[0].headers, timeout=600, limits=limits) as client:
        begin = time.perf_counter()

        async def one(i: int, body: dict) -> int:
            response = await client.post(f"{servers[i % len(servers)].url}/prl/generate", json=body)
            response.raise_for_status()
            return len(response.json()["token_ids"])

        tokens = sum(await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies))))
    seconds = time.perf_counter() - begin
    return {"seconds": round(seconds, 2), "tok_s": round(tokens / seconds)}


def measure(variant: str, args: argparse.Namespace, model: Path, bodies: list[dict], run: int) -> dict:
    begin = time.perf_counter()
    servers = start(variant, args, model, run)
    try:
        for server in servers:
            server.wait_healthy(timeout_s=args.timeout)
        result = {"variant": variant, "servers": len(servers), "ready_s": round(time.perf_counter() - begin, 1)}
        if not args.no_batches:
            first = asyncio.run(batch(servers, bodies))
            second = asyncio.run(batch(servers, bodies))
            plain = [{**b, "logprobs": False} for b in bodies]
            result |= {"first_batch": first, "second_batch": second,
                       "no_logprobs": asyncio.run(batch(servers, plain))}
    except Exception as e:  # a variant vLLM refuses is a result too; the next one still runs
        result = {"variant": variant, "error": f"{type(e).__name__}: {str(e)[-2000:]}"}
    finally:
        for server in servers:
            server.stop()
    print(json.dumps(result), flush=True)
    return result


def loop_bodies(model: Path, args: argparse.Namespace) -> list[dict]:
    """The orchestrator's batch 0 as the token route sends it (prl.orchestrator.tokens)."""
    _, groups = step0_inputs(args.batch_size)
    items = [item for group in groups for item in group]
    sampling = {"temperature": 1.0, "max_tokens": args.completion_tokens, "ignore_eos": True}
    return [{"token_ids": ids, "sampling_params": {**sampling, "seed": item[SEED_KEY]}}
            for ids, item in zip(prompt_ids(str(model), groups), items)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2-1.5b")
    parser.add_argument("--model", type=Path, help="a model directory instead of --preset's random one")
    parser.add_argument("--gpus", type=int, default=2, help="K: GPUs 0..K-1, one replica each")
    parser.add_argument("--variants", default="servers,dp,servers,dp-api1")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--no-batches", action="store_true", help="only the start: stop each variant once it is healthy")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
    parser.add_argument("--work", type=Path, default=Path("/tmp/server_start_bench"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    where = machine()
    print(where, flush=True)
    model = args.model or build_model(args.preset, args.work)
    bodies = [] if args.no_batches else loop_bodies(model, args)
    results = [measure(v, args, model, bodies, run) for run, v in enumerate(args.variants.split(","))]
    out = {"machine": where, "gpus": args.gpus, "batch": [args.batch_size, args.completion_tokens], "results": results}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    main()
