"""Trainer throughput: the prl step (packed, FSDP2, chunked logprobs) against a plain transformers step.

    python benchmarks/trainer_bench.py --model-preset qwen2-0.5b --seq-len 2048 --micro-batch 8 --steps 5
    python benchmarks/trainer_bench.py --model-preset tiny --seq-len 256 --micro-batch 4 --steps 3   # CPU

Both run in this one process on one device, on the same random-init model (no download) and the
same rollouts: variable-length samples (prompt 1/4, completion the rest, lengths uniform in
[seq_len/4, seq_len]) with the orchestrator's fields.

- prl: `prl.trainer.train.train_step` on `PolicyModel` sharded by `parallelize` (1 rank), samples
  packed `--micro-batch` at a time into one [1, T] row, bf16 mixed precision on GPU.
- baseline: `AutoModelForCausalLM` as is, the same samples padded to [micro_batch, longest], full
  logits -> log_softmax -> the same clipped policy-gradient loss, AdamW, bf16 autocast on GPU.

Reported per side: useful (non-padding) tokens/s, MFU, peak memory; then the ratio prl/baseline.
MFU = model FLOPs / (time x peak FLOPs), model FLOPs = 6 * N * tokens + 12 * n_layers * d_attn * sum_i(len_i^2)
(N = parameters without the input embedding, d_attn = heads x head_dim, len_i = sample lengths; the
PaLM convention: full, not causal-halved, attention; recomputation is not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

from prl.config import TrainerConfig
from prl.trainer.data import pack, random_sample
from prl.trainer.loss import policy_gradient_loss
from prl.trainer.model import PolicyModel, attn_implementation, parallelize
from prl.trainer.train import build_optimizer, train_step

PRESETS = {
    # Qwen2.5-0.5B / -1.5B shapes (config.json of the hub models), randomly initialised.
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=768, tie_word_embeddings=True),
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "GH200": 989.0}
"""Dense bf16 peak by GPU name fragment (SXM parts); CPUs: pass --peak-tflops."""


@dataclass
class Result:
    name: str
    tokens_per_s: float
    mfu: float | None
    peak_memory_gb: float
    step_s: float


def model_config(preset: str, seq_len: int) -> Qwen2Config:
    return Qwen2Config(**PRESETS[preset], max_position_embeddings=max(seq_len, 4096), rope_theta=1e6, use_cache=False)


def new_model(config: Qwen2Config, device: torch.device, seed: int, attn: str) -> torch.nn.Module:
    torch.manual_seed(seed)  # both sides start from the same weights
    config = Qwen2Config(**{**config.to_dict(), "attn_implementation": attn})
    with torch.device(device):
        return Qwen2ForCausalLM(config).float().train()


def baseline_attn(device: torch.device) -> str:
    """What a plain transformers trainer would pick for padded batches."""
    return "flash_attention_2" if attn_implementation(device) == "flash_attention_2" else "sdpa"


def make_steps(args, vocab_size: int) -> list[list[list[dict]]]:
    """steps x micro-batches x samples."""
    gen = torch.Generator().manual_seed(args.seed)

    def sample() -> dict:
        n = int(torch.randint(args.seq_len // 4, args.seq_len + 1, (), generator=gen))
        return random_sample(n // 4, n - n // 4, vocab_size, gen)

    n_steps = args.warmup + args.steps
    return [[[sample() for _ in range(args.micro_batch)] for _ in range(args.micro_batches)] for _ in range(n_steps)]


def pad(samples: list[dict], pad_id: int = 0) -> dict:
    """[B, longest] with right padding and an attention mask (what a plain HF trainer feeds)."""
    longest = max(len(s["input_ids"]) for s in samples)

    def stack(key, value):
        return torch.stack([torch.cat([s[key], torch.full((longest - len(s[key]),), value, dtype=s[key].dtype)]) for s in samples])

    return {
        "input_ids": stack("input_ids", pad_id),
        "attention_mask": (torch.arange(longest)[None] < torch.tensor([len(s["input_ids"]) for s in samples])[:, None]).long(),
        "loss_mask": stack("loss_mask", False), "advantages": stack("advantages", 0.0),
        "inference_logprobs": stack("inference_logprobs", 0.0),
    }


def baseline_step(model, optimizer, micro_batches: list[list[dict]], cfg: TrainerConfig, device) -> None:
    """The textbook step: full [B, L, vocab] logits, fp32 log_softmax, gather, same loss."""
    total_loss_tokens = sum(int(s["loss_mask"].sum()) for mb in micro_batches for s in mb)
    for samples in micro_batches:
        mb = {k: v.to(device) for k, v in pad(samples).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
        logprobs = torch.cat([logprobs.new_zeros(logprobs.shape[0], 1), logprobs], dim=1)
        loss, _ = policy_gradient_loss(logprobs, torch.zeros_like(logprobs), mb, total_loss_tokens, cfg.clip_low, cfg.clip_high)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def model_flops(config: Qwen2Config, n_params: int, steps: list[list[list[dict]]]) -> float:
    lengths = torch.tensor([len(s["input_ids"]) for step in steps for mb in step for s in mb], dtype=torch.float64)
    d_attn = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    return 6 * n_params * float(lengths.sum()) + 12 * config.num_hidden_layers * d_attn * float((lengths**2).sum())


def non_embedding_params(model: torch.nn.Module) -> int:
    embedding = model.get_input_embeddings().weight
    n = sum(p.numel() for p in model.parameters() if p is not embedding)
    # A tied LM head is still a [vocab, hidden] matmul per token: count it once.
    return n + (embedding.numel() if model.get_output_embeddings().weight is embedding else 0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # CPU: the process's resident high-water mark, monotonic over the whole run.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def timed(name: str, step_fn, inputs: list, steps, args, flops: float, device, peak_tflops: float | None) -> Result:
    """Run `step_fn` on every step's inputs; time all but the warm-up ones."""
    for step_inputs in inputs[: args.warmup]:
        step_fn(step_inputs)
    synchronize(device)
    start = time.perf_counter()
    for step_inputs in inputs[args.warmup :]:
        step_fn(step_inputs)
    synchronize(device)
    elapsed = time.perf_counter() - start
    tokens = sum(len(s["input_ids"]) for step in steps[args.warmup :] for mb in step for s in mb)
    mfu = flops / elapsed / (peak_tflops * 1e12) if peak_tflops else None
    return Result(name, tokens / elapsed, mfu, peak_memory_gb(device), elapsed / args.steps)


