"""The trainer's kernels alone, each against the form it replaced or the kernel beside it, on the same inputs:

- `logprobs`: the LM head's per-chunk softmax work (prl.trainer.loss): the logprob/entropy kernel
  (two passes over the logits) against the logsumexp form before it (three), and the gradient kernel;
  compiled as the trainer compiles them (the rows dynamic, the vocabulary not), each also compiled
  with every dim dynamic (the trainer's way until 2026-12-03); GB/s counts one read of the bf16 logits (the backward: and one write).
- `attention`: packed causal attention, forward and backward: torch's varlen flash kernel (what
  `trainer.attention=torch` runs) against FlashAttention 4 (`fa4`, the flash-attn-4 package), at the
  heads of Qwen2.5-1.5B and 7B; the largest difference of out, dq, dk, dv between the two.

    python benchmarks/kernels_bench.py --what logprobs,attention            # one GPU (H100, H200)
    python benchmarks/kernels_bench.py --what logprobs --rows 64 --vocab 4096 --repeat 3   # CPU, eager

Prints a line per kernel (ms, GB/s) and the ratio to its baseline; `--json` a line of all figures.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench_io import _sync  # benchmarks/, beside this script
from prl.trainer.loss import _grad_logits, _logprob_stats, compiled_by_rows


def logsumexp_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """The form prl used before 2026-12-03 (the baseline): a logsumexp, then a pass for the entropy."""
    scaled = logits.float() / temperature
    lse = scaled.logsumexp(dim=-1)
    all_logprobs = scaled - lse[:, None]
    entropy = -(all_logprobs.exp() * all_logprobs).sum(dim=-1)
    return all_logprobs.gather(1, targets[:, None]).squeeze(1), entropy, lse


def timed(fn, device: torch.device, repeat: int) -> float:
    """Mean milliseconds of fn() over `repeat` calls, after one untimed call (compiles, autotunes)."""
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeat * 1e3


def bench_logprobs(args, device: torch.device) -> dict:
    compile_ = device.type == "cuda" if args.compile is None else args.compile
    wrap = compiled_by_rows if compile_ else (lambda f: f)
    every_dim = (lambda f: torch.compile(f, dynamic=True)) if compile_ else (lambda f: f)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, device=device, generator=gen) * 3).to(torch.bfloat16)
    targets = torch.randint(0, args.vocab, (args.rows,), device=device, generator=gen)
    grad = torch.randn(args.rows, device=device, generator=gen)
    new, old, grad_kernel = wrap(_logprob_stats), wrap(logsumexp_stats), wrap(_grad_logits)
    new_any, grad_any = every_dim(_logprob_stats), every_dim(_grad_logits)
    got, want = new(logits, targets, 1.0), old(logits, targets, 1.0)
    diffs = [(a - b).abs().max().item() for a, b in zip(got, want)]
    gbytes = logits.numel() * logits.element_size() / 1e9
    res = {"rows": args.rows, "vocab": args.vocab, "compiled": compile_,
           "stats_ms": timed(lambda: new(logits, targets, 1.0), device, args.repeat),
           "logsumexp_stats_ms": timed(lambda: old(logits, targets, 1.0), device, args.repeat),
           "stats_every_dim_dynamic_ms": timed(lambda: new_any(logits, targets, 1.0), device, args.repeat),
           "grad_ms": timed(lambda: grad_kernel(logits, targets, got[2], grad, 1.0), device, args.repeat),
           "grad_every_dim_dynamic_ms": timed(lambda: grad_any(logits, targets, got[2], grad, 1.0), device, args.repeat),
           "max_diff_logprob_entropy_lse": diffs}
    print(f"logprobs, [{args.rows}, {args.vocab}] bf16 logits ({gbytes:.3f} GB), {'compiled' if compile_ else 'eager'}:")
    for name, key, passes in (("stats (prl)", "stats_ms", 1), ("stats, logsumexp form", "logsumexp_stats_ms", 1),
                              ("stats, every dim dynamic", "stats_every_dim_dynamic_ms", 1),
                              ("gradient (prl)", "grad_ms", 2), ("gradient, every dim dynamic", "grad_every_dim_dynamic_ms", 2)):
        print(f"  {name:<28} {res[key]:9.3f} ms  {passes * gbytes / res[key] * 1e3:8.1f} GB/s")
    print(f"  prl / logsumexp form time: {res['stats_ms'] / res['logsumexp_stats_ms']:.3f}x;"
          f" max |diff| logprob, entropy, lse: {', '.join(f'{d:.2e}' for d in diffs)}")
    print(f"  rows dynamic / every dim dynamic time: stats {res['stats_ms'] / res['stats_every_dim_dynamic_ms']:.3f}x,"
          f" gradient {res['grad_ms'] / res['grad_every_dim_dynamic_ms']:.3f}x")
    return res


def bench_attention(args, device: torch.device) -> dict:
    from torch.nn.attention.varlen import varlen_attn

    from prl.trainer.attention import _fa4_ready, fa4_varlen

    why_not = _fa4_ready(device)
    lens = [2048, 1500, 700, 2048, 1200, 2048, 300, 2048, 1900, 1000, 2048, 2048]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    res = {}
    for hq, hkv, name in ((12, 2, "1.5B"), (28, 4, "7B")):
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v, up = (torch.randn(sum(lens), h, 128, device=device, dtype=torch.bfloat16, generator=gen)
                       for h in (hq, hkv, hkv, hq))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        runs = {}
        for kernel, fn in (("torch", varlen_attn), ("fa4", fa4_varlen)):
            if kernel == "fa4" and why_not:
                print(f"attention {name}: fa4 not run: {why_not}")
                continue

            def step(fn=fn):
                out = fn(q, k, v, cu, cu, max(lens), max(lens), window_size=(-1, 0))
                return (out, *torch.autograd.grad(out, (q, k, v), up))

            runs[kernel] = (timed(step, device, args.repeat), step())
            print(f"attention {name} ({hq} query, {hkv} K/V heads, {sum(lens)} packed tokens) {kernel}:"
                  f" forward+backward {runs[kernel][0]:.3f} ms")
        res[name] = {k: ms for k, (ms, _) in runs.items()}
        if len(runs) == 2:
            diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(runs["torch"][1], runs["fa4"][1])]
            res[name]["max_diff_out_dq_dk_dv"] = diffs
            print(f"attention {name}: fa4 / torch time {runs['fa4'][0] / runs['torch'][0]:.3f}x;"
                  f" max |diff| out, dq, dk, dv: {', '.join(f'{d:.2e}' for d in diffs)}")
    return res


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--what", default="logprobs,attention", help="comma-separated: logprobs, attention")
    p.add_argument("--rows", type=int, default=1024, help="logprobs: tokens per chunk (the trainer's chunk)")
    p.add_argument("--vocab", type=int, default=151936, help="logprobs: the vocabulary (Qwen2.5's)")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="logprobs through torch.compile, as the trainer on a GPU (default: on a GPU only)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    args.what = args.what.split(",")
    unknown = set(args.what) - {"logprobs", "attention"}
    if unknown:
        p.error(f"--what: unknown {sorted(unknown)}")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"machine: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}")
    res = {}
    if "logprobs" in args.what:
        res["logprobs"] = bench_logprobs(args, device)
    if "attention" in args.what:
        if device.type != "cuda":
            print("attention: needs a GPU (the varlen flash kernels have no CPU build)")
        else:
            res["attention"] = bench_attention(args, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
