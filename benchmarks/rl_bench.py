"""The whole RL loop (`prl submit --local`) on 1 or 2 GPUs, against offline vLLM on the same GPU.

    python benchmarks/rl_bench.py --preset qwen2-1.5b --gpus 2 --async-levels 0,1,2 --work /tmp/rl_bench
    python benchmarks/rl_bench.py --preset qwen2-0.5b --gpus 1 --diagnose      # + where rollout time goes
    python benchmarks/rl_bench.py --preset qwen2-1.5b --gpus 1 --async-levels 1 --behaviour inference,recompute
    python benchmarks/rl_bench.py --preset qwen2-1.5b --gpus 1 --runs 1:recompute,1:inference,2:recompute
    python benchmarks/rl_bench.py --preset qwen2-1.5b --gpus 1 --runs 2:recompute,2:recompute::trainer.behaviour_on_host=true
    python benchmarks/rl_bench.py --preset qwen2-1.5b --gpus 1 --stop-tokens 300 --runs 1:inference,1:inference::orchestrator.continuous=true

One process, one machine, in this order: build a Qwen2-shaped model with random weights
(bench_model.py) -> offline vLLM generation of the loop's batch on the inference GPU (the engine's
speed: the baseline of every ratio) -> [--diagnose: the same batch through prl's server, by plain
HTTP and by the orchestrator's own code] -> one local run per async level. Every completion is
exactly --completion-tokens long (`orchestrator.sampling.extra_body.ignore_eos`), unless
--stop-tokens N gives it N token ids that end it (lengths that vary, the same offline); the task is the
toy environment (cheap scoring, reward meaningless for a random model). --behaviour: one run per
trainer.behaviour_logprobs value (recompute: vLLM is asked for no logprobs, the trainer computes them).

--gpus 2: vLLM on GPU 0, the trainer on GPU 1 (--gpus 3/4: vLLM data-parallel on GPUs 0-1/0-2, each ratio
against that many times the one-GPU offline figure; --trainer-gpus 2 --gpus 4: vLLM on 0-1, the
trainer on 2-3). --gpus 1: both on GPU 0; vLLM gets a fixed KV cache (--kv-cache-gib) instead of a
fraction of memory, because its start-up profiling aborts when another process frees GPU memory
meanwhile, which the starting trainer does.

GPU N means the Nth of CUDA_VISIBLE_DEVICES where that is set, so two benchmarks can share a machine:
`CUDA_VISIBLE_DEVICES=2,3 ... --gpus 2 --port 18200` beside one on GPUs 0-1, each with its own --work
(run one data-parallel vLLM at a time, a precaution). --offline-json names
the figures of another rl_bench on the same machine; a file not there yet is waited for after the
loop runs, so the baseline can be measured beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rl_bench_config import bench_config, inference_memory, parse_runs, run_name  # noqa: E402
from rl_bench_tables import print_tables  # noqa: E402
import server_start_phases  # noqa: E402


def cpu_model() -> str:
    return next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")


def machine() -> str:
    """GPU, driver, CPU and versions: the figures mean nothing without them."""
    gpus = shutil.which("nvidia-smi") and subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True).stdout.strip().replace("\n", "; ")
    cpu = cpu_model()
    versions = subprocess.run([sys.executable, "-c", "import torch, vllm, transformers as t; "
                               "print(f'torch {torch.__version__}, vllm {vllm.__version__}, transformers {t.__version__}')"],
                              capture_output=True, text=True).stdout.strip().splitlines()
    # The last line: vLLM may log to stdout as it is imported.
    return f"{platform.node()}: {gpus or 'no GPU'}; CPU {cpu} x {os.cpu_count()}; {versions[-1] if versions else '?'}"


def build_model(preset: str, work: Path) -> Path:
    """The model directory (a child process: its GPU memory is gone before vLLM starts)."""
    out = work / "models" / preset
    subprocess.run([sys.executable, str(HERE / "bench_model.py"), "--preset", preset, "--out", str(out)], check=True)
    return out


def gpu_ids(args: argparse.Namespace) -> list[str]:
    """The GPUs this benchmark uses: the first --gpus of CUDA_VISIBLE_DEVICES, or 0..--gpus-1 (read as
    local mode reads it, which then starts the run on them)."""
    from prl.control.local import visible_gpus

    ids = visible_gpus(os.environ, args.gpus)
    if len(ids) < args.gpus:
        sys.exit(f"--gpus {args.gpus}: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} lists {len(ids)}")
    return ids[:args.gpus]


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def gpu_memory_used(ids: list[str]) -> list[float]:
    """GiB in use on each of the benchmark's GPUs, as nvidia-smi sees it (every process, the allocators'
    caches included)."""
    out = subprocess.run(["nvidia-smi", "-i", ",".join(ids), "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return [float(line) / 1024 for line in out.split()]


def failure(run: Path) -> str:
    """What a failed run's logs say: each component's last traceback (or its last lines)."""
    parts = []
    for log in sorted(run.glob("logs/attempt_0/*/*.out")) + sorted(run.glob("logs/attempt_0/trainer/rank_*.log")):
        lines = log.read_text(errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
        excerpt = lines[starts[-1]:starts[-1] + 60] if starts else lines[-20:]
        parts.append(f"--- {log}\n" + "\n".join(excerpt))
    return "\n".join(parts)


def attempt_log(run: Path, attempt: int) -> Path:
    return run / "logs" / f"attempt_{attempt}"


def launch(args: argparse.Namespace, argv: list[str], metrics_file: Path, out_path: Path) -> tuple[int, float | None, list]:
    """One `prl submit --local ...` to its end: its exit status, the seconds from the launch to its first
    step's metrics, and the most GPU memory in use (sampled each second)."""
    start, first_step, peak, sampled = time.perf_counter(), None, [], 0.0
    with open(out_path, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if first_step is None and metrics_file.exists() and metrics_file.stat().st_size:
                first_step = time.perf_counter() - start
            if time.perf_counter() - sampled > 1.0:
                sampled, used = time.perf_counter(), gpu_memory_used(gpu_ids(args))
                peak = [max(a, b) for a, b in zip(peak, used)] if peak else used
            if time.perf_counter() - start > args.run_timeout:
                proc.terminate()  # prl's own teardown: checkpoint, then every component by PID
                proc.wait()
                break
            time.sleep(0.2)
    return proc.returncode, first_step, peak


def server_phases(run: Path, attempt: int) -> dict:
    """vLLM's start by phase, from its own lines (benchmarks/server_start_phases.py)."""
    out = "\n".join(p.read_text(errors="replace") for p in sorted(attempt_log(run, attempt).glob("inference/*.out")))
    return server_start_phases.seconds(out)


def run_loop(args: argparse.Namespace, model: Path, level: int, route: str, behaviour: str,
             overrides: tuple[str, ...] = ()) -> dict:
    """One `prl submit --local`; per-step trainer metrics, the launch -> first-step time and the most
    GPU memory in use; `error` when it failed before its last step. With --resume-steps, then the run
    resumed (`resumed`)."""
    name = run_name(level, route, behaviour, overrides)
    config = args.work / f"{name}.yaml"
    config.write_text(yaml.safe_dump(bench_config(args, model, level, route, behaviour, overrides)))
    run = args.work / "runs" / name
    metrics_file = attempt_log(run, 0) / "trainer" / "metrics.jsonl"
    argv = [sys.executable, "-m", "prl.control.cli", "submit", str(config), "--local", "--clean"]
    start = time.perf_counter()
    code, first_step, peak = launch(args, argv, metrics_file, args.work / f"{name}.out")
    steps = read_metrics(metrics_file)
    result = {"steps": steps, "first_step_s": first_step, "wall_s": time.perf_counter() - start, "gpu_peak_gib": peak,
              "server_phases": server_phases(run, 0)}
    if args.resume_steps and code == 0:
        result["resumed"] = resume(args, config, run, name)
    # At 1.5B a run leaves ~30 GB (its final checkpoint with the optimizer state, the kept weight
    # versions): on a 64 GB disk the third run ran out of space (h100-2026-11-23f). Logs stay.
    for bulky in ("checkpoints", "weights") + (() if args.keep_rollouts else ("rollouts",)):
        shutil.rmtree(run / bulky, ignore_errors=True)
    if code != 0 and len(steps) < args.steps:
        text = failure(run)
        print(f"{name}: prl exited with {code} after {len(steps)} steps\n{text}", flush=True)
        (args.work / f"{name}.failure.txt").write_text(text)
        return result | {"error": f"exit {code} after {len(steps)} of {args.steps} steps"}
    if code != 0:
        # Every step was measured; what failed or ran out of time was the run's final full checkpoint
        # (model + optimizer state, written after the last step), which is no part of a step. At 7B
        # that is 91 GB: more than a device machine's disk had left (h200x2-2026-11-28).
        failed = attempt_log(run, 0) / "failed"
        end = failed.read_text().strip() if failed.exists() else f"stopped after --run-timeout {args.run_timeout:.0f} s"
        print(f"{name}: all {len(steps)} steps done; then, during the final checkpoint: {end}")
        result["end"] = end
    return result


def resume(args: argparse.Namespace, config: Path, run: Path, name: str) -> dict:
    """The finished run continued by a second job on its directory, --resume-steps more steps: what a
    requeued or resumed attempt does (its checkpoint loaded, every compile cache and the run's key as
    the first attempt left them). Its first step and start-up, from its own launch."""
    settings = yaml.safe_load(config.read_text())
    settings["run"]["max_steps"] = args.steps + args.resume_steps
    config.write_text(yaml.safe_dump(settings))
    metrics_file = attempt_log(run, 1) / "trainer" / "metrics.jsonl"
    argv = [sys.executable, "-m", "prl.control.cli", "submit", str(config), "--local", "--resume"]
    code, first_step, _ = launch(args, argv, metrics_file, args.work / f"{name}.resumed.out")
    steps = read_metrics(metrics_file)
    return {"exit": code, "steps": len(steps), "first_step_s": first_step, "startup": startup(steps),
            "server_phases": server_phases(run, 1)}


def startup(steps: list[dict]) -> dict:
    """Where the first step's time went, seconds from the launch (the trainer's startup/* metrics)."""
    return {k.removeprefix("startup/"): v for k, v in (steps[:1] or [{}])[0].items() if k.startswith("startup/")}


def summarize(level: int, route: str, behaviour: str, overrides: tuple[str, ...], result: dict, skip: int) -> dict:
    """Means over the steps after the first `skip` (compilation, the pipeline filling up); peaks over all."""
    steady = result["steps"][skip:] or result["steps"][-1:]

    def mean(key: str) -> float:
        values = [s[key] for s in steady if key in s]
        return statistics.fmean(values) if values else float("nan")

    updates = [s["rollout/weight_update_s"] for s in result["steps"] if s.get("rollout/weight_update_s", 0) > 0]
    step_s = mean("perf/step_s")
    peaks = [s["perf/peak_memory_gib"] for s in result["steps"] if "perf/peak_memory_gib" in s]
    return {
        "async_level": level, "route": route, "behaviour": behaviour, "overrides": list(overrides),
        "error": result.get("error"), "steps": len(result["steps"]), "step_s": step_s,
        "trainer_peak_gib": max(peaks, default=float("nan")), "gpu_peak_gib": result["gpu_peak_gib"],
        "trainer_busy": (mean("perf/train_s") + mean("perf/export_s")) / step_s, "trainer_idle": mean("perf/wait_s") / step_s,
        "train_s": mean("perf/train_s"), "export_s": mean("perf/export_s"), "publish_s": mean("perf/publish_s"),
        "behaviour_s": mean("perf/behaviour_s"),  # nan without recompute
        # The first step's own train time (compile and first allocations land there unless prewarmed).
        "first_train_s": (result["steps"][:1] or [{}])[0].get("perf/train_s", float("nan")),
        "generation_s": mean("rollout/generation_s"), "rollout_tok_s": mean("rollout/rollout_tokens_per_s"),
        "completion_len": mean("rollout/completion_len_mean"),
        "stale_groups": mean("rollout/stale_groups"), "mixed_version_frac": mean("rollout/mixed_version_frac"),
        "weight_update_s": statistics.median(updates) if updates else float("nan"),
        # Of the steps that loaded a version: the share loaded from the copy read ahead (inference.stage_weights).
        "weight_staged": statistics.fmean(staged) if (staged := [s.get("rollout/weight_staged", 0.0) for s in result["steps"]
                                                                 if s.get("rollout/weight_update_s", 0) > 0]) else float("nan"),
        "first_step_s": result["first_step_s"], "wall_s": result["wall_s"], "end": result.get("end"),
        # Every step's, the stalls included (the means above leave the first `skip` out).
        "train_s_by_step": [s.get("perf/train_s") for s in result["steps"]],
        "generation_s_by_step": [s.get("rollout/generation_s") for s in result["steps"]],
        "weight_update_s_by_step": [s.get("rollout/weight_update_s") for s in result["steps"]],
        "compiled_by_step": [s.get("perf/compiled_frames") for s in result["steps"]],
        "startup": startup(result["steps"]),
        "server_phases": result.get("server_phases", {}),
        "resumed": result.get("resumed"),
    }


def engine_run(argv: list[str], log: Path, timeout_s: float, gpu: str) -> subprocess.CompletedProcess:
    """One rl_bench_engine.py measurement on `gpu`, its output kept in `log`; a hang ends at `timeout_s`
    (its process group killed, vLLM's engine processes with it) as a failure with the output so far."""
    with open(log, "w+") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu})
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n[rl_bench] killed after {timeout_s:.0f}s\n")
        out.seek(0)
        text = out.read()
    return subprocess.CompletedProcess(argv, proc.returncode, text, "")


