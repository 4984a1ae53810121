"""Every script in benchmarks/ (benchmarks/README.md lists them) run on the tiny model on CPU, asserting on
what it printed; a script that needs a GPU: its arguments and the pure functions it has.

    pytest tests/bench -n 2

Three more live with the tests of what they measure: benchmarks/gpu_exactness.py (tests/bench/test_gpu_exactness.py
runs all three parts on CPU), benchmarks/loss_options.py (tests/bench/test_loss_options_run.py) and
benchmarks/mismatch_probe.py (tests/bench/test_mismatch_probe.py).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

BENCH = ROOT / "benchmarks"
TINY = ROOT / ".cache" / "tiny-qwen2"
sys.path.insert(0, str(BENCH))

needs_tiny = pytest.mark.skipif(not (TINY / "config.json").exists(), reason="needs .cache/tiny-qwen2 (tools/make_tiny_model.py)")


def bench(script: str, *args: str, timeout: float = 300) -> str:
    """The script's stdout; a failing run fails the test with its output."""
    r = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, f"{script} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_trainer_bench_on_cpu_prints_both_sides_with_equal_losses():
    """Both sides' rows and losses, prl's with FSDP and with trainer.flat_params (+flat); --timeline's marks of
    one more step of the last variant, each micro-batch's and the optimizer step's (train.accumulate and
    train.optimizer_step hooked where train_step calls them)."""
    out = bench("trainer_bench.py", "--model-preset", "tiny", "--seq-len", "256", "--micro-batch", "4", "--steps", "2",
                "--variants", "eager,eager+flat", "--timeline")
    marks = re.findall(r"^  (step start|step end|micro-batch \((?:enter|return)\)|optimizer step \((?:enter|return)\))"
                       r"\s+[\d.]+$", out, re.M)
    assert marks == ["step start", *["micro-batch (enter)", "micro-batch (return)"] * 2,
                     "optimizer step (enter)", "optimizer step (return)", "step end"], out
    rows = {m.group(1).strip(): m for m in re.finditer(
        r"^(prl eager(?:\+flat)?|baseline \S+ mb\d+)\s+([\d.]+)\s+\S+\s+([\d.]+)\s+[\d.]+ GiB; ([-\d. ]+)$", out, re.M)}
    assert set(rows) == {"prl eager", "prl eager+flat", "baseline fp32 mb4"}, out
    for m in rows.values():
        assert float(m.group(2)) > 0 and float(m.group(3)) > 0
    prl, flat, base = ([float(x) for x in rows[name].group(4).split()]
                       for name in ("prl eager", "prl eager+flat", "baseline fp32 mb4"))
    assert len(prl) == 3 and prl == pytest.approx(base, rel=1e-4)  # warm-up + 2 steps, the same loss both sides
    assert flat == pytest.approx(prl, rel=1e-6)
    assert re.search(r"prl eager / baseline fp32 mb4 tokens/s: [\d.]+x", out)


def test_trainer_bench_on_cpu_compares_experts_implementations_of_the_tiny_moe():
    """The tiny MoE preset: each experts implementation trains to the same losses; MFU's N counts
    the active parameters (top-2 of 8 experts)."""
    out = bench("trainer_bench.py", "--model-preset", "tiny-moe", "--seq-len", "128", "--micro-batch", "2",
                "--steps", "1", "--skip-baseline", "--peak-tflops", "1",
                "--variants", "eager+experts_eager,eager+experts_batched_mm,eager+experts_grouped_mm")
    assert re.search(r"^model: tiny-moe \([\d.]+M active \(top-2 of 8 experts\) non-embedding params", out, re.M), out
    assert "N active params" in out
    rows = {m.group(1): m for m in re.finditer(
        r"^prl eager\+experts_(\w+)\s+([\d.]+)\s+([\d.]+)%\s+[\d.]+\s+[\d.]+ GiB; ([-\d. ]+)$", out, re.M)}
    assert set(rows) == {"eager", "batched_mm", "grouped_mm"}, out
    assert all(float(m.group(2)) > 0 and float(m.group(3)) > 0 for m in rows.values())
    losses = [[float(x) for x in m.group(4).split()] for m in rows.values()]
    assert len(losses[0]) == 2 and all(other == pytest.approx(losses[0], rel=1e-4) for other in losses[1:])


