"""gpu_exactness.py's trainer side: the trainer/vLLM logprob gap, and trainer determinism.

Runs as `gpu_exactness.py --child trainer`: one process, a world of one rank, the model built by the
trainer's own `build_model` (FSDP2, fp32 master weights, bf16 compute on GPU) and trained by its own
`train_step`. Every training run starts from the same weights: the loaded ones, copied back in place.
torch is imported inside `run` only (the parent imports this module for `print_report`).
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from dataclasses import dataclass, field

from gpu_exactness_vllm import SEQUENCES, model_dtype


@dataclass
class Run:
    """One training run: per-step losses and grad norms, step 1's gradients, the final weights."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    grads: list = field(default_factory=list)
    weights: list = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None


def local(tensor):
    """The whole tensor of an FSDP2 parameter or gradient: one rank holds all of it."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def snapshot(tensors) -> list:
    return [local(t).detach().float().clone() for t in tensors]


def run(args, data: dict, save, start: float) -> None:
    # cuBLAS reads this when it creates its first handle, and torch refuses deterministic mode on CUDA
    # without it. It is torch's default workspace on sm90 anyway (H100/H200): the default-kernel runs
    # get the same cuBLAS as the trainer's.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import transformers

    from prl.config import ModelConfig, TrainerConfig
    from prl.trainer.model import build_model
    from trainer_bench import init_process_group, varlen_heads

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init_process_group(device)
    cfg = TrainerConfig(gpus_per_node=int(cuda), lr=args.lr)
    model = build_model(ModelConfig(name=str(args.model), dtype=model_dtype(cuda)), cfg, 1.0, device)
    data["setup"] = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
        "cuda": torch.version.cuda, "transformers": transformers.__version__, "compute_dtype": model_dtype(cuda),
        "attention": model.causal_lm.config._attn_implementation + varlen_heads(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"],
        "load_s": round(time.perf_counter() - start, 1),
    }
    save()
    if "gap" in args.parts:
        data["gap"] = logprob_gap(model, args, device, deadline=time.perf_counter() + args.budget_s["gap"])
        save()
    if "trainer" in args.parts:
        data["trainer"] = {"runs": {}, "comparisons": {}, "skipped": []}
        deadline = time.perf_counter() + args.budget_s["trainer"]
        determinism(model, cfg, args, device, data["trainer"], save, deadline)


def reshard_all(model) -> None:
    """Every FSDP unit back to its sharded (fp32) parameters: the next forward gathers them afresh.
    On one rank, units stay unsharded after a forward until a backward reshards them."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def logprob_gap(model, args, device, deadline: float) -> dict:
    """The trainer's logprobs of vLLM's temperature-1 sequences against vLLM's own."""
    import torch

    from prl.config import LossConfig
    from prl.trainer.samples import pack

    path = args.work / SEQUENCES
    if not path.exists():
        return {"skipped": f"no {path}: the vllm part did not get to case (c)"}
    saved = json.loads(path.read_text())
    if saved["model"] != str(args.model):
        return {"skipped": f"{path} holds sequences of {saved['model']}"}
    ours, theirs = [], []
    with torch.no_grad():
        for group in token_groups(saved["sequences"], args.gap_tokens):
            if time.perf_counter() > deadline:
                break
            mb = pack([{"input_ids": torch.tensor(s["prompt_ids"] + s["token_ids"])} for s in group])
            logprobs = model(mb["input_ids"].to(device), mb["position_ids"].to(device))[0][0].double().cpu()
            offset = 0
            for s in group:  # logprobs[t] is token t's, predicted from t - 1 of the same sample
                start = offset + len(s["prompt_ids"])
                ours.append(logprobs[start : start + len(s["token_ids"])])
                theirs.append(torch.tensor(s["logprobs"], dtype=torch.float64))
                offset = start + len(s["token_ids"])
    reshard_all(model)
    if not ours:
        return {"skipped": "the budget was spent before the first micro-batch"}
    diff = torch.cat(ours) - torch.cat(theirs)  # log pi_trainer - log pi_vllm: the log importance ratio
    loss = LossConfig()
    ratio = diff.exp()
    return {
        "sequences": len(ours), "of": len(saved["sequences"]), "tokens": diff.numel(),
        "mean_abs": diff.abs().mean().item(), "max_abs": diff.abs().max().item(), "mean": diff.mean().item(),
        "p50_abs": diff.abs().quantile(0.5).item(), "p99_abs": diff.abs().quantile(0.99).item(),
        "k3_kl": (ratio - 1 - diff).mean().item(),
        "outside_clip": ((ratio < 1 - loss.clip_low) | (ratio > 1 + loss.clip_high)).double().mean().item(),
        "bitwise_equal": (diff == 0).double().mean().item(),
    }


