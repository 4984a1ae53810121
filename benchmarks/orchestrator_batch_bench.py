"""The orchestrator's own time for one batch, everything but the engine: the loop's batch (the toy
environment, 32 prompts x 8 rollouts) through prl's token route (verifiers, TokenClient, aiohttp) to a
server that answers at once, then scored, packed and written as the loop writes it.

    python benchmarks/orchestrator_batch_bench.py MODEL_DIR [--batch-size 256] [--completion-tokens 1024] [--rounds 4]

Why: at 1.5B on 1 + 1 a step's generation is 10-12 s, and the orchestrator's work before the first
request reaches the server and after the last answer comes back is on the step's path
(docs/performance.md, "The 1 + 1 loop second by second": 1-1.5 s between two batches' generation,
the weight update's 0.2-0.7 s among it). This times that work without a GPU.

The server, a process of its own, answers /tokenize (ids of the prompt's length), /prl/generate
(--completion-tokens random ids of the model's vocabulary, one of ANSWERS in turn, no logprobs:
the trainer recomputes them) at once and records when each /prl/generate arrived (one machine, one clock). Per round, from the
batch's start: the last request's arrival (dispatch), the end of generate_step (every answer parsed
and the groups scored) and of write_step (packed and written); the orchestrator's CPU seconds over
the whole. The first round includes what a batch pays once (connections, first use of each path).
--rounds rounds with the heap as built, then --rounds more once it is frozen as the orchestrator
freezes it before its first batch (prl.orchestrator.loop.freeze_startup_heap): the A/B of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import platform
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ANSWERS = 37
"""Distinct completions the server answers with, in turn (prime: a group of 8 never repeats one)."""


def serve(port: int, vocab: int, tokens: int) -> None:
    from aiohttp import web

    arrivals: list[float] = []
    rng = random.Random(0)
    # ANSWERS answers, made once and taken in turn: on a 2-core machine the server's own work would
    # otherwise take the orchestrator's CPU (262,144 random ids a batch); a group's rollouts still
    # differ, so its rewards do, and the batch is packed and written as a real one is.
    answers = [json.dumps({"token_ids": [rng.randrange(vocab) for _ in range(tokens)], "logprobs": None,
                           "finish_reason": "length"}) for _ in range(ANSWERS)]

    async def tokenize(request):
        body = await request.json()
        text = json.dumps(body["messages"])
        return web.json_response({"tokens": [rng.randrange(vocab) for _ in range(len(text) // 4 + 8)]})

    async def generate(request):
        await request.read()
        arrivals.append(time.time())
        return web.Response(text=answers[len(arrivals) % ANSWERS], content_type="application/json")

    async def taken(request):  # the arrivals so far, then forgotten
        out = list(arrivals)
        arrivals.clear()
        return web.json_response(out)

    async def health(request):
        return web.json_response({})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/prl/generate", generate)
    app.router.add_get("/arrivals", taken)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def arrivals(port: int) -> list[float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/arrivals") as response:
        return json.loads(response.read())


async def rounds(args: argparse.Namespace, port: int) -> list[dict]:
    from prl.config import load_config
    from prl.orchestrator.client import Servers
    from prl.orchestrator.dataset import load_train_envs, step_parts
    from prl.orchestrator.loop import freeze_startup_heap
    from prl.orchestrator.rollouts import generate_step, sampling_args, write_step
    from prl.run.rundir import RunDir

    work = Path(tempfile.mkdtemp(prefix="orchestrator_batch_"))
    cfg = load_config(ROOT / "configs/toy.yaml", [
        f"model.name={args.model}", f"run.output_dir={work}", "run.name=bench",
        f"orchestrator.batch_size={args.batch_size}", f"orchestrator.max_concurrent={args.batch_size}",
        f"orchestrator.sampling.max_tokens={args.completion_tokens}", "trainer.behaviour_logprobs=recompute"])
    rd = RunDir(work / "bench")
    rd.rollouts.mkdir(parents=True, exist_ok=True)
    envs = load_train_envs(cfg)
    sampling = [sampling_args(cfg.orchestrator.sampling, e.env) for e in envs]
    servers = Servers([f"http://127.0.0.1:{port}/v1"], None, max_connections=args.batch_size, tokenizer=args.model,
                      logprobs=False)
    out = []
    try:
        for step in range(2 * args.rounds):  # --rounds as the heap is, then as the orchestrator freezes it
            if step == args.rounds:
                freeze_startup_heap()
            parts = step_parts(envs, sampling, cfg.orchestrator.rollouts_per_example, cfg.run.seed, step)
            cpu, began, wall = time.process_time(), time.perf_counter(), time.time()
            result = await generate_step(parts, servers, args.model, cfg.orchestrator.max_concurrent)
            generated = time.perf_counter() - began
            write_step(cfg, rd, step, result, {"policy_version": 0.0}, began, {})
            written = time.perf_counter() - began
            seen = arrivals(port)
            out.append({"frozen": step >= args.rounds, "dispatch_s": max(seen) - wall, "generate_step_s": generated, "write_step_s": written,
                        "cpu_s": time.process_time() - cpu, "requests": len(seen)})
    finally:
        await servers.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model directory with a tokenizer (tools/make_tiny_model.py's, bench_model.py's)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from prl.run.ports import free_port

    vocab = len(AutoTokenizer.from_pretrained(args.model))
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(port, vocab, args.completion_tokens),
                                                          daemon=True)
    server.start()
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health").close()
                break
            except OSError:
                time.sleep(0.1)
        rows = asyncio.run(rounds(args, port))
    finally:
        server.terminate()
        server.join()
    print(f"machine: {platform.node()}, {platform.processor() or platform.machine()}, {multiprocessing.cpu_count()} cores; "
          f"{args.batch_size} rollouts x {args.completion_tokens} tokens, model {args.model} ({vocab} ids)")
    print("| round | heap | dispatch s (last request in) | generate_step s | + write_step s | orchestrator CPU s | requests |\n"
          "| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for i, row in enumerate(rows):
        print(f"| {i} | {'frozen' if row['frozen'] else 'as built'} | {row['dispatch_s']:.3f} | {row['generate_step_s']:.3f} | "
              f"{row['write_step_s']:.3f} | {row['cpu_s']:.2f} | {row['requests']} |")
    means = {}
    for frozen in (False, True):
        later = [r["write_step_s"] for r in rows if r["frozen"] == frozen][1:]  # the first: what a batch pays once
        means[frozen] = statistics.fmean(later)
        print(f"{'frozen' if frozen else 'as built'}, rounds after the first: batch {means[frozen]:.3f} s mean, "
              f"{statistics.median(later):.3f} median, {min(later):.3f}-{max(later):.3f}")
    print(f"frozen / as built (mean batch; a step waits for each): {means[True] / means[False]:.2f}")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