def test_cli_bench_times_the_dry_run_against_the_import():
    out = bench("cli_bench.py", "--runs", "2", "configs/toy.yaml")
    a = float(re.search(r"^A .*: median ([\d.]+) s .*n=2\)$", out, re.M).group(1))
    b = float(re.search(r"^B .*: median ([\d.]+) s .*n=2\)$", out, re.M).group(1))
    assert 0 < b < 30 and 0 < a < 30, out
    assert re.search(r"^A - B \(the work itself\): median -?[\d.]+ s$", out, re.M)


def test_lora_fold_bench_on_cpu_prints_copy_fold_and_sizes():
    out = bench("lora_fold_bench.py", "--preset", "tiny", "--rank", "4", "--rounds", "2")
    smaller = int(re.search(r"adapter version .*: (\d+)x smaller", out).group(1))
    assert smaller > 1, out
    copy, fold = (float(x) for x in re.search(r"copy .*: ([\d.]+) s; fold .*: ([\d.]+) s;", out).groups())
    assert copy >= 0 and fold >= 0


@needs_tiny
def test_orchestrator_batch_bench_times_each_round():
    out = bench("orchestrator_batch_bench.py", TINY, "--batch-size", "16", "--completion-tokens", "32", "--rounds", "3")
    rows = last_json(out)["rows"]  # each round with the heap as built, then each with it frozen
    assert [r["frozen"] for r in rows] == [False] * 3 + [True] * 3 and all(r["requests"] == 16 for r in rows), out
    assert all(0 < r["dispatch_s"] <= r["generate_step_s"] <= r["write_step_s"] < 60 for r in rows)
    assert re.search(r"^frozen / as built \(mean batch; a step waits for each\): [\d.]+$", out, re.M)


@needs_tiny
@pytest.mark.vllm
def test_inference_bench_on_cpu_prints_start_update_and_throughput():
    out = bench("inference_bench.py", "configs/toy.yaml", f"model.name={TINY}", "inference.enforce_eager=true",
                "inference.env.VLLM_CPU_KVCACHE_SPACE=1", "--requests", "8", "--tokens", "16", "--updates", "2")
    result = last_json(out)
    assert 0 < result["startup_s"] < 300, out
    assert len(result["update_s"]) == 2 and 0 < result["update_median_s"] < 30
    assert result["tokens"] == 8 * 16 and result["tokens_per_s"] > 0


@pytest.mark.slow  # a vLLM server and three verifiers v1 processes: ~2 minutes on 2 cores, past CI's budget
@pytest.mark.vllm
def test_v1_env_server_bench_times_the_worker_and_a_server_of_two():
    """The toy v1 task's episodes in the environment worker and through an environment server of 2 workers
    (tests/integration/test_v1_envs.py trains through one), against CPU vLLM serving the tiny Qwen3."""
    qwen3 = ROOT / ".cache" / "tiny-qwen3"
    if not (qwen3 / "config.json").exists() or not (ROOT / ".venv-v1/bin/python").exists():
        pytest.skip("needs .cache/tiny-qwen3 and .venv-v1 (tools/setup.sh)")
    out = bench("v1_env_server_bench.py", "configs/toy_v1.yaml", f"model.name={qwen3}",
                "orchestrator.rollouts_per_example=2", "--modes", "0,2", "--groups", "2", "--rounds", "1", timeout=600)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["server_workers"] for r in rows] == [0, 2], out
    assert all(r["episodes_per_round"] == 4 and r["errored"] <= 1 and r["median_episodes_per_s"] > 0 for r in rows), out
    assert "| server, 2 worker(s) | 4 |" in out, out


@needs_tiny
@pytest.mark.vllm
def test_weight_transfer_bench_on_cpu_times_file_and_broadcast():
    out = bench("weight_transfer_bench.py", "configs/toy.yaml", f"model.name={TINY}", "inference.enforce_eager=true",
                "inference.env.VLLM_CPU_KVCACHE_SPACE=1", "--updates", "1")
    result = last_json(out)
    assert len(result["file_s"]) == len(result["broadcast_s"]) == 1, out
    assert all(0 < s < 60 for s in result["file_s"] + result["broadcast_s"])
    assert result["backend"] == "gloo" and result["broadcast_vs_file"] > 0
    assert result["greedy_tokens_equal"] is True


