"""Where the trainer's first step goes, with and without `trainer.prewarm`: each variant a fresh process
with empty compile caches (a SLURM job's first attempt: its caches live under /tmp/prl-JOBID), the
loop's model and micro-batches, then its first steps one by one.

    python benchmarks/first_step_bench.py --preset qwen2-1.5b --variants none,prewarm --steps 3    # one GPU
    python benchmarks/first_step_bench.py --model .cache/tiny-qwen2 --micro-batches 2 --sample-len 200 --max-len 256 --steps 2   # CPU
    python benchmarks/first_step_bench.py --preset qwen2-1.5b --variants prewarm --stop-tokens 300 --steps 4
    python benchmarks/first_step_bench.py --preset qwen2-1.5b --variants prewarm --stop-tokens 300 \
        --micro-batch-tokens 12288 --steps 4      # the same lengths packed by tokens (trainer.micro_batch_tokens)

Per variant: the prewarm's seconds, each step's seconds, and what torch compiled before the first
step and in each step (Dynamo's frames and graphs, Inductor's FX-graph cache misses, Triton kernels
built): a step that is slow but compiled nothing spent its time at run time (the allocator, say).
The children's stderr is this process's: with TORCH_LOGS=recompiles,graph_breaks it says why.
The workload is rl_bench's: 256 samples of 1,053 tokens (29 prompt, 1,024 completion) as 32
micro-batches of 8, trainer.compile on, bf16 on GPU. With --stop-tokens N the completions vary as
rl_bench's option of that name makes them with a random-weight model (each token ends one with
probability N / vocabulary, at most 1,024 tokens; new lengths every step),
packed as the orchestrator packs them (prl.run.packing.pack_batch: --micro-batch samples, or
--micro-batch-tokens): on 4 x H100 such a loop's first step trained for 38 s against 7.4 s with fixed
lengths (benchmarks/reports/loop-1p1-recompute-continuous_h100x4_2026-11-28.md). The last stdout line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def compiled_so_far() -> dict:
    """Dynamo's counters so far: frames compiled, graphs, Inductor's FX-graph cache hits and misses."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    # Triton builds a kernel anew for each specialization of its integer arguments (divisible by 16 or
    # not, ...) without Dynamo compiling anything: its cache directory (a fresh one per variant) has an
    # entry per kernel built.
    triton = Path(os.environ.get("TRITON_CACHE_DIR", "/nonexistent"))
    return {"frames": counters["frames"].get("total", 0), "graphs": counters["stats"].get("unique_graphs", 0),
            "fxgraph_miss": inductor.get("fxgraph_cache_miss", 0), "fxgraph_hit": inductor.get("fxgraph_cache_hit", 0),
            "triton_kernels": sum(1 for _ in triton.iterdir()) if triton.is_dir() else 0}


def varied_batch(step: int, args: argparse.Namespace, vocab: int):
    """--samples rollouts of 29 prompt tokens and a completion that each token ends with probability
    --stop-tokens / vocab (1 to 1,024 tokens), drawn anew each step, packed by prl.run.packing.pack_batch."""
    import torch

    from prl.run.batch import Batch
    from prl.run.packing import Sample, pack_batch

    generator = torch.Generator().manual_seed(1_000_003 + step)
    # P(length >= n) = q^(n - 1), q = 1 - N / vocab: the inverse of that distribution at a uniform draw.
    uniform = torch.rand(args.samples, generator=generator, dtype=torch.float64)
    lengths = (1 + (uniform.log() / math.log(1 - args.stop_tokens / vocab)).floor()).clamp(max=1024).long().tolist()
    samples = [Sample(torch.randint(0, vocab, (29 + n,), generator=generator).tolist(), [False] * 29 + [True] * n,
                      [0.0] * 29 + [-1.0] * n, float(torch.randn((), generator=generator))) for n in lengths]
    micro_batches = pack_batch(samples, 1, args.micro_batch, args.micro_batch_tokens)
    return Batch(step=step, policy_version=step, micro_batches=micro_batches, metrics={"reward_mean": 0.0})


