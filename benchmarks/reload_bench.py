"""One engine, the loop's batch, and weight updates between batches: what an update costs, from the
file and staged, and whether the batch after it generates slower (issue 24).

    python benchmarks/reload_bench.py --preset qwen2-1.5b [--rounds 3] [--batch-size 256] [--completion-tokens 1024]
    python benchmarks/reload_bench.py --model DIR ...        # an existing model directory instead

In rl_bench's 1 + 1 loops a server's first batches ran slower than its later ones (h200x2-2026-11-28g:
22.6k, 29.9k, 31.2k tok/s, then 33.2-42.5k), and the first batch after the first weight update at
0.72 (h100x4-2026-11-28), 0.67 (h200x2-2026-11-28f) and 0.86 (-28g) of the next one's rate; a
resumed attempt's first batch, its servers' first, at 0.68 of its run's others. The engine's doing,
or the loop's? Here vLLM's LLM runs prl's worker extension (as prl's server does) and
generates the orchestrator's batch 0 request (per-request seeds, no text, no logprobs: what the
trainer's recompute asks for) again and again: twice with no update, then per round one update from
the file and one from the copy staged beside the batch before it (prl.inference.readahead), each
update followed by a prefix-cache reset as the server does. Prints each batch's rate with what came
before it and each update's seconds; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

from rl_bench_engine import GROUP, RECOMPUTE_REQUEST, prompt_ids, step0_inputs

from prl.orchestrator.dataset import SEED_KEY


def engine(model: str, completion_tokens: int, cpu: bool):
    from vllm import LLM

    kwargs = {"enforce_eager": True} if cpu else {"gpu_memory_utilization": 0.85}
    return LLM(model=model, dtype="float32" if cpu else "bfloat16", max_model_len=completion_tokens + 512, seed=0,
               generation_config="vllm", worker_extension_cls="prl.inference.worker.WorkerExtension", **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--preset", help="a bench_model.py preset, written to --work first")
    where.add_argument("--model", help="a model directory")
    parser.add_argument("--work", default="/tmp/reload-bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    args = parser.parse_args()

    import torch
    from vllm import SamplingParams

    cpu = not torch.cuda.is_available()
    model = args.model or str(build_preset(args.preset, Path(args.work)))
    machine = (torch.cuda.get_device_name(0) if not cpu else platform.processor() or platform.machine())
    print(f"machine: {platform.node()}, {machine}; torch {torch.__version__}")
    version = Path(tempfile.mkdtemp(prefix="version-", dir=args.work if Path(args.work).is_dir() else None))
    shutil.copytree(model, version, dirs_exist_ok=True)  # the same weights, read from files of their own

    llm = engine(model, args.completion_tokens, cpu)
    _, groups = step0_inputs(args.batch_size)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(model, groups)]
    seeds = [item[SEED_KEY] for group in groups for item in group]
    params = [SamplingParams(temperature=1.0, max_tokens=args.completion_tokens, ignore_eos=True, detokenize=False, seed=s)
              for s in seeds]
    llm.generate(prompts[:GROUP], SamplingParams(temperature=1.0, max_tokens=16), use_tqdm=False)  # warm-up

    def batch(after: str) -> dict:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {"after": after, "seconds": seconds, "tok_s": tokens / seconds}

    def update(staged: bool) -> dict:
        if staged:
            answers = llm.collective_rpc("prl_stage_weights", kwargs={"weights_path": str(version)})
            assert set(answers) == {"staging"}, answers
            time.sleep(3.0)  # beside a batch in the loop; the read takes ~0.5 s at 1.5B
        start = time.perf_counter()
        sources = llm.collective_rpc("prl_reload_weights", kwargs={"weights_path": str(version)})
        llm.reset_prefix_cache()
        return {"staged": staged, "seconds": time.perf_counter() - start, "sources": sources}

    batches, updates = [batch("start"), batch("a batch")], []
    for _ in range(args.rounds):
        for staged in (False, True):
            updates.append(update(staged))
            batches.append(batch(f"{'staged' if staged else 'file'} update {len(updates)}"))
            batches.append(batch("a batch"))
    print(f"{len(prompts)} requests x {args.completion_tokens} tokens, {RECOMPUTE_REQUEST}; model {model}")
    print("| batch | after | s | tok/s | vs batch 2 |\n| ---: | --- | ---: | ---: | ---: |")
    for n, b in enumerate(batches, 1):
        print(f"| {n} | {b['after']} | {b['seconds']:.2f} | {b['tok_s']:,.0f} | {b['tok_s'] / batches[1]['tok_s']:.2f} |")
    print("| update | from | s | workers loaded from |\n| ---: | --- | ---: | --- |")
    for n, u in enumerate(updates, 1):
        print(f"| {n} | {'staged copy' if u['staged'] else 'file'} | {u['seconds']:.3f} | {', '.join(u['sources'])} |")
    shutil.rmtree(version)
    print(json.dumps({"machine": machine, "model": model, "batches": batches, "updates": updates}))


def build_preset(preset: str, work: Path) -> Path:
    from bench_model import build

    return build(preset, work / "models" / preset)


if __name__ == "__main__":
    main()
