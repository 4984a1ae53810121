"""Trainer/sampler mismatch at equal weights: a run's batches sampled by policy version 0 against the
trainer's forward of the base weights (docs/moe.md).

    python benchmarks/mismatch_probe.py --run outputs/toy --model .cache/tiny-qwen3-moe --dtypes float32,bfloat16
    python benchmarks/mismatch_probe.py --run RUN --model M --dtypes bfloat16,bfloat16+replay   # trainer.routing_replay

With async_level 1, batches 0 and 1 were both sampled by version 0 (the base model), so the trainer's
logprobs of the base weights against the behaviour logprobs vLLM returned with them are the engines'
mismatch alone, without any policy change. Per forward dtype (the CPU trainer computes in float32,
a GPU trainer in bfloat16): the k3 mismatch KL, the importance ratio's p5 / p50 / p95 and std, the
largest |log ratio| and the share of tokens out of two ratio bands (trainer.loss.ratio_mask_low/high).
For an MoE also how many loss tokens the float32 and bfloat16 forwards route to other top-k experts
in some layer, and the mismatch of the bfloat16 forward on those tokens and on the others. Samples
of one length run as one batch (no packing, no padding: any attention kernel), on `--device`.

A run with trainer.routing_replay has vLLM's experts in its batches: a `+replay` forward routes every
position as vLLM did (prl.trainer.replay), and each forward without it says how many loss tokens it
routes to other top-k experts than vLLM did in some layer (`vllm_flipped`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from prl.run.batch import ROUTED_KEY, read_batch
from prl.run.rundir import RunDir
from prl.trainer import replay
from prl.trainer.loss import chunked_logprobs

BANDS = ((0.5, 5.0), (0.8, 1.25))
"""IcePop's band for MoE models, and a narrow one."""


def version_0_samples(run: Path) -> list[tuple]:
    """(input_ids [T], loss_mask [T], behaviour_logprobs [T], vLLM's experts [T, layers, k] or None) of
    every sample of the run's batches sampled by version 0, from batch 0 on."""
    samples, step = [], 0
    while RunDir(run).rollout_path(step).exists() and (batch := read_batch(RunDir(run), step)).policy_version == 0:
        for mb in (mb for rank in batch.micro_batches for mb in rank):
            starts = (mb["position_ids"][0] == 0).nonzero().flatten().tolist() + [mb["input_ids"].shape[1]]
            samples += [(*(mb[k][0, a:b] for k in ("input_ids", "loss_mask", "behaviour_logprobs")),
                         mb[ROUTED_KEY][0, a:b] if ROUTED_KEY in mb else None)
                        for a, b in zip(starts[:-1], starts[1:])]
        step += 1
    if not samples:
        raise SystemExit(f"{run}: no batch sampled by policy version 0 (rollouts/step_0.pt)")
    return samples