def run_prl(config, steps, args, device, peak_tflops) -> tuple[Result, int]:
    reset_memory(device)
    trainer_cfg = TrainerConfig(gpus_per_node=int(device.type == "cuda"), lr=1e-6,
                                activation_checkpointing=args.activation_checkpointing, compile=args.compile)
    causal_lm = new_model(config, device, args.seed, attn_implementation(device))
    n_params = non_embedding_params(causal_lm)
    model = parallelize(PolicyModel(causal_lm), trainer_cfg, torch.bfloat16, device)
    optimizer, scheduler = build_optimizer(model, trainer_cfg, device)
    packed = [[pack(samples) for samples in step] for step in steps]
    flops = model_flops(config, n_params, steps[args.warmup :])
    result = timed("prl", lambda mbs: train_step(model, optimizer, scheduler, mbs, trainer_cfg, device),
                   packed, steps, args, flops, device, peak_tflops)
    del model, optimizer, causal_lm
    return result, n_params


def run_baseline(config, steps, args, device, peak_tflops, n_params) -> Result:
    reset_memory(device)
    trainer_cfg = TrainerConfig(lr=1e-6)
    model = new_model(config, device, args.seed, baseline_attn(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=trainer_cfg.lr, fused=device.type == "cuda")
    flops = model_flops(config, n_params, steps[args.warmup :])
    result = timed("baseline", lambda mbs: baseline_step(model, optimizer, mbs, trainer_cfg, device),
                   steps, steps, args, flops, device, peak_tflops)
    del model, optimizer
    return result


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        what = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
        what = f"CPU {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{socket.gethostname()}: {what}; torch {torch.__version__}, transformers {transformers.__version__}"


def init_single_process(device: torch.device) -> None:
    """FSDP2 and train_step use a process group; a lone process makes its own (or torchrun's)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != 1:
        raise SystemExit("run this benchmark as one process: the baseline is single-device")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seq-len", type=int, default=256, help="longest sample (prompt + completion)")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch (packed or padded)")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: known GPUs)")
    parser.add_argument("--skip-baseline", action="store_true", help="e.g. when the baseline does not fit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_single_process(device)
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if device.type == "cuda" and k in torch.cuda.get_device_name(device)), None)
    config = model_config(args.model_preset, args.seq_len)
    steps = make_steps(args, config.vocab_size)

    prl, n_params = run_prl(config, steps, args, device, peak)
    results = [prl] if args.skip_baseline else [prl, run_baseline(config, steps, args, device, peak, n_params)]
    report(args, device, config, n_params, peak, results)
    dist.destroy_process_group()


def report(args, device, config, n_params, peak, results: list[Result]) -> None:
    print(f"machine: {machine(device)}")
    print(f"model: {args.model_preset} ({n_params / 1e6:.1f}M non-embedding params + LM head), attention prl {attn_implementation(device)} / baseline {baseline_attn(device)}, "
          f"seq_len <= {args.seq_len}, {args.micro_batch} samples x {args.micro_batches} micro-batches per step, "
          f"{args.steps} timed steps after {args.warmup} warm-up")
    print("MFU = (6*N*tokens + 12*n_layers*d_attn*sum(len_i^2)) / (time * peak); "
          + (f"peak {peak:.0f} TFLOP/s" if peak else "peak unknown (pass --peak-tflops): MFU n/a"))
    memory = "peak GPU memory allocated" if device.type == "cuda" else "process max RSS (cumulative)"
    print(f"{'':10s} {'tokens/s':>12s} {'MFU':>7s} {'step s':>8s} {memory}")
    for r in results:
        mfu = f"{100 * r.mfu:6.2f}%" if r.mfu is not None else "    n/a"
        print(f"{r.name:10s} {r.tokens_per_s:12.1f} {mfu} {r.step_s:8.3f} {r.peak_memory_gb:.2f} GiB")
    if len(results) == 2:
        print(f"prl/baseline tokens/s: {results[0].tokens_per_s / results[1].tokens_per_s:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(device), "args": vars(args), "results": [vars(r) for r in results]}, f, indent=2)


if __name__ == "__main__":
    main()