def last_json(text: str) -> dict:
    """The measurement's result: the last line that is a JSON object (vLLM may log after it)."""
    return json.loads(next(line for line in reversed(text.splitlines()) if line.startswith("{")))


def offline(args: argparse.Namespace, model: Path) -> dict:
    """Offline engine tok/s on the inference GPU (a child process, so its memory is freed after)."""
    if args.offline_json:  # measured in the same call (another rl_bench run's baseline)
        return wait_for_offline(args.offline_json, args.engine_timeout)["offline"]
    argv = [sys.executable, str(HERE / "rl_bench_engine.py"), "offline", str(model), "--batch-size", str(args.batch_size),
            "--completion-tokens", str(args.completion_tokens), "--memory", json.dumps(inference_memory(args)),
            "--stop-tokens", str(args.stop_tokens), "--beside", json.dumps(beside_argvs(args, model))]
    out = engine_run(argv, args.work / "offline.out", args.engine_timeout, gpu_ids(args)[0])
    if out.returncode != 0:
        print(out.stdout[-8000:])
        raise RuntimeError("offline generation failed")
    return last_json(out.stdout)


def wait_for_offline(path: Path, timeout_s: float) -> dict:
    """The baseline another rl_bench is measuring beside this one: its --json once written (it writes it whole)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"--offline-json: {path} did not appear within {timeout_s:.0f} s")
        time.sleep(2)
    return json.loads(path.read_text())


def beside_argvs(args: argparse.Namespace, model: Path) -> list:
    """--interference: the offline requests again beside a training step, then beside matmuls alone, on the
    trainer's GPU (gpu_busy.py): what the engine loses to the trainer working beside it."""
    if not args.interference or args.gpus < 2:
        return []
    gpu = ["env", f"CUDA_VISIBLE_DEVICES={gpu_ids(args)[-1]}", sys.executable, str(HERE / "gpu_busy.py")]
    return [[f"a training step on GPU {gpu_ids(args)[-1]}", [*gpu, "train", "--model", str(model)]],
            [f"matmuls on GPU {gpu_ids(args)[-1]}", [*gpu, "matmul"]]]


