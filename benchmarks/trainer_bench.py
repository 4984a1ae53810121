"""Trainer throughput: the prl step (packed, FSDP2, chunked logprobs) against a plain transformers step.

    python benchmarks/trainer_bench.py --model-preset qwen2-1.5b --seq-len 2048 --micro-batch 8 --micro-batches 2 \
        --variants eager,compile --baseline-micro-batch 4 --steps 5 --warmup 2
    torchrun --nproc-per-node 2 benchmarks/trainer_bench.py ... --skip-baseline --json two.json   # scaling
    python benchmarks/trainer_bench.py --compare one.json two.json    # same losses? scaling efficiency
    python benchmarks/trainer_bench.py --model-preset tiny --seq-len 256 --micro-batch 4 --steps 3   # CPU
    python benchmarks/trainer_bench.py --model-preset qwen3-moe-30b-a3b-10l --seq-len 2048 --micro-batch 4 \
        --micro-batches 2 --steps 3 --warmup 2 --skip-baseline \
        --variants eager+experts_eager,eager+experts_grouped_mm --json moe.json   # an MoE, one H200
    python benchmarks/trainer_bench.py --model-preset tiny-moe --seq-len 128 --micro-batch 2 --steps 1 \
        --variants eager+experts_eager,eager+experts_batched_mm,eager+experts_grouped_mm   # CPU
    torchrun --nproc-per-node 4 benchmarks/trainer_bench.py --model-preset qwen3-moe-30b-a3b-10l --seq-len 2048 \
        --micro-batch 4 --micro-batches 8 --steps 3 --warmup 2 --skip-baseline \
        --variants eager,eager+ep --json ep.json   # an MoE's experts sharded by FSDP against expert parallelism

Both sides run in this one process (per rank) on the same random-init model (no download) and the
same rollouts: variable-length samples (prompt 1/4, completion the rest, lengths uniform in
[seq_len/4, seq_len]) with the orchestrator's fields, `--micro-batches` micro-batches of
`--micro-batch` samples per optimizer step (the global batch; split over the ranks under torchrun).

- prl: `prl.trainer.train.train_step` on `PolicyModel` sharded by `parallelize`, samples packed
  `--micro-batch` at a time into one [1, T] row, bf16 mixed precision on GPU; one run per
  `--variants` entry (eager, compile, +ac: activation checkpointing, +ac50: of the first half of the
  blocks, trainer.activation_checkpointing_fraction=0.5 (any percentage), +recompute: the LM-head
  logits recomputed in the backward instead of kept, `trainer.keep_logits_gib=0`; +det: deterministic
  kernels, `trainer.deterministic=true`; with any +det variant every run has cuBLAS's fixed workspace;
  +sft: the SFT job's step, prl.trainer.sft.sft_step, NLL of the completion tokens, on the same samples;
  +lora: adapters of rank --lora-rank (alpha 2 x rank) on every linear layer of a frozen bf16 base,
  trainer.lora; its MFU counts the full model's 6N FLOPs per token, which LoRA does not spend: compare
  its tokens/s and memory, not its MFU); +experts_eager, +experts_batched_mm, +experts_grouped_mm
  (MoE presets): trainer.experts_implementation, how transformers runs a layer's experts (without
  one: the trainer's default, grouped_mm; batched_mm gathers every token's expert weights, [tokens x
  top_k, 2 x expert width, hidden], which at 30B-A3B's shape and thousands of tokens does not fit).
  +ep: trainer.expert_parallel (each rank keeps experts / ranks of every layer, tokens by all-to-all;
  under torchrun, MoE presets).
  +offload: trainer.offload (master weights, gradients and AdamW on the host, the step on the CPU);
  +optoff: trainer.offload_optimizer (AdamW's moments on the host, streamed through the GPU's update);
  +bf16: trainer.master_dtype=bfloat16 (bf16 weights and moments, stochastic rounding).
  +flat: trainer.flat_params=true (one rank without FSDP: flat master weights, gradients and moments);
  without it, false (FSDP, also on one GPU, where a run with the option unset takes the flat path).
  +fa4, +torchattn: trainer.attention=fa4 (FlashAttention 4, flash-attn-4 package) or torch (PyTorch's
  varlen flash kernel); without either, trainer.attention=auto.
  A variant that fails (out of memory) is reported with its error and the others still run.
- baseline (one rank only): `AutoModelForCausalLM` as is, the same samples padded to
  [--baseline-micro-batch, longest] (halved until it fits), full logits -> log_softmax -> the same
  clipped policy-gradient loss, fused AdamW; on GPU `--baseline bf16` (default: weights, gradients
  and AdamW in bf16, what loading with dtype=bfloat16 gives) or `amp` (fp32 weights, bf16 autocast).

Reported per run: useful (non-padding) tokens/s, MFU, peak memory, the per-step losses; then the
ratio prl/baseline. MFU = model FLOPs / (time x peak FLOPs x ranks), model FLOPs =
6 * N * tokens + 12 * n_layers * d_attn * sum_i(len_i^2) (N = parameters without the input
embedding, the LM head counted, d_attn = heads x head_dim, len_i = sample lengths; the PaLM
convention: full, not causal-halved, attention; recomputation is not counted). For an MoE preset N
counts the active parameters: each layer's expert weights times top_k / experts (what one token
multiplies by), the attention, router and LM head in full; the model line says so.
`--profile-out` adds one profiled step (top kernels, time by kind), `--timeline` one unprofiled
step's host and GPU marks (bench_io.step_timeline); `--io-dir` times weight export
and DCP checkpoint save/load (bench_io.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import transformers

from bench_workload import (PRESETS, chunks, experts_of_config, make_steps, model_config, model_flops, new_model,  # beside this script
                            non_embedding_params, pad, rank_share)
from prl.config import LoraConfig, TrainerConfig
from prl.trainer.attention import attn_implementation
from prl.trainer.export import Adapter
from prl.trainer.loss import PolicyLoss
from prl.trainer.model import PolicyModel, add_adapters, parallelize, use_experts_implementation
from prl.trainer.sft import sft_step
from prl.trainer.train import build_optimizer, train_step

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "GH200": 989.0}
"""Dense bf16 peak by GPU name fragment (SXM parts, datasheet); CPUs: pass --peak-tflops."""


@dataclass
class Result:
    name: str
    tokens_per_s: float
    mfu: float | None
    peak_memory_gb: float
    step_s: float
    losses: list[float] = field(default_factory=list)
    note: str = ""
    host_peak_gb: float = 0.0
    """The process's resident high-water mark so far (host memory: trainer.offload's state)."""


def baseline_attn(device: torch.device) -> str:
    """What a plain transformers trainer would pick for padded batches."""
    return "flash_attention_2" if attn_implementation(device) == "flash_attention_2" else "sdpa"


def baseline_step(model, optimizer, micro_batches: list[list[dict]], cfg: TrainerConfig, device, amp: bool) -> float:
    """The textbook step: full [B, L, vocab] logits, fp32 log_softmax, gather, same loss."""
    total_loss_tokens = sum(int(s["loss_mask"].sum()) for mb in micro_batches for s in mb)
    total, loss_fn = 0.0, PolicyLoss(cfg.loss)
    for samples in micro_batches:
        mb = {k: v.to(device) for k, v in pad(samples).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
        logprobs = torch.cat([logprobs.new_zeros(logprobs.shape[0], 1), logprobs], dim=1)
        loss, stats = loss_fn(logprobs, torch.zeros_like(logprobs), mb, total_loss_tokens)
        loss.backward()
        total += float(stats[0]) / max(total_loss_tokens, 1)
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


EXPERTS_FLAGS = {"experts_eager": "eager", "experts_batched_mm": "batched_mm", "experts_grouped_mm": "grouped_mm"}
"""Variant flags -> trainer.experts_implementation (without one: the trainer's default)."""


def experts_implementation(flags: set[str]) -> str | None:
    return next((impl for flag, impl in EXPERTS_FLAGS.items() if flag in flags), None)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    """Before a variant: the previous variant's compiled frames dropped (they hold its model), its memory
    freed. In one job on an H200 a process's second variant ran 5-6 % slower whichever it was (before
    this reset: benchmarks/reports/trainer-graphs-kernels-7b_h200_2026-12-03.md)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)  # num_alloc_retries counts from here


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # CPU: the process's resident high-water mark, monotonic over the whole run.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def timed(name: str, step_fn, inputs: list, steps, args, flops: float, device, peak_tflops: float | None) -> Result:
    """Run `step_fn` on every step's inputs (it returns the step's loss); time all but the warm-up ones."""
    losses = []
    for i, step_inputs in enumerate(inputs[: args.warmup]):  # as they go: what a long compile or step costs
        start = time.perf_counter()
        losses.append(step_fn(step_inputs))
        if dist.get_rank() == 0:
            print(f"{name}: warm-up step {i} {time.perf_counter() - start:.1f} s", flush=True)
    synchronize(device)
    start = time.perf_counter()
    losses += [step_fn(step_inputs) for step_inputs in inputs[args.warmup :]]
    synchronize(device)
    elapsed = time.perf_counter() - start
    tokens = sum(len(s["input_ids"]) for step in steps[args.warmup :] for s in step)
    ranks = dist.get_world_size()
    mfu = flops / elapsed / (peak_tflops * 1e12 * ranks) if peak_tflops else None
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    # Near a full card the caching allocator frees its cache and retries a failed cudaMalloc: each retry
    # synchronizes, so a step that retries runs far below what its kernels allow.
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0
    return Result(name, tokens / elapsed, mfu, peak_memory_gb(device), elapsed / args.steps, [float(x) for x in losses],
                  host_peak_gb=host, note=f"{retries} allocator retries. " if retries else "")


def varlen_heads() -> str:
    from prl.trainer.attention import _VARLEN

    return "" if not _VARLEN else " (grouped K/V heads)" if _VARLEN["gqa"] else " (K/V heads expanded)"


def set_inductor(settings: list[str]) -> None:
    """--inductor KEY=VALUE: torch._inductor.config.KEY = VALUE (a Python literal)."""
    import ast

    import torch._inductor.config as inductor_config

    for setting in settings:
        key, _, value = setting.partition("=")
        *path, name = key.split(".")
        section = inductor_config
        for part in path:
            section = getattr(section, part)
        if not hasattr(section, name):
            raise SystemExit(f"--inductor: torch._inductor.config has no {key}")
        setattr(section, name, ast.literal_eval(value))
        print(f"torch._inductor.config.{key} = {value}")


def checkpointing(flags: set[str]) -> float | None:
    """The activation_checkpointing_fraction a variant asks for: +ac 1.0, +ac50 0.5; None: no +ac."""
    shares = [1.0 if f == "ac" else int(f[2:]) / 100 for f in flags if f == "ac" or (f[:2] == "ac" and f[2:].isdigit())]
    return shares[0] if shares else None


def build_prl(config, variant: str, device, args):
    flags = set(variant.split("+"))
    trainer_cfg = TrainerConfig(nodes=dist.get_world_size(), gpus_per_node=int(device.type == "cuda"), lr=1e-6,
                                expert_parallel="ep" in flags,
                                activation_checkpointing=checkpointing(flags) is not None,
                                activation_checkpointing_fraction=checkpointing(flags) or 1.0, compile="compile" in flags,
                                experts_implementation=experts_implementation(flags), offload="offload" in flags,
                                offload_optimizer="optoff" in flags, flat_params="flat" in flags, master_dtype="bfloat16" if "bf16" in flags else "float32",
                                attention="fa4" if "fa4" in flags else "torch" if "torchattn" in flags else "auto")
    if "recompute" in flags:
        trainer_cfg.keep_logits_gib = 0.0
    causal_lm = new_model(config, device, args.seed, attn_implementation(device, trainer_cfg.attention))
    causal_lm = causal_lm.to(getattr(torch, trainer_cfg.master_dtype))  # as load_causal_lm
    use_experts_implementation(causal_lm, trainer_cfg.experts_implementation)  # as build_model does
    n_params = non_embedding_params(causal_lm)
    if "lora" in flags:  # as build_model does: the frozen base in bf16 on GPU, fp32 adapters
        trainer_cfg.lora = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
        if device.type == "cuda":
            causal_lm = causal_lm.to(torch.bfloat16)
        add_adapters(causal_lm, trainer_cfg.lora)
    model = PolicyModel(causal_lm, keep_logits_bytes=trainer_cfg.keep_logits_gib * 2**30)
    model = parallelize(model, trainer_cfg, torch.bfloat16, device)
    optimizer, scheduler = build_optimizer(model, trainer_cfg, device)
    return model, optimizer, scheduler, trainer_cfg, n_params


def run_prl(config, variant: str, steps, args, device, peak_tflops) -> tuple[Result, int]:
    reset_memory(device)
    torch.use_deterministic_algorithms("det" in variant.split("+"))  # as seed_everything, before compiling
    if device.type == "cuda":  # what an earlier variant left behind
        print(f"prl {variant}: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB allocated at its start", flush=True)
    model, optimizer, scheduler, trainer_cfg, n_params = build_prl(config, variant, device, args)
    packed = [rank_share(step, args.micro_batch) for step in steps]
    flops = model_flops(config, n_params, steps[args.warmup :])

    def step_fn(mbs):
        if "sft" in variant.split("+"):
            return sft_step(model, optimizer, scheduler, mbs, trainer_cfg, device)["train/loss"]
        return train_step(model, optimizer, scheduler, mbs, trainer_cfg, device, PolicyLoss(trainer_cfg.loss))["train/loss"]

    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    result = timed(f"prl {variant}", step_fn, packed, steps, args, flops, device, peak_tflops)
    new_breaks = {why: n - breaks.get(why, 0) for why, n in counters["graph_break"].items() if n > breaks.get(why, 0)}
    if new_breaks:  # each one splits a compiled block: fewer fusions, more host work a step
        result.note += f"graph breaks: {new_breaks}"[:400]
    if variant == args.variants[-1]:
        import bench_io

        # A failure here must not lose the throughput figures already measured.
        if args.timeline:
            print(bench_io.step_timeline(step_fn, packed[-1], device), flush=True)
        if args.profile_out:
            try:
                bench_io.profile_step(step_fn, packed[-1], device, args.profile_out)
            except Exception as e:  # noqa: BLE001
                result.note += f"profile failed: {e!r}. "
        if args.io_dir:
            try:
                adapter = Adapter(trainer_cfg.lora, "base") if trainer_cfg.lora.enabled else None
                result.note += bench_io.time_io(model, optimizer, scheduler, config, args.io_dir, adapter)
            except Exception as e:  # noqa: BLE001
                result.note += f"io timing failed: {e!r}"
    del model, optimizer, scheduler
    return result, n_params


def run_baseline(config, steps, args, device, peak_tflops, n_params) -> Result:
    micro_batch = args.baseline_micro_batch or args.micro_batch
    flops = model_flops(config, n_params, steps[args.warmup :])
    cuda = device.type == "cuda"
    amp = cuda and args.baseline == "amp"
    while True:
        reset_memory(device)
        model = new_model(config, device, args.seed, baseline_attn(device))
        if cuda and not amp:
            model = model.to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cuda)
        trainer_cfg = TrainerConfig(lr=1e-6)
        name = f"baseline {args.baseline if cuda else 'fp32'} mb{micro_batch}"
        try:
            result = timed(name, lambda step: baseline_step(model, optimizer, chunks(step, micro_batch), trainer_cfg, device, amp),
                           steps, steps, args, flops, device, peak_tflops)
            return result
        except torch.OutOfMemoryError:
            if micro_batch == 1:
                raise
            micro_batch //= 2  # what one would do by hand: the largest micro-batch that fits
        finally:
            del model, optimizer


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        what = f"{dist.get_world_size()} x {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
        what = f"CPU {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{socket.gethostname()}: {what}; torch {torch.__version__}, transformers {transformers.__version__}"


def init_process_group(device: torch.device) -> None:
    """FSDP2 and train_step use a process group: torchrun's, or a lone process's own."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device.type == "cuda":  # gloo for host tensors' collectives (+offload: the grad norm), as the trainer
        dist.init_process_group("cuda:nccl,cpu:gloo", device_id=device)
    else:
        dist.init_process_group("gloo")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seq-len", type=int, default=256, help="longest sample (prompt + completion)")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per packed prl micro-batch")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per optimizer step, all ranks together")
    parser.add_argument("--variants", default="eager",
                        help="prl runs, comma-separated: eager, compile, eager+ac, compile+ac, compile+recompute, compile+det; "
                             "MoE presets: +experts_eager, +experts_batched_mm, +experts_grouped_mm, +ep")
    parser.add_argument("--baseline-micro-batch", type=int, default=None, help="padded samples per baseline micro-batch (default: --micro-batch)")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (compilation happens here)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: known GPUs)")
    parser.add_argument("--baseline", choices=("bf16", "amp"), default="bf16", help="GPU baseline precision (see above)")
    parser.add_argument("--skip-baseline", action="store_true", help="e.g. when the baseline does not fit")
    parser.add_argument("--timeline", action="store_true", help="one more step of the last variant, its host and GPU marks")
    parser.add_argument("--profile-out", help="profile one more step of the last variant; kernel summary to this file")
    parser.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                        help="set torch._inductor.config.KEY (e.g. triton.prefer_nd_tiling=True) for every variant, "
                             "to measure a compiler setting before prl adopts it; repeatable")
    parser.add_argument("--io-dir", help="time weight export and DCP save/load of the last variant under this directory")
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the +lora variants' adapters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--compare", nargs=2, metavar=("ONE_RANK_JSON", "N_RANKS_JSON"), help="compare two --json files and exit")
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    set_inductor(args.inductor)
    return args