def test_rl_bench_needs_gpus_its_runs_and_configs_are_pure():
    """rl_bench runs the loop on 1-8 GPUs (benchmarks/README.md); here its --runs grammar, the config
    each run gets, the efficiency it prints, and its --help."""
    from rl_bench_config import bench_config, parse_runs, run_name
    from rl_bench_tables import efficiency

    runs = parse_runs("2:recompute,1:inference:chat,2:recompute::inference.servers_per_gpu=2")
    assert runs == [(2, "tokens", "recompute", ()), (1, "chat", "inference", ()),
                    (2, "tokens", "recompute", ("inference.servers_per_gpu=2",))]
    args = argparse.Namespace(work=Path("/w"), steps=6, completion_tokens=1024, gpus=3, trainer_gpus=1, port=18000,
                              micro_batch=8, batch_size=256, stop_tokens=0, kv_cache_gib=12.0)
    config = bench_config(args, Path("/m"), 2, "tokens", "recompute", ("inference.servers_per_gpu=2",))
    assert config["inference"]["data_parallel"] == 2 and config["inference"]["servers_per_gpu"] == 2
    assert config["trainer"]["behaviour_logprobs"] == "recompute" and config["run"]["async_level"] == 2
    assert config["run"]["name"] == run_name(2, "tokens", "recompute", ("inference.servers_per_gpu=2",))
    assert efficiency(5.6, 3.0, 5.8) == "0.97" and efficiency(None, 3.0, 5.8) == "-"
    assert "--runs" in bench("rl_bench.py", "--help")


def test_server_start_bench_and_its_phases():
    """The start of K servers needs K GPUs for its figures (it runs on CPU with --gpus 1, one vLLM start
    more than this tier affords); here the phases it and rl_bench read from a vLLM log, and its --help."""
    import server_start_phases

    log = "\n".join([
        "INFO 11-28 10:00:00 [utils.py:1] non-default args: {'model': 'm'}",
        "INFO 11-28 10:00:04 [config.py:2] Resolved architecture: Qwen2ForCausalLM",
        "INFO 11-28 10:00:09 [core.py:3] Initializing a V1 LLM engine (v0.26.0) with config: ...",
        "INFO 11-28 10:00:15 [loader.py:4] Model loading took 2.9 GiB and 1.2 seconds",
        "INFO 11-28 10:00:31 [api_server.py:5] Starting vLLM server on http://127.0.0.1:8000",
    ])
    assert server_start_phases.seconds(log) == {"api": 0.0, "config": 4.0, "engine": 9.0, "weights": 15.0,
                                                 "serving": 31.0}
    assert "--variants" in bench("server_start_bench.py", "--help")


def test_first_step_bench_draws_varied_batches_and_parses():
    """Its CPU run compiles the tiny model's blocks cold (20 s on a quiet 2-core VM, 90 s on a busy one):
    here the varied-length batches it draws, and its --help."""
    from first_step_bench import varied_batch

    args = argparse.Namespace(samples=64, stop_tokens=300, micro_batch=8, micro_batch_tokens=None)
    one, again = varied_batch(3, args, 768), varied_batch(3, args, 768)
    (rank0,) = one.micro_batches  # one rank
    assert one.step == 3 and len(rank0) == 8 and sum(mb["num_samples"] for mb in rank0) == 64
    assert [mb["input_ids"].tolist() for mb in rank0] == [mb["input_ids"].tolist() for mb in again.micro_batches[0]]
    for mb in rank0:  # each sample's positions start at 0: 29 prompt tokens and a completion of 1 to 1,024
        starts = (mb["position_ids"][0] == 0).nonzero().flatten().tolist() + [mb["position_ids"].shape[1]]
        assert len(starts) - 1 == mb["num_samples"]
        assert all(30 <= b - a <= 29 + 1024 for a, b in zip(starts, starts[1:]))
    assert "--variants" in bench("first_step_bench.py", "--help")


def test_gpu_only_helpers_parse_their_arguments():
    for script, option in (("gpu_busy.py", "matmul"), ("gpu_exactness.py", "--parts"), ("bench_model.py", "--preset")):
        assert option in bench(script, "--help"), script


def test_kernels_bench_times_the_logprob_kernels_against_the_logsumexp_form_on_cpu():
    """CPU, eager: the two forms agree, each kernel is timed; attention says it needs a GPU."""
    out = bench("kernels_bench.py", "--what", "logprobs,attention", "--rows", "64", "--vocab", "4096", "--repeat", "2")
    res = last_json(out)["logprobs"]
    assert res["compiled"] is False and min(res["stats_ms"], res["logsumexp_stats_ms"], res["grad_ms"]) > 0
    assert max(res["max_diff_logprob_entropy_lse"]) < 1e-4, res
    assert re.search(r"^  prl / logsumexp form time: [\d.]+x;", out, re.M), out
    assert "attention: needs a GPU" in out
