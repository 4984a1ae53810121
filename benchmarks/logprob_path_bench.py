"""Where vLLM's sampled-token logprobs cost: the engine with and without them, and their messages.

    python benchmarks/logprob_path_bench.py engine MODEL_DIR [--batch-size 256] [--completion-tokens 256] [--rounds 3]
    python benchmarks/logprob_path_bench.py messages [--batch-size 256] [--steps 400] [--rounds 3]
    # the same on another vLLM's Python code, e.g. the GPU bundle's 0.26 (its modules import on a CPU):
    mkdir -p /tmp/v26 && ln -sfn $PWD/.gpu-bundle/stage/vllm /tmp/v26/vllm
    PYTHONPATH=/tmp/v26 python benchmarks/logprob_path_bench.py messages
    # the ops of 100 engine steps each way, GPU time first (vLLM's torch profiler), tables in DIR:
    python benchmarks/logprob_path_bench.py engine MODEL_DIR --torch-profile DIR
    # on a GPU machine, where in each process the time goes (py-spy carried in .gpu-mini/bin):
    py-spy record --subprocesses --format raw -o logprobs.txt -- python benchmarks/logprob_path_bench.py engine M --only logprobs

`engine`: vLLM's LLM.generate with its engine core in a process of its own, as `vllm serve` runs it
(this process is the front end). The batch of rl_bench_engine's offline measurement (the toy
environment's step-0 prompts, a seed per rollout, exactly --completion-tokens tokens), asked two ways,
alternating, --rounds times: the token route's request without logprobs (what
trainer.behaviour_logprobs: recompute sends) and with them (logprobs=0, flat, no text: the loop's
default). tok/s, and this process's CPU per 1,000 tokens.

`messages`: what the logprobs add to each engine step outside the model, with vLLM's own classes and
nothing else running: the engine core's side (one LogprobsLists slice per request, as its scheduler
makes them, shown apart, and the msgpack encoding of the step's EngineCoreOutputs, done in its output
thread under the same GIL as its scheduling) and the front end's (decoding, and OutputProcessor.process_outputs).
Milliseconds per step of --batch-size requests, medians over --steps, per --rounds, without and with.

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def cpu_seconds(proc) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def engine(args: argparse.Namespace) -> dict:
    from rl_bench_engine import LOOP_REQUEST, RECOMPUTE_REQUEST, prompt_ids, step0_inputs

    from prl.orchestrator.dataset import SEED_KEY

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine core in its own process, as served
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    import psutil
    import torch
    from vllm import LLM, SamplingParams

    on_cpu = not torch.cuda.is_available()
    # vLLM on CPU dies on a seeded request prefilled in chunks (prl.inference.server.vllm_args).
    kwargs = {"enable_chunked_prefill": False, "dtype": "float32"} if on_cpu else {"gpu_memory_utilization": 0.85,
                                                                                   "dtype": "bfloat16"}
    if args.torch_profile:  # the engine's own torch profiler: a table of the ops' time, GPU and CPU
        kwargs["profiler_config"] = {
            "profiler": "torch", "torch_profiler_dir": str(Path(args.torch_profile).resolve()),
            "torch_profiler_with_stack": False, "torch_profiler_use_gzip": True, "ignore_frontend": True,
            "delay_iterations": PROFILE_SKIP, "max_iterations": PROFILE_STEPS}
    llm = LLM(model=args.model, max_model_len=args.completion_tokens + 512, seed=0, generation_config="vllm",
              logprobs_mode="processed_logprobs", max_num_seqs=args.batch_size, **kwargs)
    _, groups = step0_inputs(args.batch_size)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(args.model, groups)]
    seeds = [item[SEED_KEY] for group in groups for item in group]
    quiet = dict(temperature=1.0, max_tokens=args.completion_tokens, ignore_eos=True, detokenize=False)
    variants = {
        "plain": (RECOMPUTE_REQUEST, [SamplingParams(**quiet, seed=s) for s in seeds]),
        "logprobs": (LOOP_REQUEST, [SamplingParams(**quiet, logprobs=0, seed=s, flat_logprobs=True) for s in seeds]),
    }
    llm.generate(prompts, variants["logprobs"][1], use_tqdm=False)  # warm-up: every path built once
    if args.only:
        variants = {args.only: variants[args.only]}
    me = psutil.Process()

    def timed(params) -> dict:
        before = cpu_seconds(me)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert all((o.outputs[0].logprobs is None) == (params[0].logprobs is None) for o in outputs)
        return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
                "front_cpu_ms_per_1k_tokens": 1e6 * (cpu_seconds(me) - before) / tokens}

    rounds = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (_, params) in variants.items():
            rounds[name].append(timed(params))
    if args.torch_profile:
        for name, (_, params) in variants.items():
            profile(llm, prompts, params, Path(args.torch_profile), name)
    print(f"{args.batch_size} requests x {args.completion_tokens} tokens, the engine core in its own process; "
          f"medians of {args.rounds} alternating rounds")
    print("| request | tok/s | front end CPU ms per 1k tokens |\n| --- | ---: | ---: |")
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()}
    for name, (label, _) in variants.items():
        print(f"| {label} | {med[name]['tok_s']:,.0f} | {med[name]['front_cpu_ms_per_1k_tokens']:.1f} |")
    if len(med) == 2:
        print(f"logprobs: x{med['logprobs']['tok_s'] / med['plain']['tok_s']:.2f} tok/s")
    return {"rounds": rounds}


PROFILE_SKIP, PROFILE_STEPS = 100, 100
"""--torch-profile: the engine steps it leaves out (the prefill), then those it records."""


def profile(llm, prompts: list, params: list, out: Path, name: str, timeout_s: float = 180) -> None:
    """One more generate under vLLM's torch profiler. The worker writes its trace, then its table of
    ops (GPU time first where there is one) some seconds after the last profiled step: that table
    (vLLM 0.26: profiler_out_0.txt, 0.32: rank0.profiler_out.txt) is kept as OUT/NAME_ops.txt, the
    trace files (hundreds of MB on a GPU) are removed."""
    def tables() -> list[Path]:
        return [p for p in out.iterdir() if p.name.startswith(("profiler_out", "rank0.profiler_out"))]

    for path in tables():
        path.unlink()
    llm.start_profile()
    llm.generate(prompts, params, use_tqdm=False)
    llm.stop_profile()
    deadline = time.monotonic() + timeout_s
    while not tables() and time.monotonic() < deadline:
        time.sleep(1)
    time.sleep(2)  # written with one print; let it close
    for path in tables()[:1]:
        path.rename(out / f"{name}_ops.txt")
    for path in out.iterdir():
        if path.is_file() and not path.name.endswith("_ops.txt"):
            path.unlink()


def messages(args: argparse.Namespace) -> dict:
    import numpy as np
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.outputs import LogprobsLists
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    n = args.batch_size

    def one_round(logprobs: bool) -> tuple[float, float]:
        encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
        front = OutputProcessor(None, log_stats=False)  # no tokenizer: detokenize=False, as the route asks
        extra = {"logprobs": 0, "flat_logprobs": True} if logprobs else {}
        for i in range(n):
            params = SamplingParams(temperature=1.0, max_tokens=1 << 30, ignore_eos=True, detokenize=False, seed=i, **extra)
            front.add_request(EngineCoreRequest(
                request_id=str(i), external_req_id=str(i), prompt_token_ids=[1, 2, 3], mm_features=None,
                sampling_params=params, pooling_params=None, arrival_time=time.time(), lora_request=None,
                cache_salt=None, data_parallel_rank=None), None)
        rng = np.random.default_rng(0)
        engine_s, slice_s, front_s = [], [], []
        for _ in range(args.steps):
            tokens = rng.integers(0, 151_936, n)
            # What the model runner hands the scheduler (AsyncOutput.get_output): arrays for the batch.
            lists = LogprobsLists(tokens.reshape(n, 1).astype(np.int32), -rng.random((n, 1), dtype=np.float32),
                                  np.ones(n, dtype=np.int64)) if logprobs else None
            start = time.perf_counter()
            slices = [None] * n if lists is None else [lists.slice_request(i, 1) for i in range(n)]
            sliced = time.perf_counter()
            outputs = [EngineCoreOutput(request_id=str(i), new_token_ids=[int(tokens[i])], new_logprobs=slices[i])
                       for i in range(n)]
            frames = encoder.encode(EngineCoreOutputs(engine_index=0, outputs=outputs))
            encoded = time.perf_counter()
            front.process_outputs(decoder.decode(frames).outputs)
            slice_s.append(sliced - start)
            engine_s.append(encoded - start)
            front_s.append(time.perf_counter() - encoded)
        return tuple(1e3 * statistics.median(x) for x in (engine_s, slice_s, front_s))

    rounds = {"plain": [], "logprobs": []}
    for _ in range(args.rounds):
        for name in rounds:
            rounds[name].append(one_round(name == "logprobs"))
    import vllm

    med = {name: [statistics.median(r[k] for r in rs) for k in (0, 1, 2)] for name, rs in rounds.items()}
    print(f"vLLM {vllm.__version__}'s classes; {n} requests a step, one token each; medians of {args.steps} steps, "
          f"then of {args.rounds} alternating rounds")
    print("| request | engine core: outputs + encode, ms/step | of which slicing | front end: decode + "
          "process_outputs, ms/step |\n| --- | ---: | ---: | ---: |")
    for name, (e, sl, f) in med.items():
        print(f"| {name} | {e:.2f} | {sl:.2f} | {f:.2f} |")
    (pe, _, pf), (le, _, lf) = med["plain"], med["logprobs"]
    print(f"logprobs add {le - pe:.2f} ms/step in the engine core ({1e3 * (le - pe) / n:.1f} us a request) "
          f"and {lf - pf:.2f} ms/step in the front end ({1e3 * (lf - pf) / n:.1f} us a request)")
    return {"vllm": vllm.__version__, "rounds_ms": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("engine", help="the engine with and without logprobs")
    run.add_argument("model")
    run.add_argument("--completion-tokens", type=int, default=256)
    run.add_argument("--only", choices=["plain", "logprobs"], help="this request alone (e.g. under py-spy)")
    run.add_argument("--torch-profile", metavar="DIR", help=f"also each request once under vLLM's torch profiler "
                     f"(engine steps {PROFILE_SKIP + 1}-{PROFILE_SKIP + PROFILE_STEPS}): DIR/plain_ops.txt, DIR/logprobs_ops.txt")
    run.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE on a CPU (default 2)")
    msg = sub.add_parser("messages", help="the engine core's and the front end's work per step, outside the model")
    msg.add_argument("--steps", type=int, default=400)
    for p in (run, msg):
        p.add_argument("--batch-size", type=int, default=256)
        p.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from rl_bench import machine  # GPU, CPU and versions

    where = machine()
    print(f"machine: {where}")
    result = engine(args) if args.what == "engine" else messages(args)
    print(json.dumps({"machine": where, "args": vars(args), **result}))


if __name__ == "__main__":
    main()