def main() -> None:
    args = parse_args()
    if args.compare:
        return compare(*args.compare)
    if any("det" in v.split("+") for v in args.variants):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read at cuBLAS's first handle
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init_process_group(device)
    if args.micro_batches % dist.get_world_size():
        raise SystemExit(f"--micro-batches {args.micro_batches} must split evenly over {dist.get_world_size()} ranks")
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if cuda and k in torch.cuda.get_device_name(device)), None)
    config = model_config(args.model_preset, args.seq_len)
    steps = make_steps(args, config.vocab_size)

    results, n_params = [], 0
    for variant in args.variants:
        try:
            result, n_params = run_prl(config, variant, steps, args, device, peak)
        except Exception as e:  # noqa: BLE001  (e.g. out of memory: the other variants' figures still count)
            result = Result(f"prl {variant}", 0.0, None, peak_memory_gb(device), 0.0, note=f"failed: {e!r}"[:500])
        results.append(result)
        if dist.get_rank() == 0:  # as each variant ends: a run cut short keeps the figures of those before
            print(f"done: {result.name} {result.tokens_per_s:.1f} tokens/s, {result.peak_memory_gb:.2f} GiB peak, "
                  f"step {result.step_s:.3f} s, host {result.host_peak_gb:.1f} GiB {result.note}", flush=True)
    if not args.skip_baseline and dist.get_world_size() == 1:
        results.append(run_baseline(config, steps, args, device, peak, n_params))
    if dist.get_rank() == 0:
        report(args, device, config, n_params, peak, results)
    dist.destroy_process_group()


