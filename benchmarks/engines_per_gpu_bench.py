"""Whether a second vLLM engine on the same GPU adds rollouts: k engines in k processes on one GPU, the
loop's batch split between them and generated at the same moment, against one engine with all of it,
measured in the same call.

    python benchmarks/engines_per_gpu_bench.py MODEL_DIR --engines 1,2,1 --kv-cache-gib 16

Why: at 1.5B the loop's one engine keeps its engine core's thread at 96 % of a CPU core while its GPU
is busy 39 % of the time (benchmarks/results/h200x2-2026-11-28i): it is bound by that thread, not the
GPU. Each engine has a thread of its own, so k engines could fill the GPU's idle time, if their steps
interleave on it. This asks the GPU, before prl runs several servers on one.

Each engine: vLLM's LLM in its own process (the GPUs CUDA_VISIBLE_DEVICES names, the first of them),
a KV cache of --kv-cache-gib (no profiling of the memory the others hold), the orchestrator's batch 0
(rl_bench_engine's prompts and per-request seeds, --completion-tokens each, no text: the token
route's request when the trainer recomputes the logprobs), its share of it (engine i takes requests
i, i + k, ...). Engines start one after another (concurrent starts would each see the others' memory
as their own), warm up, then wait at a barrier; all generate at once. The rate is all engines' tokens
over the span from the first start to the last end. The machine comes first (rl_bench's line), and
the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
READY_TIMEOUT_S = 600.0
RESULT = "engines_per_gpu_bench result: "
"""An engine's line with its share's figures (vLLM logs on after it, as it shuts down)."""


def engine(args: argparse.Namespace) -> dict:
    """One engine's share, generated once the barrier opens: its wall-clock start and end, its tokens."""
    import torch
    from vllm import LLM, SamplingParams

    from prl.orchestrator.dataset import SEED_KEY

    sys.path.insert(0, str(HERE))
    from rl_bench_engine import GROUP, prompt_ids, step0_inputs

    memory = {}
    if torch.cuda.is_available():  # CPU vLLM sizes its cache by VLLM_CPU_KVCACHE_SPACE
        memory = {"gpu_memory_utilization": args.gpu_memory_utilization,
                  "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30)}
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.completion_tokens + 512, seed=0,
              generation_config="vllm", enforce_eager=args.enforce_eager, **memory)
    _, groups = step0_inputs(args.batch_size)
    ids = prompt_ids(args.model, groups)
    seeds = [item[SEED_KEY] for group in groups for item in group]
    mine = range(args.index, len(ids), args.engines)
    prompts = [{"prompt_token_ids": ids[i]} for i in mine]
    params = [SamplingParams(temperature=1.0, max_tokens=args.completion_tokens, ignore_eos=True, detokenize=False,
                             seed=seeds[i]) for i in mine]
    llm.generate(prompts[:GROUP], SamplingParams(temperature=1.0, max_tokens=16), use_tqdm=False)  # warm-up
    barrier = Path(args.barrier)
    (barrier / f"ready_{args.index}").touch()
    while not (barrier / "go").exists():
        time.sleep(0.005)
    start = time.time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    end = time.time()
    return {"start": start, "end": end, "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "requests": len(prompts)}


def run_engines(args: argparse.Namespace, k: int, work: Path) -> dict:
    """k engines on the same GPU(s), started one by one, released together; their combined rate."""
    barrier = Path(tempfile.mkdtemp(prefix=f"engines{k}_", dir=work))
    procs, logs = [], []
    try:
        for i in range(k):
            log = barrier / f"engine_{i}.out"
            logs.append(log)
            argv = [sys.executable, __file__, args.model, "--index", str(i), "--engines", str(k),
                    "--barrier", str(barrier), "--batch-size", str(args.batch_size),
                    "--completion-tokens", str(args.completion_tokens), "--kv-cache-gib", str(args.kv_cache_gib),
                    "--gpu-memory-utilization", str(args.gpu_memory_utilization / k), "--dtype", args.dtype]
            argv += ["--enforce-eager"] if args.enforce_eager else []
            with open(log, "w") as out:
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            wait_for(barrier / f"ready_{i}", procs[-1], log)
        (barrier / "go").touch()
        shares = []
        for proc, log in zip(procs, logs):
            if proc.wait(timeout=READY_TIMEOUT_S) != 0:
                raise RuntimeError(f"engine exited with {proc.returncode}: {log.read_text()[-3000:]}")
            lines = [line for line in log.read_text().splitlines() if line.startswith(RESULT)]
            shares.append(json.loads(lines[-1].removeprefix(RESULT)))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
                proc.wait()
    span = max(s["end"] for s in shares) - min(s["start"] for s in shares)
    tokens = sum(s["tokens"] for s in shares)
    return {"engines": k, "tok_s": tokens / span, "seconds": span, "tokens": tokens,
            "each_s": [s["end"] - s["start"] for s in shares]}


def wait_for(ready: Path, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode} before it was ready: {log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine not ready after {READY_TIMEOUT_S:.0f} s: {log}")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--engines", default="1,2", help="engine counts to measure, in this order")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=float, default=16.0, help="each engine's KV cache")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                        help="the engines' share of the GPU together (each takes 1/k of it)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (CPU vLLM)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "engines_per_gpu")
    # Set by the benchmark for each engine it starts:
    parser.add_argument("--barrier", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.barrier:
        args.engines = int(args.engines)
        print(RESULT + json.dumps(engine(args)), flush=True)
        return
    sys.path.insert(0, str(HERE))
    from rl_bench import machine

    print(f"machine: {machine()}", flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    rows = [run_engines(args, int(k), args.work) for k in args.engines.split(",")]
    base = rows[0]["tok_s"]
    print(f"{args.batch_size} requests x {args.completion_tokens} tokens, seeds, detokenize=False; model {args.model}")
    print("| engines on the GPU | tok/s | vs the first row | s | each engine's s |\n| ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        each = ", ".join(f"{s:.2f}" for s in row["each_s"])
        print(f"| {row['engines']} | {row['tok_s']:,.0f} | {row['tok_s'] / base:.2f} | {row['seconds']:.2f} | {each} |")
    print(json.dumps({"rows": rows}), flush=True)


if __name__ == "__main__":
    main()