def token_groups(sequences: list[dict], budget: int) -> list[list[dict]]:
    """Consecutive sequences in groups of at most `budget` tokens (one packed micro-batch each)."""
    groups, tokens = [[]], 0
    for s in sequences:
        n = len(s["prompt_ids"]) + len(s["token_ids"])
        if groups[-1] and tokens + n > budget:
            groups.append([])
            tokens = 0
        groups[-1].append(s)
        tokens += n
    return groups


def synthetic_steps(args, vocab_size: int) -> list[list[dict]]:
    """--steps x --sequences rollouts of --seq-len random tokens (prompt 1/4), one list per step."""
    import torch

    from prl.trainer.samples import random_sample

    gen = torch.Generator().manual_seed(0)
    prompt = args.seq_len // 4
    return [[random_sample(prompt, args.seq_len - prompt, vocab_size, gen) for _ in range(args.sequences)]
            for _ in range(args.steps)]


def micro_batches(samples: list[dict], layout: str) -> list[dict]:
    """'2x4': 2 packed micro-batches of 4 samples each (accumulated into one optimizer step)."""
    from prl.trainer.samples import pack

    count, size = (int(x) for x in layout.split("x"))
    if count * size != len(samples):
        raise ValueError(f"--layouts {layout}: {count} x {size} is not {len(samples)} sequences")
    return [pack(samples[i * size : (i + 1) * size]) for i in range(count)]


