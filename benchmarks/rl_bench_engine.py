"""rl_bench's two engine-side measurements, each in a process of its own (GPU memory freed after).

    python benchmarks/rl_bench_engine.py offline MODEL_DIR --batch-size 256 --completion-tokens 1024 --memory '{...}'
    python benchmarks/rl_bench_engine.py server RUN_CONFIG.yaml

Both send the batch the orchestrator sends at step 0: the toy environment's prompts, 8 rollouts per
prompt, each rollout's own seed, exactly --completion-tokens tokens (ignore_eos), temperature 1.
`offline`: vLLM's LLM.generate, plain and with what the loop asks for (logprobs, per-request seeds,
no text, flat logprobs: the token route's request), one piece at a time.
`server`: prl's server (jobs/inference.py) by plain HTTP, completions and chat, then through the
orchestrator's own code (verifiers + scoring). The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

from prl.config import EnvironmentConfig, load_config
from prl.orchestrator.dataset import SEED_KEY, example_indices, load_env, rollout_groups

GROUP = 8
LOOP_REQUEST = "logprobs + seeds, detokenize=False, flat_logprobs (the token route's request)"
RECOMPUTE_REQUEST = "seeds, detokenize=False"
"""The token route's request when the trainer recomputes the logprobs (trainer.behaviour_logprobs)."""


def fastest_plain(variants: dict) -> float:
    """tok/s of the fastest of rl_bench's offline variants without logprobs: the engine's speed on these
    GPUs, the generation time of issue 24's efficiency (rl_bench). Until 2026-11-28 the
    "plain" variant alone, which detokenizes: 0.87 of the fastest on one H100, so a generation-bound row
    read higher."""
    return max(v["tok_s"] for name, v in variants.items() if "logprobs" not in name)


def step0_inputs(batch_size: int, env_id: str = "prl.envs.toy") -> tuple[object, list[list[dict]]]:
    """(environment, groups) of the orchestrator's batch 0 with run.seed 0."""
    env = load_env(EnvironmentConfig(id=env_id))
    dataset = env.get_dataset()
    indices = example_indices(0, 0, batch_size // GROUP, len(dataset))
    return env, rollout_groups(dataset, indices, GROUP, 0, 0)


def prompt_ids(model: str, groups: list[list[dict]]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = [tok.apply_chat_template(item["prompt"], tokenize=False, add_generation_prompt=True)
             for group in groups for item in group]
    return [tok(text, add_special_tokens=False)["input_ids"] for text in texts]


def stop_ids(count: int) -> list[int]:
    """`count` token ids that end a completion (rl_bench --stop-tokens): under random weights each is
    about as likely as any token, so completions end after about vocabulary / count tokens, or at
    --completion-tokens: lengths that vary as real ones do. The same ids offline and in the loop."""
    return list(range(1000, 1000 + count))


def offline(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams

    memory = json.loads(args.memory)
    kwargs = {"gpu_memory_utilization": memory["gpu_memory_utilization"]}
    if "--kv-cache-memory-bytes" in memory["extra_args"]:
        kwargs["kv_cache_memory_bytes"] = int(memory["extra_args"][memory["extra_args"].index("--kv-cache-memory-bytes") + 1])
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=args.completion_tokens + 512, seed=0,
              generation_config="vllm", logprobs_mode="processed_logprobs", **kwargs)
    startup = time.perf_counter() - start
    _, groups = step0_inputs(args.batch_size)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(args.model, groups)]
    seeds = [item[SEED_KEY] for group in groups for item in group]
    base = dict(temperature=1.0, max_tokens=args.completion_tokens, ignore_eos=True,
                stop_token_ids=stop_ids(args.stop_tokens))
    quiet = dict(base, detokenize=False)  # no text: what /prl/generate asks for
    variants = {
        "plain": SamplingParams(**base),
        "plain, detokenize=False": SamplingParams(**quiet),
        RECOMPUTE_REQUEST: [SamplingParams(**quiet, seed=s) for s in seeds],
        "logprobs": SamplingParams(**base, logprobs=0),
        "logprobs + per-request seeds (the chat route's request)": [SamplingParams(**base, logprobs=0, seed=s) for s in seeds],
        # No detokenizer: the logprobs of the sampled tokens come back as floats, no per-token text.
        "logprobs + seeds, detokenize=False": [SamplingParams(**quiet, logprobs=0, seed=s) for s in seeds],
        LOOP_REQUEST: [SamplingParams(**quiet, logprobs=0, seed=s, flat_logprobs=True) for s in seeds],
    }
    llm.generate(prompts[:GROUP], SamplingParams(temperature=1.0, max_tokens=16), use_tqdm=False)  # warm-up

    def timed(params) -> dict:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "mean_len": tokens / len(outputs)}

    results = {name: timed(params) for name, params in variants.items()}
    # The same requests again while another process keeps another GPU busy (a trainer's step, or
    # matmuls alone): what the loop's engine loses to what runs beside it on the same machine.
    for label, argv in json.loads(args.beside):
        with beside(argv):
            for name in BESIDE_VARIANTS:
                results[f"{name}, beside {label}"] = timed(variants[name])
        for name in BESIDE_VARIANTS:  # and alone again right after: drift between the two
            results[f"{name}, alone after {label}"] = timed(variants[name])
    return {"startup_s": startup, "variants": results}


BESIDE_VARIANTS = ("plain, detokenize=False", RECOMPUTE_REQUEST)


