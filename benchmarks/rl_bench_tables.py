"""rl_bench's tables: the offline engine, prl's server (--diagnose) and the loop, with issue 24's
loop efficiency; printed by a run at its end, or again from its --json (rl_bench.py --tables-from)."""

from __future__ import annotations

import argparse

from rl_bench_engine import LOOP_REQUEST, RECOMPUTE_REQUEST, fastest_plain


def replicas(args: argparse.Namespace) -> int:
    """vLLM replicas (one per GPU, data parallel): every GPU but the trainer's; 1 when they share one."""
    return max(1, args.gpus - args.trainer_gpus)


def efficiency(train_s: float | None, offline_generation_s: float, step_s: float) -> str:
    """Issue 24's loop efficiency: max(the trainer's step without recompute, offline generation of the
    batch on the run's inference GPUs) / the step; "-" without a recompute-free train time to go by."""
    return "-" if train_s is None else f"{max(train_s, offline_generation_s) / step_s:.2f}"


def print_tables(args: argparse.Namespace, engine: dict, rows: list[dict], diag: dict | None) -> None:
    # One engine on one GPU measured offline; the loop's replicas could each do as much.
    plain = engine["variants"]["plain"]["tok_s"]
    base = plain * replicas(args)
    fastest = fastest_plain(engine["variants"]) * replicas(args)  # the efficiency's engines
    requests = {b: engine["variants"].get(v, {}).get("tok_s", float("nan")) * replicas(args)
                for b, v in (("inference", LOOP_REQUEST), ("recompute", RECOMPUTE_REQUEST))}
    ids = args.gpu_list.split(",") if args.gpu_list else [f"?{i}" for i in range(args.gpus)]
    layout = (f"vLLM and trainer share GPU {ids[0]}" if args.gpus == 1 else
              f"vLLM on GPU(s) {','.join(ids[:replicas(args)])} ({replicas(args)} replica(s): the ratios use "
              f"{replicas(args)} x offline), trainer on GPU(s) {','.join(ids[replicas(args):])}")
    lengths = (f"up to {args.completion_tokens} completion tokens ({args.stop_tokens} stop tokens)" if args.stop_tokens
               else f"{args.completion_tokens} completion tokens")
    print(f"\nmodel {args.preset}, {args.gpus} GPU(s) ({layout}), "
          f"batch {args.batch_size} rollouts (8 per prompt) x {lengths}, "
          f"{args.steps} steps, means over steps >= {args.skip}")
    print("\noffline vLLM, same GPU, same batch (one engine, one process):")
    print("| variant | tok/s | vs plain | mean completion tokens |\n| --- | ---: | ---: | ---: |")
    for name, v in engine["variants"].items():
        print(f"| {name} | {v['tok_s']:,.0f} | {v['tok_s'] / plain:.2f} | {v.get('mean_len', float('nan')):.0f} |")
    if diag:
        print("\nprl's server (the loop's settings, one replica on GPU 0), same batch:")
        print("| path | tok/s | vs offline plain | p50 / p90 / last request done (s) |\n| --- | ---: | ---: | --- |")
        for name, v in diag.items():
            spread = f"{v['p50_s']:.1f} / {v['p90_s']:.1f} / {v['last_s']:.1f}" if "p50_s" in v else ""
            print(f"| {name} | {v['tok_s']:,.0f} | {v['tok_s'] / plain:.2f} | {spread} |")
    print("\nRL loop (prl submit --local):")
    print("| async | route | behaviour logprobs | also set | step s | efficiency | trainer busy | trainer idle | train s | export s | publish s "
          "| rollout s | rollout tok/s | vs offline plain | vs offline, the route's request | weight update s "
          "| first step s | trainer peak GiB | GPU peak GiB (nvidia-smi) | completion tokens | stale groups / mixed |")
    print("| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| --- | ---: | --- |")
    # The trainer's step without the recompute forward, for recompute rows from before perf/behaviour_s:
    # a row of this invocation that asks vLLM for the logprobs.
    plain_train = [r["train_s"] for r in rows if not r["error"] and r["behaviour"] == "inference"]
    for r in rows:
        request = requests.get(r["behaviour"], float("nan"))
        head = f"| {r['async_level']} | {r['route']} | {r['behaviour']} | {' '.join(r['overrides'])} |"
        gpu = " / ".join(f"{g:.1f}" for g in r["gpu_peak_gib"])
        if r["error"]:
            print(f"{head} failed: {r['error']} | | | | | | | | | | | | | {r['trainer_peak_gib']:.1f} | {gpu} | | |")
            continue
        # A recompute run's step without its forward: its own train s less the recompute's, else a
        # run of this invocation that asked vLLM for the logprobs.
        own = r["train_s"] - r.get("behaviour_s", float("nan"))
        train = r["train_s"] if r["behaviour"] == "inference" else own if own == own else min(plain_train, default=None)
        eff = efficiency(train, r["completion_len"] * args.batch_size / fastest, r["step_s"])
        print(f"{head} {r['step_s']:.2f} | {eff} | {r['trainer_busy']:.0%} | {r['trainer_idle']:.0%} | "
              f"{r['train_s']:.2f} | {r['export_s']:.2f} | {r.get('publish_s', float('nan')):.2f} | {r['generation_s']:.2f} | "
              f"{r['rollout_tok_s']:,.0f} | "
              f"{r['rollout_tok_s'] / base:.2f} | {r['rollout_tok_s'] / request:.2f} | {r['weight_update_s']:.2f} | "
              f"{r['first_step_s'] or float('nan'):.0f} | {r['trainer_peak_gib']:.1f} | {gpu} | {r['completion_len']:.0f} | "
              f"{r['stale_groups']:.1f} / {r['mixed_version_frac']:.0%} |")
    print("\nfirst step's train s: " + "; ".join(f"{' '.join(r['overrides']) or r['behaviour']}: {r.get('first_train_s', float('nan')):.1f}"
                                               for r in rows if not r["error"]))
    by_step = [r for r in rows if r.get("train_s_by_step")]  # none in a JSON saved before these keys
    if by_step:
        print("\neach step's train s (frames torch.compile compiled in it): " + "; ".join(
            f"{' '.join(r['overrides']) or r['behaviour']}: " + ", ".join(
                f"{t:.1f}" + (f" ({c})" if c is not None else "") for t, c in zip(r["train_s_by_step"], r["compiled_by_step"]))
            for r in by_step))
    by_batch = [r for r in rows if r.get("generation_s_by_step")]  # none in a JSON saved before these keys
    if by_batch:
        print("\neach batch's rollout s (its weight update s; the share of updates loaded from a staged copy): "
              + "; ".join(f"{' '.join(r['overrides']) or r['behaviour']}: " + ", ".join(
                  f"{g:.1f} ({u:.2f})" for g, u in zip(r["generation_s_by_step"], r["weight_update_s_by_step"]))
                  + f" (staged {r['weight_staged']:.0%})" for r in by_batch))
    print("\nstartup, seconds from the launch: " + "; ".join(
        f"{' '.join(r['overrides']) or r['behaviour']}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["startup"].items())
        for r in rows if r.get("startup")))
    print("\nthe servers' start, seconds from their first line (server_start_phases.py): " + "; ".join(
        f"{' '.join(r['overrides']) or r['behaviour']}: " + ", ".join(f"{k} {v:.0f}" for k, v in r["server_phases"].items())
        for r in rows if r.get("server_phases")))
    for r in rows:
        if resumed := r.get("resumed"):  # --resume-steps
            print(f"\nresumed ({' '.join(r['overrides']) or r['behaviour']}; exit {resumed['exit']}, {resumed['steps']} steps), "
                  f"first step {resumed['first_step_s'] or float('nan'):.1f} s from its launch; startup: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in resumed["startup"].items())
                  + "; the servers' start: " + ", ".join(f"{k} {v:.0f}" for k, v in resumed["server_phases"].items()))