def train(model, cfg, device, steps: list, layout: str, deterministic: bool, init: list) -> Run:
    """--steps optimizer steps from the initial weights, through the trainer's own train_step."""
    import torch

    from prl.trainer.loss import build_loss
    from prl.trainer.train import build_optimizer, train_step

    params = list(model.parameters())
    torch.use_deterministic_algorithms(deterministic)
    try:
        reshard_all(model)
        with torch.no_grad():
            for p, value in zip(params, init):
                local(p).copy_(value)
        model.zero_grad(set_to_none=True)
        optimizer, scheduler = build_optimizer(model, cfg, device)
        out = Run()

        def keep_first_grads(*_) -> None:
            # Step 1's gradients as AdamW gets them (after the norm clip); train_step frees them after the step.
            if not out.grads:
                out.grads.extend(snapshot(p.grad for p in params))

        optimizer.register_step_pre_hook(keep_first_grads)
        start, loss_fn = time.perf_counter(), build_loss(cfg.loss)
        for samples in steps:
            metrics = train_step(model, optimizer, scheduler, micro_batches(samples, layout), cfg, device, loss_fn)
            out.losses.append(metrics["train/loss"])
            out.grad_norms.append(metrics["train/grad_norm"])
        out.weights, out.seconds = snapshot(params), round(time.perf_counter() - start, 2)
        return out
    except Exception as e:  # noqa: BLE001 -- e.g. an op without a deterministic kernel: a result, not a crash
        traceback.print_exc()
        return Run(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    finally:
        torch.use_deterministic_algorithms(False)


def tensor_diff(xs: list, ys: list, base: list | None = None) -> dict:
    """max |x - y|, the fraction of elements that differ, and ||x - y|| / ||x|| (or / ||x - base||: the update)."""
    max_abs, differing, total, diff_sq, ref_sq = 0.0, 0, 0, 0.0, 0.0
    for i, (x, y) in enumerate(zip(xs, ys)):
        d = x - y
        max_abs = max(max_abs, d.abs().max().item())
        differing += int((x != y).sum())
        total += x.numel()
        diff_sq += d.norm().item() ** 2
        ref_sq += (x if base is None else x - base[i]).norm().item() ** 2
    return {"equal": differing == 0, "max_abs": max_abs, "differing": differing / max(total, 1),
            "rel": math.sqrt(diff_sq / ref_sq) if ref_sq else None}


def compare(a: Run, b: Run, init: list) -> dict:
    if a.error or b.error:
        return {"error": a.error or b.error}
    return {
        "losses_equal": a.losses == b.losses, "max_loss_diff": max(abs(x - y) for x, y in zip(a.losses, b.losses)),
        "grad_norms_equal": a.grad_norms == b.grad_norms, "grads": tensor_diff(a.grads, b.grads),
        "weights": tensor_diff(a.weights, b.weights, base=init),
    }


def determinism(model, cfg, args, device, out: dict, save, deadline: float) -> None:
    """Default kernels twice, deterministic kernels twice, then the other layouts (deterministic if that ran)."""
    layouts = args.layouts.split(",")
    steps = synthetic_steps(args, model.causal_lm.config.vocab_size)
    init = snapshot(model.parameters())

    def go(name: str, deterministic: bool, layout: str) -> Run | None:
        if time.perf_counter() > deadline:
            out["skipped"].append(name)
            return None
        result = train(model, cfg, device, steps, layout, deterministic, init)
        out["runs"][name] = {"seconds": result.seconds, "losses": result.losses, "error": result.error}
        print(f"{name}: {out['runs'][name]}", flush=True)
        return result

    def row(name: str, a: Run | None, b: Run | None) -> None:
        if a is not None and b is not None:
            out["comparisons"][name] = compare(a, b, init)
            save()

    first = layouts[0]
    ref_default = go(f"default {first} A", False, first)
    row("default kernels: run A vs run B", ref_default, go(f"default {first} B", False, first))
    ref = go(f"deterministic {first} A", True, first)
    row("deterministic kernels: run A vs run B", ref, go(f"deterministic {first} B", True, first))
    row("default vs deterministic kernels", ref_default, ref)
    deterministic = ref is not None and ref.error is None
    ref, mode = (ref, "deterministic") if deterministic else (ref_default, "default")
    for layout in layouts[1:]:
        row(f"{mode} kernels: layout {first} vs {layout}", ref, go(f"{mode} {layout}", deterministic, layout))


def fmt_diff(d: dict) -> str:
    if d["equal"]:
        return "bitwise"
    rel = f", rel {d['rel']:.2e}" if d["rel"] is not None else ""
    return f"max {d['max_abs']:.2e}{rel}, {d['differing']:.1%} differ"


def print_report(part: dict | None) -> None:
    if not part:
        return
    print(f"\ntrainer side: {part['status']}, log {part['log']}\nsetup {part.get('setup')}")
    gap = part.get("gap")
    if gap and "skipped" not in gap:
        print(f"trainer vs vLLM logprobs, {gap['sequences']} of {gap['of']} sequences, {gap['tokens']} sampled tokens: "
              f"mean |diff| {gap['mean_abs']:.3g}, p50 {gap['p50_abs']:.3g}, p99 {gap['p99_abs']:.3g}, "
              f"max {gap['max_abs']:.3g}, mean diff {gap['mean']:.3g}, k3 KL {gap['k3_kl']:.3g}, "
              f"ratio outside the clip {gap['outside_clip']:.2%}, bitwise equal {gap['bitwise_equal']:.1%}")
    elif gap:
        print(f"gap: {gap['skipped']}")
    trainer = part.get("trainer")
    if not trainer:
        return
    print("| comparison | losses | max loss diff | grad norms | step-1 gradients | final weights (rel: to update) |")
    print("| --- | --- | ---: | --- | --- | --- |")
    for name, r in trainer["comparisons"].items():
        if "error" in r:
            print(f"| {name} | error: {r['error']} | | | | |")
            continue
        print(f"| {name} | {'equal' if r['losses_equal'] else 'differ'} | {r['max_loss_diff']:.2e} | "
              f"{'equal' if r['grad_norms_equal'] else 'differ'} | {fmt_diff(r['grads'])} | {fmt_diff(r['weights'])} |")
    print("run seconds (the first includes warm-up): "
          + ", ".join(f"{k} {v['seconds']}" for k, v in trainer["runs"].items()) + f"; skipped {trainer['skipped']}")
