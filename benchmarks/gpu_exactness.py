"""Exactness on GPU, measured: trainer determinism (bf16), vLLM batch invariance, the trainer/vLLM logprob gap.

    python benchmarks/gpu_exactness.py --preset qwen2-0.5b --work /tmp/exactness --json $OUT/exactness.json  # 1 GPU
    python benchmarks/gpu_exactness.py --model .cache/tiny-qwen2 --quick --enforce-eager --json /tmp/exactness.json
    python benchmarks/gpu_exactness.py --preset qwen2-0.5b --parts vllm --vllm-env VLLM_BATCH_INVARIANT=1 \
        --vllm-extra="--attention-backend TRITON_ATTN"   # batch-invariant mode, untried; no FA2 in the GPU bundle

The first (one H100/H200, 0.5B shape built by bench_model.py) is meant to take ~3 minutes; the second, on
a 2-core CPU with the tiny model, 1.5-2.5. On CPU, --enforce-eager as configs/toy.yaml has it (no graphs to
capture); on GPU leave it off, as prl does.

Parts (--parts, default all): the vLLM part runs in one child process, the trainer side (gap, trainer) in
another, in that order: the gap needs vLLM's sequences, and neither may find the other's GPU memory. A part
starts no new measurement once its --budget-s (counted from the end of its setup) is spent; a child is
killed, with its process group, after its parts' budgets plus --grace-s (imports, engine start, exit).
What it measured by then is kept: it rewrites its result file after every measurement. Child logs go
beside --json (else into --work); the parent prints the figures and writes one JSON.

- vllm: one `vllm.LLM` with the engine options of prl's server (`prl.inference.server.vllm_args`: seed,
  generation_config "vllm", logprobs_mode "processed_logprobs", CUDA graphs; gpu_memory_utilization 0.5;
  on CPU chunked prefill off), requests as prl sends them (`logprobs=0`, no detokenizing) plus `ignore_eos`
  (every completion --max-tokens long). --prompts random-token prompts, each sampled at temperature 1 with
  its own seed and greedily, are generated (a) each alone, (b) all in one batch, (c) in a batch with
  --pad-requests other seeded requests, and (b), (c) once more. Per pair of cases: requests with identical
  token ids, where the first differing token is, |logprob difference| over the common prefix.
- gap: the trainer's logprobs (`PolicyModel` as the trainer builds it: fp32 master weights, bf16 compute on
  GPU, temperature 1) of the temperature-1 sequences of case (c) against vLLM's: the mismatch the
  importance ratio sees at ratio 1 (k3 KL as the trainer's `mismatch_kl`).
- trainer: `train_step` (prl's loss, AdamW, FSDP2 over a world of one rank, trainer.compile off as by
  default) for --steps steps of fixed batches (--sequences x --seq-len random tokens, random advantages and
  behaviour logprobs), twice from the same weights with torch's default kernels, twice with
  `torch.use_deterministic_algorithms(True)`; then the same sequences in other micro-batch layouts
  (--layouts; 2x4 = 2 accumulated micro-batches of 4). Compared: per-step losses, step 1's gradients (as
  AdamW gets them, after the norm clip), the final weights (max abs diff; the difference's norm over the
  update's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]  # this checkout's prl, and rl_bench / trainer_bench

import gpu_exactness_trainer as trainer_side  # noqa: E402
import gpu_exactness_vllm as vllm_side  # noqa: E402

PARTS = {"vllm": "vllm", "gap": "trainer", "trainer": "trainer"}
"""Each part and the child process that runs it, in the order they run."""
FULL = dict(prompts=16, max_tokens=128, pad_requests=240, prompt_len="32,256", sequences=8, seq_len=512, steps=4,
            layouts="1x8,2x4,8x1", budget_s="vllm=60,gap=20,trainer=60")
QUICK = dict(prompts=8, max_tokens=32, pad_requests=56, prompt_len="16,64", sequences=8, seq_len=128, steps=2,
             layouts="1x8,2x4,8x1", budget_s="vllm=40,gap=20,trainer=40")
"""Sizes: FULL for one GPU and a 0.5B model, QUICK for a tiny model on a small CPU."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="an HF model directory (else --preset is built into --work)")
    parser.add_argument("--preset", default="qwen2-0.5b", help="bench_model.py preset, random weights")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_exactness"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--parts", default=",".join(PARTS), help="any of vllm,gap,trainer")
    parser.add_argument("--quick", action="store_true", help="small sizes (a tiny model on CPU)")
    parser.add_argument("--prompts", type=int, help="probe prompts; each sampled (seeded) and greedy")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--pad-requests", type=int, help="other requests in batch (c)")
    parser.add_argument("--prompt-len", help="MIN,MAX prompt tokens")
    parser.add_argument("--enforce-eager", action="store_true", help="inference.enforce_eager (prl's default: off)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--vllm-env", action="append", default=[], help="KEY=VALUE for the vLLM process")
    parser.add_argument("--vllm-extra", default="", help="more `vllm serve` flags (inference.extra_args), one string")
    parser.add_argument("--sequences", type=int, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence")
    parser.add_argument("--steps", type=int, help="optimizer steps per training run")
    parser.add_argument("--layouts", help="MICROBATCHESxSEQUENCES, the first is the reference")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--gap-tokens", type=int, default=4096, help="tokens per packed micro-batch of the gap forward")
    parser.add_argument("--budget-s", help="PART=SECONDS,...: when a part stops starting measurements")
    parser.add_argument("--grace-s", type=float, default=300.0,
                        help="a child's setup and exit time beyond its budgets (vLLM with VLLM_BATCH_INVARIANT=1 took 180 s cold)")
    parser.add_argument("--child", choices=("vllm", "trainer"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from {list(PARTS)}")
    args.parts = [p for p in PARTS if p in args.parts.split(",")]
    args.budget_s = {k: float(v) for k, v in (item.split("=") for item in args.budget_s.split(","))}
    args.work = args.work.resolve()
    return args


def describe_machine() -> str:
    """rl_bench's description (GPUs, driver, CPU, versions) where there is a GPU; else host and CPU."""
    if shutil.which("nvidia-smi"):
        from rl_bench import machine

        try:
            return machine()
        except Exception as e:  # noqa: BLE001 -- the figures matter more than their label
            return f"{platform.node()}: rl_bench.machine() failed: {e!r}"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return f"{platform.node()}: no GPU; CPU {cpu} x {os.cpu_count()} (versions: the parts' setup)"


def resolve_model(args: argparse.Namespace) -> Path:
    if args.model:
        return args.model.resolve()
    from rl_bench import build_model

    return build_model(args.preset, args.work)


def wait(proc: subprocess.Popen, result: Path, limit_s: float) -> str:
    """Until the child exits, runs past `limit_s`, or hangs on its way out 30 s after writing its last result."""
    start, done_at = time.perf_counter(), None
    while proc.poll() is None:
        now = time.perf_counter()
        if done_at is None and result.exists() and json.loads(result.read_text()).get("done"):
            done_at = now
        if done_at is not None and now - done_at > 30:
            return "ok (killed while exiting)"
        if now - start > limit_s:
            return f"killed after {limit_s:.0f}s"
        time.sleep(0.5)
    return "ok" if proc.returncode == 0 else f"exit status {proc.returncode}"


def run_child(kind: str, args: argparse.Namespace, model: Path, logs: Path) -> dict:
    """One child process (`--child kind`), its process group killed at the end: vLLM's engine processes
    outlive a killed parent otherwise, holding the GPU memory the next child needs."""
    result, log = args.work / f"{kind}.json", logs / f"gpu_exactness.{kind}.log"
    result.unlink(missing_ok=True)
    budget = sum(args.budget_s[part] for part in args.parts if PARTS[part] == kind)
    argv = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--model", str(model), "--child", kind]
    start = time.perf_counter()
    print(f"[{kind}] started, budget {budget:.0f}s (+{args.grace_s:.0f}s), log {log}", flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        status = wait(proc, result, budget + args.grace_s)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    data = json.loads(result.read_text()) if result.exists() else {}
    data.update(status=status, wall_s=round(time.perf_counter() - start, 1), log=str(log))
    print(f"[{kind}] {status} in {data['wall_s']}s", flush=True)
    if not status.startswith("ok"):
        print("\n".join(log.read_text(errors="replace").splitlines()[-40:]))
    return data


def save_child(path: Path, data: dict) -> None:
    """The child's results so far (written whole, then renamed: the parent may read it at any time)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def child(args: argparse.Namespace) -> None:
    path = args.work / f"{args.child}.json"
    data: dict = {"done": False}

    def save() -> None:
        save_child(path, data)

    (vllm_side if args.child == "vllm" else trainer_side).run(args, data, save, start=time.perf_counter())
    data["done"] = True
    save()


def main() -> None:
    args = parse_args(sys.argv[1:])
    args.work.mkdir(parents=True, exist_ok=True)
    if args.child:
        return child(args)
    start = time.perf_counter()
    # rl_bench.machine imports vLLM in a subprocess (~15 s): meanwhile, on a GPU machine's many cores.
    machine_future = ThreadPoolExecutor(1).submit(describe_machine)
    logs = args.json.resolve().parent if args.json else args.work
    logs.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args)
    report = {"command": sys.argv, "args": {k: str(v) for k, v in vars(args).items()}, "model": str(model), "parts": {}}
    for kind in dict.fromkeys(PARTS[part] for part in args.parts):
        report["parts"][kind] = run_child(kind, args, model, logs)
        report["machine"] = machine_future.result()
        report["wall_s"] = round(time.perf_counter() - start, 1)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
    print(f"\nmachine: {report['machine']}\nmodel: {model}")
    vllm_side.print_report(report["parts"].get("vllm"))
    trainer_side.print_report(report["parts"].get("trainer"))
    print(f"\nwall time {time.perf_counter() - start:.0f}s" + (f"; JSON {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
