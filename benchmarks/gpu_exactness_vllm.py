"""gpu_exactness.py's vLLM part: is a request's output independent of its batch, and of the run?

Runs as `gpu_exactness.py --child vllm`. vLLM and torch are imported inside the functions the child runs:
the parent process imports this module for `print_report`, and must stay free of vLLM and CUDA.

The cases share one engine, and prefix caching stays on as in prl's server: after case (b), the probe
prompts' KV comes from the cache (as a group's rollouts after its first one do in a run).
"""

from __future__ import annotations

import json
import os
import random
import shlex
import statistics
import time

SEQUENCES = "vllm_sequences.json"
"""In --work: the temperature-1 sequences of case (c) with vLLM's logprobs, for the gap part."""
SERVER_FLAGS = {"--port", "--middleware", "--worker-extension-cls", "--shutdown-timeout"}
"""`vllm serve` flags with no meaning for an offline engine."""
PAIRS = [("alone", "batch"), ("alone", "padded"), ("batch", "padded"), ("batch", "batch again"),
         ("padded", "padded again")]


def model_dtype(cuda: bool) -> str:
    """bf16 as in a GPU run; float32 on CPU (the trainer's CPU dtype, so the gap is comparable)."""
    return "bfloat16" if cuda else "float32"


def prompt_range(args) -> tuple[int, int]:
    low, high = (int(x) for x in args.prompt_len.split(","))
    return low, high


def prl_config(args, cuda: bool):
    """A run config whose `vllm_args` are the engine options of this measurement."""
    from prl.config import (Config, EnvironmentConfig, InferenceConfig, ModelConfig, OrchestratorConfig, RunConfig,
                            TrainerConfig)

    gpus, longest = int(cuda), prompt_range(args)[1] + args.max_tokens
    return Config(
        run=RunConfig(name="exactness", output_dir=str(args.work)),
        model=ModelConfig(name=str(args.model), dtype=model_dtype(cuda), max_model_len=longest),
        inference=InferenceConfig(gpus_per_node=gpus, gpu_memory_utilization=args.gpu_memory_utilization,
                                  enforce_eager=args.enforce_eager, extra_args=shlex.split(args.vllm_extra)),
        trainer=TrainerConfig(gpus_per_node=gpus),
        orchestrator=OrchestratorConfig(environment=EnvironmentConfig(id="prl.envs.toy")),
    )


def engine_kwargs(argv: list[str]) -> dict:
    """`vllm serve` argv (prl.inference.server.vllm_args) -> `vllm.LLM` keyword arguments."""
    kwargs, i = {}, 0
    while i < len(argv):
        flag = argv[i]
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        value = argv[i + 1] if has_value else None
        i += 2 if has_value else 1
        if flag not in SERVER_FLAGS:
            name = flag[2:].removeprefix("no-").replace("-", "_")
            kwargs[name] = typed(value) if has_value else not flag.startswith("--no-")
    return kwargs


def typed(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def random_prompts(args, n: int) -> list[list[int]]:
    """`n` prompts of random non-special token ids, lengths uniform in --prompt-len."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rng = random.Random(0)
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    low, high = prompt_range(args)
    return [[rng.choice(ids) for _ in range(rng.randint(low, high))] for _ in range(n)]


def interleave(probes: list, pads: list) -> tuple[list, list[int]]:
    """The probes spread evenly among the pads; (the batch, each probe's index in it)."""
    batch, where = list(pads), []
    step = (len(pads) + len(probes)) / len(probes)
    for k, probe in enumerate(probes):
        where.append(int(k * step))
        batch.insert(where[-1], probe)
    return batch, where


def start_engine(args, data: dict, start: float):
    """The environment, then `vllm.LLM` with the server's options; what was used goes into `data`."""
    import torch

    # No CUDA context in this process (is_available creates none): vLLM's engine starts as it would alone.
    cuda = torch.cuda.is_available()
    # The GPU machines' vLLM 0.26 bundle has no flashinfer, and its default sampler would import it
    # (shared/tools/gpu-vllm/README.md); the native PyTorch sampler instead.
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # This process has touched CUDA (the checks above): a forked engine core could not use it
    # ("Cannot re-initialize CUDA in forked subprocess", H200, vLLM 0.26, 2026-11-23).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if not cuda:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default would take a quarter of RAM
    os.environ.update(dict(item.split("=", 1) for item in args.vllm_env))
    import vllm

    from prl.inference.server import vllm_args

    kwargs = engine_kwargs(vllm_args(prl_config(args, cuda)))
    data["engine"] = {"kwargs": kwargs, "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
                      "vllm": vllm.__version__, "torch": torch.__version__, "device": "cuda" if cuda else "cpu"}
    print(f"LLM({kwargs})", flush=True)
    llm = vllm.LLM(**kwargs)
    data["engine"]["startup_s"] = round(time.perf_counter() - start, 1)
    return llm


def make_requests(args) -> tuple[list, list]:
    """(probes: each prompt sampled with its seed, then each greedy; pads: other seeded requests)."""
    from vllm import SamplingParams

    from prl.inference.generate import FIXED, LOGPROBS

    n = args.prompts
    prompts = random_prompts(args, n + args.pad_requests)
    base = dict(max_tokens=args.max_tokens, ignore_eos=True, **FIXED, **LOGPROBS)  # what prl's /prl/generate asks for
    probes = ([(p, SamplingParams(temperature=1.0, seed=1000 + i, **base)) for i, p in enumerate(prompts[:n])]
              + [(p, SamplingParams(temperature=0.0, **base)) for p in prompts[:n]])
    pads = [(p, SamplingParams(temperature=1.0, seed=100_000 + j, **base)) for j, p in enumerate(prompts[n:])]
    return probes, pads


def run(args, data: dict, save, start: float) -> None:
    from prl.inference.generate import result

    (args.work / SEQUENCES).unlink(missing_ok=True)  # a previous run's, maybe of another model
    llm = start_engine(args, data, start)
    save()
    deadline = time.perf_counter() + args.budget_s["vllm"]  # for the measurements; the engine start is the grace's
    n = args.prompts
    probes, pads = make_requests(args)
    padded, where = interleave(probes, pads)
    data["sizes"] = {"probes": n, "pad_requests": len(pads), "max_tokens": args.max_tokens,
                     "prompt_len": list(prompt_range(args))}

    def generate(requests: list) -> list[dict]:
        outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests], use_tqdm=False)
        return [result(o) | {"prompt_ids": p} for o, (p, _) in zip(outputs, requests)]

    def padded_case(keep_sequences: bool) -> list[dict]:
        outputs = generate(padded)
        if keep_sequences:  # every temperature-1 request: the sampled probes, then the pads
            probe_at = set(where)
            sampled = [outputs[i] for i in where[:n]] + [o for i, o in enumerate(outputs) if i not in probe_at]
            keep = ("prompt_ids", "token_ids", "logprobs")
            sequences = [{k: o[k] for k in keep} for o in sampled]
            (args.work / SEQUENCES).write_text(json.dumps({"model": str(args.model), "sequences": sequences}))
        return [outputs[i] for i in where]

    def alone() -> list[dict | None]:
        # Each request by itself; the ones the budget leaves out stay None (and out of the comparisons).
        return [generate([r])[0] if time.perf_counter() < deadline else None for r in probes]

    cases, data["seconds"], data["skipped"] = {}, {}, []
    for name, fn in [("batch", lambda: generate(probes)), ("padded", lambda: padded_case(True)),
                     ("batch again", lambda: generate(probes)), ("padded again", lambda: padded_case(False)),
                     ("alone", alone)]:
        if time.perf_counter() > deadline:
            data["skipped"].append(name)
            continue
        t0 = time.perf_counter()
        cases[name] = fn()
        data["seconds"][name] = round(time.perf_counter() - t0, 2)
        data["comparisons"] = compare_cases(cases, n)
        print(f"{name}: {data['seconds'][name]}s", flush=True)
        save()