@contextlib.contextmanager
def beside(argv: list[str], timeout_s: float = 300.0):
    """`argv` running (its own process group) from its "busy" line until the block ends."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        lines = []
        while (line := proc.stdout.readline()) and line.strip() != "busy":
            lines.append(line)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv}: not busy after {timeout_s:.0f}s")
        if proc.poll() is not None:
            raise RuntimeError(f"{argv} exited {proc.returncode}:\n{''.join(lines[-30:])}")
        yield
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def http_batch(url: str, path: str, bodies: list[dict], headers: dict[str, str]) -> dict:
    """All requests at once; tok/s and when each request finished (the end-of-batch barrier's tail)."""
    import httpx

    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    # A request that takes 10 minutes is a hang (the whole batch takes well under one): fail, naming the route.
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        first = bodies[0]
        warm = ({**first, "sampling_params": {**first["sampling_params"], "max_tokens": 8}} if "sampling_params" in first
                else {**first, "max_tokens": 8})
        (await client.post(path, json=warm)).raise_for_status()  # warm-up
        start = time.perf_counter()

        async def one(body: dict) -> tuple[int, float]:
            response = await client.post(path, json=body)
            response.raise_for_status()
            data = response.json()  # prl's /prl/generate answers ids at the top level
            ids = data["token_ids"] if "token_ids" in data else data["choices"][0]["token_ids"]
            return len(ids), time.perf_counter() - start

        done = await asyncio.gather(*(one(b) for b in bodies))
    seconds = max(t for _, t in done)
    finish = sorted(t for _, t in done)
    return {"tok_s": sum(n for n, _ in done) / seconds, "seconds": seconds, "p50_s": statistics.median(finish),
            "p90_s": finish[int(0.9 * (len(finish) - 1))], "last_s": finish[-1]}


async def orchestrator_path(cfg, url: str, key: str, env, groups, route: str) -> dict:
    """generate_step: verifiers' run_group + the route's client + scoring + samples, as the loop runs it."""
    from prl.orchestrator.client import Servers
    from prl.orchestrator.dataset import EnvGroups
    from prl.orchestrator.rollouts import generate_step, sampling_args

    orch = cfg.orchestrator
    tokenizer = cfg.model.name if route == "tokens" else None
    servers = Servers([f"{url}/v1"], key, max_connections=orch.max_concurrent, tokenizer=tokenizer)
    try:
        model = await servers.model_name()
        part = EnvGroups("env", env, groups, sampling_args(orch.sampling, env))
        result = await generate_step([part], servers, model, orch.max_concurrent)
    finally:
        await servers.close()
    return {"tok_s": result.metrics["rollout_tokens_per_s"], "seconds": result.metrics["generation_s"]}


def server(args: argparse.Namespace) -> dict:
    from prl.inference.standalone import start_server

    cfg = load_config(args.config)
    orch, model = cfg.orchestrator, cfg.model.name
    env, groups = step0_inputs(orch.batch_size, orch.train_environments[0].id)
    ids = prompt_ids(model, groups)
    items = [item for group in groups for item in group]
    common = {"model": model, "max_tokens": orch.sampling.max_tokens, "temperature": 1.0, "ignore_eos": True,
              "return_token_ids": True}
    plain = [{**common, "prompt": p} for p in ids]
    chat = [{**common, "messages": item["prompt"]} for item in items]
    chat_lp = [{**b, "logprobs": True} for b in chat]
    chat_loop = [{**b, "seed": item[SEED_KEY]} for b, item in zip(chat_lp, items)]
    sampling = {"temperature": 1.0, "max_tokens": orch.sampling.max_tokens, "ignore_eos": True}
    tokens = [{"token_ids": p, "sampling_params": {**sampling, "seed": item[SEED_KEY]}} for p, item in zip(ids, items)]
    work = Path(args.config).parent
    srv = start_server(Path(args.config), output=work / "diagnose_server.out")
    try:
        srv.wait_healthy(timeout_s=900)
        results = {
            "HTTP completions, token ids in, no logprobs": asyncio.run(http_batch(srv.url, "/v1/completions", plain, srv.headers)),
            "HTTP chat, no logprobs": asyncio.run(http_batch(srv.url, "/v1/chat/completions", chat, srv.headers)),
            "HTTP chat, logprobs": asyncio.run(http_batch(srv.url, "/v1/chat/completions", chat_lp, srv.headers)),
            "HTTP chat, logprobs + seeds (the loop's request)": asyncio.run(http_batch(srv.url, "/v1/chat/completions", chat_loop, srv.headers)),
            "HTTP prl's /prl/generate (ids in, ids + logprob floats out), seeds":
                asyncio.run(http_batch(srv.url, "/prl/generate", tokens, srv.headers)),
            "orchestrator generate_step, chat route (verifiers, scoring)":
                asyncio.run(orchestrator_path(cfg, srv.url, srv.key, env, groups, "chat")),
            "orchestrator generate_step, tokens route (verifiers, scoring)":
                asyncio.run(orchestrator_path(cfg, srv.url, srv.key, env, groups, "tokens")),
        }
    finally:
        srv.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    o = sub.add_parser("offline")
    o.add_argument("model")
    o.add_argument("--batch-size", type=int, default=256)
    o.add_argument("--completion-tokens", type=int, default=1024)
    o.add_argument("--memory", default='{"gpu_memory_utilization": 0.85, "extra_args": []}')
    o.add_argument("--stop-tokens", type=int, default=0, help="stop_ids(N) end completions (0: all full length)")
    o.add_argument("--beside", default="[]", help='JSON [[LABEL, ARGV], ...]: BESIDE_VARIANTS again while each ARGV runs '
                   '(benchmarks/gpu_busy.py on another GPU)')
    s = sub.add_parser("server")
    s.add_argument("config")
    args = parser.parse_args()
    result = offline(args) if args.what == "offline" else server(args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