def child(args: argparse.Namespace) -> dict:
    """One variant, in this process: build, prewarm or not, then --steps steps."""
    import torch
    import torch.distributed as dist

    from prl.config import LossConfig, ModelConfig, TrainerConfig
    from prl.trainer.loss import build_loss
    from prl.trainer.model import build_model
    from prl.trainer.prewarm import micro_batch_lengths, prewarm
    from prl.trainer.samples import synthetic_batch
    from prl.trainer.train import accumulate, build_optimizer, train_step

    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = TrainerConfig(gpus_per_node=1 if gpu else 0, lr=1e-6, compile=True, micro_batch_size=args.micro_batch,
                        micro_batch_tokens=args.micro_batch_tokens)
    model_cfg = ModelConfig(name=str(args.model), dtype="bfloat16" if gpu else "float32", max_model_len=args.max_len)
    begin = time.perf_counter()
    model = build_model(model_cfg, cfg, 1.0, device)
    optimizer, scheduler = build_optimizer(model, cfg, device)
    result = {"variant": args.child, "build_s": round(time.perf_counter() - begin, 1), "prewarm_s": None}
    vocab = model.causal_lm.config.vocab_size
    loss_fn, steps, shapes, compiled = build_loss(LossConfig()), [], [], []
    if args.child == "prewarm":
        lengths = micro_batch_lengths(args.max_len, args.micro_batch, args.micro_batch_tokens)
        result["prewarm_s"] = round(prewarm(model, accumulate, device, vocab, lengths, False, loss_fn), 2)
    result["compiled_before"] = compiled_so_far()
    for step in range(args.steps):
        if args.stop_tokens:
            batch = varied_batch(step, args, vocab)
        else:
            tokens = args.micro_batch * args.sample_len  # a micro-batch: micro_batch samples of sample_len
            batch = synthetic_batch(step, 1, args.micro_batches, args.micro_batch, tokens, vocab)
        shapes.append([len(batch.micro_batches[0]), sum(mb["input_ids"].shape[1] for mb in batch.micro_batches[0])])
        start = time.perf_counter()
        train_step(model, optimizer, scheduler, batch.micro_batches[0], cfg, device, loss_fn)
        if gpu:
            torch.cuda.synchronize()
        steps.append(round(time.perf_counter() - start, 2))
        compiled.append(compiled_so_far())
        if step == 0:
            result["compiled_by_first_step"] = compiled[0]
    result["steps_s"] = steps
    result["micro_batches_and_tokens"] = shapes  # per step
    # Which steps compiled (Dynamo frames and graphs, Inductor misses new in each): a slow step that
    # compiled nothing spent its time elsewhere (kernels JIT-built for a new specialization, say).
    before = [result["compiled_before"], *compiled[:-1]]
    result["compiled_in_step"] = [{k: now[k] - then[k] for k in now} for then, now in zip(before, compiled)]
    result["compiled_by_last_step"] = compiled_so_far()
    if gpu:
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    dist.destroy_process_group()
    return result


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    """The variant in a fresh process, its compile caches in a fresh directory."""
    with tempfile.TemporaryDirectory(prefix="first-step-") as caches:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor", "TRITON_CACHE_DIR": f"{caches}/triton"}
        argv = [sys.executable, __file__, "--child", variant, "--model", str(args.model), *child_args(args)]
        # stderr passes through: TORCH_LOGS=recompiles,graph_breaks says there why a step compiled.
        out = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        return {"variant": variant, "error": f"exit {out.returncode} (its stderr is above)"}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(result), flush=True)
    return result


def child_args(args: argparse.Namespace) -> list[str]:
    varied = ["--stop-tokens", str(args.stop_tokens), "--samples", str(args.samples)] if args.stop_tokens else []
    by_tokens = ["--micro-batch-tokens", str(args.micro_batch_tokens)] if args.micro_batch_tokens else []
    return ["--steps", str(args.steps), "--micro-batch", str(args.micro_batch), "--micro-batches", str(args.micro_batches),
            "--sample-len", str(args.sample_len), "--max-len", str(args.max_len), *varied, *by_tokens]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2-1.5b", help="bench_model.py preset (random weights)")
    parser.add_argument("--model", type=Path, help="a model directory instead of --preset's")
    parser.add_argument("--variants", default="none,prewarm")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per micro-batch (trainer.micro_batch_size)")
    parser.add_argument("--micro-batches", type=int, default=32, help="micro-batches per step")
    parser.add_argument("--sample-len", type=int, default=1053, help="tokens per sample")
    parser.add_argument("--max-len", type=int, default=1536, help="model.max_model_len (the prewarm's sample length)")
    parser.add_argument("--stop-tokens", type=int, default=0, help="varied completion lengths (see above); 0: --sample-len each")
    parser.add_argument("--samples", type=int, default=256, help="rollouts per step with --stop-tokens")
    parser.add_argument("--micro-batch-tokens", type=int, help="trainer.micro_batch_tokens: pack by tokens")
    parser.add_argument("--work", type=Path, default=Path("/tmp/first_step_bench"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    from rl_bench import build_model, machine

    where = machine()
    print(where, flush=True)
    args.model = args.model or build_model(args.preset, args.work)
    results = [run_variant(v, args) for v in args.variants.split(",")]
    out = {"machine": where, "results": results}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