def diagnose(args: argparse.Namespace, model: Path) -> dict:
    """The loop's batch through prl's server: plain HTTP variants and the orchestrator's code path."""
    config = args.work / "diagnose.yaml"
    one_gpu = bench_config(args, model, 1, overrides=("inference.gpus_per_node=1", "inference.data_parallel=1"))
    config.write_text(yaml.safe_dump(one_gpu))  # GPU 0 only, as offline
    argv = [sys.executable, str(HERE / "rl_bench_engine.py"), "server", str(config)]
    out = engine_run(argv, args.work / "diagnose.out", args.engine_timeout, gpu_ids(args)[0])
    if out.returncode != 0:
        print(out.stdout[-8000:])
        raise RuntimeError("server diagnosis failed")
    return last_json(out.stdout)


def reprint(parser: argparse.ArgumentParser, path: Path) -> None:
    """The tables of a --json written earlier, from its settings and figures (a settings file without
    the GPUs' ids, from before they were kept, shows ?0, ?1...)."""
    saved = json.loads(path.read_text())
    args = parser.parse_args([])
    args.gpu_list = None
    for key, text in saved["args"].items():  # saved as str(value): back to the parser's default's type
        default = getattr(args, key, None)
        if text == "None" or key == "tables_from":
            continue
        if isinstance(default, bool):
            text = text == "True"
        elif isinstance(default, (int, float)):
            text = type(default)(text)
        setattr(args, key, text)
    print(f"machine: {saved['machine']}\n(the tables of {path}, printed again)")
    print_tables(args, saved["offline"], saved["loop"], saved["diagnose"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2-0.5b")
    parser.add_argument("--trainer-gpus", type=int, default=1, help="the last GPUs, FSDP over them (with --gpus > it)")
    parser.add_argument("--gpus", type=int, choices=range(1, 9), default=2,
                        help="1: shared; N > 1: N - 1 vLLM replicas and the trainer on a GPU of its own")
    parser.add_argument("--async-levels", default="0,1,2")
    parser.add_argument("--routes", default="tokens", help="orchestrator.rollout_route values, each run per level")
    parser.add_argument("--behaviour", default="inference", help="trainer.behaviour_logprobs values, each run per level and route")
    parser.add_argument("--runs", help="instead of every combination: LEVEL:BEHAVIOUR[:ROUTE[:KEY=VALUE...]],... in this "
                        "order (an empty ROUTE: tokens; KEY=VALUE: any config key, e.g. trainer.behaviour_on_host=true)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip", type=int, default=2, help="steps left out of the means")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--stop-tokens", type=int, default=0,
                        help="N token ids end a completion (about vocabulary / N tokens long, up to --completion-tokens): "
                             "lengths that vary, offline and in the loop; 0: every completion full length")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--kv-cache-gib", type=float, default=12.0, help="vLLM's KV cache with --gpus 1")
    parser.add_argument("--diagnose", action="store_true")
    parser.add_argument("--interference", action="store_true",
                        help="offline: two requests again beside a training step and beside matmuls on the trainer's GPU")
    parser.add_argument("--offline-json", type=Path, help="the offline figures of an earlier --json (same machine, same call)")
    parser.add_argument("--skip-loop", action="store_true", help="only the engine figures")
    parser.add_argument("--keep-rollouts", action="store_true",
                        help="keep each run's batches (RUN/rollouts), e.g. for benchmarks/mismatch_probe.py")
    parser.add_argument("--engine-last", action="store_true",
                        help="the offline baseline after the loop: the first run's start-up meets no cache the engine left")
    parser.add_argument("--resume-steps", type=int, default=0,
                        help="then resume each finished run for this many more steps: a requeued attempt's start-up")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="per run, start to the final checkpoint")
    parser.add_argument("--engine-timeout", type=float, default=600.0, help="per offline or diagnose measurement")
    parser.add_argument("--work", type=Path, default=Path("/tmp/rl_bench"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--port", type=int, default=18000, help="vLLM's port is this + the async level")
    parser.add_argument("--tables-from", type=Path, help="only print the tables of an earlier --json again (its "
                        "settings and figures, today's formulas), running nothing")
    args = parser.parse_args()
    if args.tables_from:
        reprint(parser, args.tables_from)
        return
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}", flush=True)
    model = build_model(args.preset, args.work)
    # A --gpus that CUDA_VISIBLE_DEVICES cannot hold ends here, before anything starts.
    args.gpu_list = ",".join(gpu_ids(args))
    if args.gpus > 1 and not 1 <= args.trainer_gpus < args.gpus:
        sys.exit(f"--trainer-gpus {args.trainer_gpus}: needs 1 to {args.gpus - 1} of --gpus {args.gpus}")
    # A baseline from another rl_bench is read after the loop runs: it may be measured beside them.
    engine = None if args.offline_json or args.engine_last else offline(args, model)
    if engine:
        print(f"offline: {json.dumps(engine)}", flush=True)
    diag = diagnose(args, model) if args.diagnose else None
    if diag:
        print(f"diagnose: {json.dumps(diag)}", flush=True)
    rows = []
    runs = [(int(level), route, behaviour, ()) for level in args.async_levels.split(",") for route in args.routes.split(",")
            for behaviour in args.behaviour.split(",")]
    if args.runs:
        runs = parse_runs(args.runs)
    for level, route, behaviour, overrides in [] if args.skip_loop else runs:
        result = run_loop(args, model, level, route, behaviour, overrides)
        rows.append(summarize(level, route, behaviour, overrides, result, args.skip))
        print(f"loop: {json.dumps(rows[-1])}", flush=True)
    engine = engine or offline(args, model)
    print_tables(args, engine, rows, diag)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "offline": engine, "diagnose": diag, "loop": rows}, indent=1))


if __name__ == "__main__":
    main()