def report(args, device, config, n_params, peak, results: list[Result]) -> None:
    print(f"machine: {machine(device)}")
    moe = experts_of_config(config)
    active = f"active (top-{moe[1]} of {moe[0]} experts) " if moe else ""
    print(f"model: {args.model_preset} ({n_params / 1e6:.1f}M {active}non-embedding params + LM head), attention prl {attn_implementation(device)}{varlen_heads()} / baseline {baseline_attn(device)}, "
          f"seq_len <= {args.seq_len}, {args.micro_batches} micro-batches x {args.micro_batch} samples per step (prl), "
          f"{args.steps} timed steps after {args.warmup} warm-up")
    print(f"MFU = (6*N*tokens + 12*n_layers*d_attn*sum(len_i^2)) / (time * peak * ranks), N {'active ' if moe else ''}params; "
          + (f"peak {peak:.0f} TFLOP/s" if peak else "peak unknown (pass --peak-tflops): MFU n/a"))
    memory = "peak GPU memory allocated" if device.type == "cuda" else "process max RSS (cumulative)"
    print(f"{'':30s} {'tokens/s':>10s} {'MFU':>7s} {'step s':>7s} {memory}; losses per step")
    for r in results:
        mfu = f"{100 * r.mfu:6.2f}%" if r.mfu is not None else "    n/a"
        losses = " ".join(f"{x:.5f}" for x in r.losses)
        host = f" (host {r.host_peak_gb:.1f} GiB)" if device.type == "cuda" else ""
        print(f"{r.name:30s} {r.tokens_per_s:10.1f} {mfu} {r.step_s:7.3f} {r.peak_memory_gb:6.2f} GiB{host}; {losses}")
        if r.note:
            print(f"  {r.note}")
    baseline = [r for r in results if r.name.startswith("baseline")]
    for r in results:
        if baseline and r is not baseline[0]:
            print(f"{r.name} / {baseline[0].name} tokens/s: {r.tokens_per_s / baseline[0].tokens_per_s:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(device), "world_size": dist.get_world_size(), "args": vars(args),
                       "results": [vars(r) for r in results]}, f, indent=2)


def compare(one_path: str, many_path: str) -> None:
    """Same global batch on 1 and N ranks: per-step loss difference and scaling efficiency per variant."""
    one, many = (json.load(open(path)) for path in (one_path, many_path))
    n = many["world_size"] // one["world_size"]
    for a, b in zip(one["results"], many["results"]):
        diff = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a["losses"], b["losses"]))
        print(f"{a['name']}: losses 1 rank {a['losses']}")
        print(f"{b['name']}: losses {many['world_size']} ranks {b['losses']}")
        print(f"  max relative loss difference {diff:.2e}; tokens/s {a['tokens_per_s']:.0f} -> {b['tokens_per_s']:.0f}, "
              f"scaling efficiency {b['tokens_per_s'] / (n * a['tokens_per_s']):.1%}")


if __name__ == "__main__":
    main()