def compare_cases(cases: dict, n: int) -> dict:
    """Each pair of cases, sampled and greedy probes apart; and requests equal in all of alone, batch, padded."""
    rows = {}
    for x, y in PAIRS:
        if x in cases and y in cases:
            for kind, part in (("sampled", slice(0, n)), ("greedy", slice(n, 2 * n))):
                rows[f"{kind}: {x} vs {y}"] = compare(cases[x][part], cases[y][part])
    if {"alone", "batch", "padded"} <= set(cases):
        trios = [t for t in zip(cases["alone"], cases["batch"], cases["padded"]) if t[0] is not None]
        same = sum(a["token_ids"] == b["token_ids"] == c["token_ids"] for a, b, c in trios)
        rows["alone = batch = padded"] = {"requests": len(trios), "identical": same}
    return rows


def compare(xs: list, ys: list) -> dict:
    """Same requests, two cases: identical token ids?, first differing position, logprobs over the common prefix."""
    firsts, identical, requests, diffs = [], 0, 0, []
    for x, y in zip(xs, ys):
        if x is None or y is None:
            continue
        requests += 1
        a, b = x["token_ids"], y["token_ids"]
        common = next((i for i, (s, t) in enumerate(zip(a, b)) if s != t), min(len(a), len(b)))
        identical += a == b
        if a != b:
            firsts.append(common)
        diffs += [abs(s - t) for s, t in zip(x["logprobs"][:common], y["logprobs"][:common])]
    return {
        "requests": requests, "identical": identical,
        "first_divergence": {"min": min(firsts), "median": statistics.median(firsts), "max": max(firsts),
                             "all": firsts} if firsts else None,
        "prefix_tokens": len(diffs), "max_abs_logprob_diff": max(diffs, default=0.0),
        "mean_abs_logprob_diff": statistics.fmean(diffs) if diffs else 0.0,
        "logprobs_bitwise_equal": sum(d == 0 for d in diffs) / len(diffs) if diffs else None,
    }


def print_report(part: dict | None) -> None:
    if not part:
        return
    engine = part.get("engine")
    print(f"\nvLLM batch invariance: {part['status']}, log {part['log']}")
    if not engine:
        return
    print(f"vLLM {engine['vllm']} ({engine['device']}), startup {engine.get('startup_s')}s; LLM({engine['kwargs']}); "
          f"env {engine['env']}")
    print(f"sizes {part.get('sizes')}; seconds per case {part.get('seconds')}; skipped {part.get('skipped')}")
    print("| pair | requests | identical ids | first divergence min / median / max | max abs dlogprob (common prefix) "
          "| mean abs dlogprob | logprobs bitwise equal |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for name, row in part.get("comparisons", {}).items():
        if "prefix_tokens" not in row:
            print(f"| {name} | {row['requests']} | {row['identical']} | | | | |")
            continue
        first = row["first_divergence"]
        spread = f"{first['min']} / {first['median']:g} / {first['max']}" if first else "-"
        equal = f"{row['logprobs_bitwise_equal']:.1%}" if row["logprobs_bitwise_equal"] is not None else "-"
        print(f"| {name} | {row['requests']} | {row['identical']} | {spread} | {row['max_abs_logprob_diff']:.3g} "
              f"| {row['mean_abs_logprob_diff']:.3g} | {equal} |")