def forward(lm, samples, device: torch.device, rows: int = 64,
            routers: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(log ratio trainer / behaviour, float64; each loss token's sorted top-k experts [tokens, layers,
    k], and vLLM's, or None for a dense model or a run without them), over the loss tokens of `samples`,
    in their order. Samples of one length run together (no padding, no attention mask), up to `rows` at a
    time. `routers`: the model's replaying routers (prl.trainer.replay), which get vLLM's experts."""
    k = getattr(lm.config, "num_experts_per_tok", None)
    by_length: dict[int, list[int]] = {}
    for i, sample in enumerate(samples):
        by_length.setdefault(len(sample[0]), []).append(i)
    groups = [idx[start:start + rows] for idx in by_length.values() for start in range(0, len(idx), rows)]
    log_ratios, routes, vllm = [None] * len(samples), [None] * len(samples), [None] * len(samples)
    with torch.no_grad():
        for group in groups:
            ids = torch.stack([samples[i][0] for i in group]).to(device)
            recorded = [samples[i][3] for i in group]
            if routers is not None:  # the routers see rows x T tokens, row after row
                replay.set_replay(routers, torch.cat(recorded)[None].to(device))
            out = lm.model(input_ids=ids, use_cache=False, output_router_logits=k is not None)
            if k is not None:  # router logits [rows * T, experts] per layer -> top-k [rows, T, layers, k]
                top = torch.stack([r.float().topk(k, dim=-1).indices.sort(dim=-1).values for r in out.router_logits], 1)
                top = top.view(len(group), ids.shape[1], *top.shape[1:])
            for row, i in enumerate(group):
                _, mask, behaviour, _ = samples[i]
                logprobs, _ = chunked_logprobs(out.last_hidden_state[row, :-1], lm.get_output_embeddings().weight, ids[row, 1:])
                loss = mask[1:].to(device)  # token t is predicted at position t - 1
                log_ratios[i] = (logprobs[loss] - behaviour[1:].to(device)[loss]).double().cpu()
                if k is not None:  # the experts of the position that predicts each loss token
                    routes[i] = top[row, :-1][loss].cpu()
                if recorded[row] is not None:
                    vllm[i] = recorded[row][:-1][loss.cpu()].long().sort(dim=-1).values
    return (torch.cat(log_ratios), torch.cat(routes) if k is not None else None,
            torch.cat(vllm) if all(v is not None for v in vllm) else None)


def ratio_stats(log_ratio: torch.Tensor) -> dict[str, float]:
    ratio = log_ratio.exp()
    p5, p50, p95 = torch.quantile(ratio, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
    stats = {"tokens": len(ratio), "mismatch_kl": float((ratio - log_ratio - 1).mean()), "p5": p5, "p50": p50,
             "p95": p95, "std": float(ratio.std()), "max_abs_log_ratio": float(log_ratio.abs().max())}
    return stats | {f"out of [{lo}, {hi}]": float(((ratio < lo) | (ratio > hi)).double().mean()) for lo, hi in BANDS}


def routing_flips(a: torch.Tensor, b: torch.Tensor, log_ratio_b: torch.Tensor) -> dict[str, float]:
    """Loss tokens whose top-k differ between two forwards in some layer, and forward b's mismatch KL
    on them and on the others."""
    flipped = (a != b).any(-1).any(-1)
    kl = lambda lr: float((lr.exp() - lr - 1).mean()) if len(lr) else float("nan")  # noqa: E731
    largest = lambda lr: float(lr.abs().max()) if len(lr) else float("nan")  # noqa: E731
    return {"flipped": float(flipped.double().mean()), "kl_flipped": kl(log_ratio_b[flipped]),
            "kl_same": kl(log_ratio_b[~flipped]), "max_flipped": largest(log_ratio_b[flipped]),
            "max_same": largest(log_ratio_b[~flipped])}


def probe(run: Path, model: Path, dtypes: list[str], device: torch.device) -> dict[str, dict]:
    from transformers import AutoModelForCausalLM

    samples, results, routes = version_0_samples(run), {}, {}
    for name in dtypes:
        dtype, replayed = name.removesuffix("+replay"), name.endswith("+replay")
        if replayed and any(s[3] is None for s in samples):
            raise SystemExit(f"{run}: {name}: its batches have no routed experts (trainer.routing_replay was off)")
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
        log_ratio, routes[name], vllm = forward(lm, samples, device, routers=replay.install(lm) if replayed else None)
        results[name] = ratio_stats(log_ratio) | {"_log_ratio": log_ratio}
        if vllm is not None and not replayed:  # a replayed forward routes as vLLM did by construction
            results[name]["vllm_flipped"] = float((routes[name] != vllm).any(-1).any(-1).double().mean())
    if len(dtypes) == 2 and routes[dtypes[0]] is not None and not any(d.endswith("+replay") for d in dtypes):
        results["routing"] = routing_flips(routes[dtypes[0]], routes[dtypes[1]], results[dtypes[1]]["_log_ratio"])
    for name in dtypes:
        del results[name]["_log_ratio"]
    return results


def table(results: dict[str, dict]) -> str:
    rows = [name for name in results if name != "routing"]
    cols = list(dict.fromkeys(c for name in rows for c in results[name]))
    lines = ["| forward | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    cell = lambda v: str(v) if isinstance(v, int) else f"{v:.3g}"  # noqa: E731
    lines += [f"| {name} | " + " | ".join(cell(results[name][c]) if c in results[name] else "-" for c in cols) + " |"
              for name in rows]
    if "routing" in results:
        r = results["routing"]
        lines += ["", f"routed to other experts ({rows[0]} vs {rows[1]} forward): {r['flipped']:.2%} of the loss tokens; "
                  f"{rows[1]} mismatch KL on them {r['kl_flipped']:.3g} (largest |log ratio| {r['max_flipped']:.3g}), "
                  f"on the others {r['kl_same']:.3g} ({r['max_same']:.3g})"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="a run directory (its rollouts/step_N.pt)")
    parser.add_argument("--model", type=Path, required=True, help="the base model the run started from")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="the trainer forward's dtypes, comma-separated")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(table(probe(args.run, args.model, args.dtypes.split(","), torch.device(args.device))))


if __name__ == "__main__":
    main()
