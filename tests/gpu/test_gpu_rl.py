"""prl on a CUDA GPU with real vLLM (0.26 on the H100/H200 machines): the server's weight update
against transformers, and a short whole-loop local run.

    pytest tests/gpu/test_gpu_rl.py          # ~3 min on one H100; skipped without CUDA

The server test runs float32 on the tiny model, so vLLM's greedy tokens must equal transformers' (the
same check as the CPU tests in test_inference.py), here with CUDA graphs captured: the update must
reach the weights the captured graphs read. The loop runs bf16 (the trainer's CUDA attention has no
float32); on one GPU its inference and trainer share it (prl/control/local.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers import tiny_model_dir
from inference_helpers import hf_greedy, perturbed_model, served_greedy, stream_with_update, switch_point

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["What is 12 + 35?", "Reverse: the cat sees a red ball", "The quick brown fox"]
# vLLM sizes a fixed KV cache instead of profiling: its profiling aborts when another process on the
# GPU frees memory meanwhile, which a trainer sharing the GPU does.
GPU_INFERENCE = "inference: {gpus_per_node: 1, gpu_memory_utilization: 0.3, extra_args: [--kv-cache-memory-bytes, '2147483648']}\n"


@pytest.fixture(scope="module")
def perturbed(tiny_model: Path, tmp_path_factory) -> tuple[object, Path]:
    """The tiny model plus noise, in float32 on the GPU, and saved as the trainer saves a version."""
    model = perturbed_model(tiny_model)
    path = tmp_path_factory.mktemp("weights") / "step_1"
    model.save_pretrained(path)
    return model.cuda(), path


def test_update_weights_on_gpu_matches_transformers(tiny_model, start_inference_server, perturbed, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = tmp_path / "inference.yaml"
    config.write_text(f"run: {{name: gpu-inference, output_dir: {tmp_path}/out}}\n"
                      f"model: {{name: {tiny_model}, dtype: float32, max_model_len: 512}}\n" + GPU_INFERENCE +
                      "orchestrator: {environment: {id: prl.envs.toy}}\n")
    server = start_inference_server(config, [f"inference.weights_root={perturbed[1].parent}"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    original = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval().cuda()
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as http:

        def greedy(prompt: str) -> list[int]:
            return served_greedy(http, str(tiny_model), prompt)

        before = [greedy(p) for p in PROMPTS]
        response = http.post("/update_weights", json={"path": str(perturbed[1])})
        assert response.status_code == 200, response.text
        after = [greedy(p) for p in PROMPTS]
        # In flight (orchestrator.continuous): back to the original weights while a request runs.
        n = 400
        body = {"model": str(tiny_model), "prompt": PROMPTS[2], "max_tokens": n, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        streamed, kept = stream_with_update(http, body, {"path": str(tiny_model), "in_flight": True})
    print(f"\nupdate_weights on GPU (tiny model): {response.json()['seconds']:.3f}s in the server")
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert before == [hf_greedy(original, ids) for ids in prompt_ids]
    assert after == [hf_greedy(perturbed[0], ids) for ids in prompt_ids]
    assert after != before
    assert kept.status_code == 200 and len(streamed) == n
    k = switch_point(streamed, hf_greedy(perturbed[0], prompt_ids[2], n), prompt_ids[2],
                     lambda ids, count: hf_greedy(original, ids, count))
    assert k is not None, "the running request never went on as the new weights would"
    print(f"in-flight update on GPU: {kept.json()['seconds']:.3f}s; the request switched after token {k} of {n}")


def local_run(config: str, base: Path, overrides: list[str]) -> list[dict]:
    """`prl submit configs/CONFIG.yaml --local` in `base` to its end (its run is named as the config); its
    trainer's metrics, one dict a step. On failure, each component's log tail."""
    argv = [sys.executable, "-m", "prl.control.cli", "submit", str(ROOT / f"configs/{config}.yaml"), "--local", *overrides]
    proc = subprocess.run(argv, cwd=base, capture_output=True, text=True, timeout=600)
    run = base / config
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(run.glob("logs/attempt_0/*/local.out")))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    return [json.loads(line) for line in (run / "logs/attempt_0/trainer/metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_short_local_run_on_gpu_learns(tmp_path, tiny_model):
    """`prl submit configs/toy.yaml --local` with vLLM and the trainer on the GPU (one GPU: shared)."""
    # bfloat16: the trainer's packed attention on CUDA (PyTorch's varlen flash kernel) has no float32.
    overrides = [f"run.output_dir={tmp_path}", "run.wandb.mode=disabled", f"model.name={tiny_model}", "model.dtype=bfloat16", "inference.port=18741",
                 "inference.gpus_per_node=1", "trainer.gpus_per_node=1", "inference.enforce_eager=false",
                 "inference.gpu_memory_utilization=0.3", "inference.extra_args=[--kv-cache-memory-bytes,2147483648]"]
    run = tmp_path / "toy"
    steps = local_run("toy", tmp_path, overrides)
    assert [m["step"] for m in steps] == list(range(20))
    assert [m["rollout/policy_version"] for m in steps] == [max(0, s - 1) for s in range(20)]
    rewards = [m["rollout/reward_mean"] for m in steps]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    kl = [m["train/mismatch_kl"] for m in steps]
    print(f"\nGPU toy run: reward first 5 {first:.3f}, last 5 {last:.3f}; mismatch_kl step 0 {kl[0]:.2e}; "
          f"step_s median {sorted(m['perf/step_s'] for m in steps)[10]:.2f}; "
          f"trainer peak {max(m['perf/peak_memory_gib'] for m in steps):.2f} GiB")
    assert all(math.isfinite(m["train/loss"]) for m in steps)
    # the tiny model needs far less than 8 GiB; the allocator reserves at least what it hands out
    assert all(0 < m["perf/peak_memory_gib"] <= m["perf/peak_reserved_gib"] < 8 for m in steps)
    # Step 0 is the one step where sampler and trainer hold the same weights (later ones include the
    # async_level=1 policy lag): bf16 rounding only. Measured on an H100: 8.5e-7 (steps 1+: up to 0.04).
    assert kl[0] < 1e-4
    assert last > first + 0.05
    assert (run / "weights/step_20/COMPLETE").exists()


TOOL_RUN = ["run.max_steps=3", "inference.gpus_per_node=1", "trainer.gpus_per_node=1", "inference.enforce_eager=false",
            "inference.gpu_memory_utilization=0.3", "inference.extra_args=[--kv-cache-memory-bytes,2147483648]"]
"""configs/calculator.yaml on one GPU, vLLM and the trainer sharing it, 3 steps."""


def check_tool_run(proc: subprocess.CompletedProcess, run: Path, title: str) -> None:
    """The tool run completed, its calls happened and every rollout reached the trainer; on failure,
    every error line of every component (an engine error's cause is far from the log's end), then the tails."""
    outs = sorted(run.glob("logs/attempt_0/*/local.out"))
    errors = [line for p in outs for line in p.read_text().splitlines() if "Error" in line or "error" in line]
    assert proc.returncode == 0, proc.stdout + proc.stderr + "\n".join(errors[-80:] + [p.read_text()[-3000:] for p in outs])
    steps = [json.loads(line) for line in (run / "logs/attempt_0/trainer/metrics.jsonl").read_text().splitlines()]
    print(f"\n{title}, per step (tool calls per rollout, dropped, errored, samples): "
          + "; ".join(f"{m['rollout/metric/total_tool_calls']:.2f} {m['rollout/dropped_frac']:.0f} "
                      f"{m['rollout/error_frac']:.0f} {m['rollout/samples']:.0f}" for m in steps))
    assert [m["step"] for m in steps] == [0, 1, 2]
    assert all(m["rollout/dropped_frac"] == 0 and m["rollout/error_frac"] == 0 for m in steps)
    assert all(m["rollout/samples"] + m["rollout/zero_advantage_samples"] == m["rollout/rollouts"] == 32 for m in steps)
    assert sum(m["rollout/metric/total_tool_calls"] for m in steps) > 0


@pytest.mark.slow
def test_a_tool_run_on_gpu_trains_its_calls(tmp_path, tiny_model):
    """configs/calculator.yaml on the GPU (vLLM 0.26 there; the CPU tests run 0.32): the servers' hermes
    parser finds the calls of the random tiny model held to the format (hermes_format), ToolEnv
    answers, and every rollout reaches the trainer: none errored, none dropped."""
    overrides = [f"run.output_dir={tmp_path}", "run.wandb.mode=disabled", f"model.name={tiny_model}", "model.dtype=bfloat16",
                 "model.max_model_len=512", "inference.port=18743", "orchestrator.sampling.max_tokens=72",
                 "orchestrator.environment.args={max_turns: 2, hermes_format: true}", *TOOL_RUN]
    argv = [sys.executable, "-m", "prl.control.cli", "submit", str(ROOT / "configs/calculator.yaml"), "--local", *overrides]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    check_tool_run(proc, tmp_path / "calculator", "GPU tool run")


@pytest.mark.slow
def test_sft_then_a_tool_run_on_gpu_trains_unconstrained_calls(tmp_path, tiny_model):
    """configs/sft_calculator.yaml, then configs/calculator.yaml from its weights, on the GPU: the model
    calls the tool because SFT taught it the format (no structured outputs), the servers' hermes parser
    finds the calls, and every rollout reaches the trainer. One H200 (2026-12-02): 0.34, 0.28, 0.47 calls
    per rollout (benchmarks/reports/gpu-tier-tool-runs_h200_2026-12-02.md); on CPU 0.34-0.56."""
    common = ["model.dtype=bfloat16", "run.wandb.mode=disabled", f"run.output_dir={tmp_path}"]
    sft = [sys.executable, "-m", "prl.control.cli", "submit", str(ROOT / "configs/sft_calculator.yaml"), "--local",
           f"model.name={tiny_model}", "trainer.gpus_per_node=1", *common]
    proc = subprocess.run(sft, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rl = [sys.executable, "-m", "prl.control.cli", "submit", str(ROOT / "configs/calculator.yaml"), "--local",
          f"model.name={tmp_path / 'sft-calculator/weights/step_60'}", "inference.port=18745", *TOOL_RUN, *common]
    proc = subprocess.run(rl, cwd=ROOT, capture_output=True, text=True, timeout=600)
    check_tool_run(proc, tmp_path / "calculator", "GPU SFT -> tool run")


V1_PYTHON = os.environ.get("PRL_V1_PYTHON", str(ROOT / ".venv-v1/bin/python"))
"""verifiers 0.4's Python: .venv-v1 (tools/setup.sh), or on the offline GPU machines tools/make_gpu_v1.sh's
.gpu-v1/python, named by PRL_V1_PYTHON."""


@pytest.mark.slow
@pytest.mark.skipif(not os.access(V1_PYTHON, os.X_OK), reason=f"{V1_PYTHON} is missing (tools/make_gpu_v1.sh)")
def test_a_v1_environment_runs_in_the_loop_on_gpu(tmp_path):
    """configs/toy_v1.yaml on the GPU: the v1 toy taskset's two-turn episodes in its environment worker,
    sampled through verifiers' TrainClient and vLLM 0.26's /inference/v1/generate (the CPU tests run
    0.32), renderers' Qwen3 renderer carrying each conversation as token ids; every rollout trains, and
    at step 0 (equal weights) the trainer's logprobs of the served tokens are the sampler's to bf16."""
    overrides = [f"run.output_dir={tmp_path}", "run.wandb.mode=disabled", f"model.name={tiny_model_dir('qwen3')}",
                 "model.dtype=bfloat16", "inference.port=18747", f"orchestrator.environment.python={V1_PYTHON}", *TOOL_RUN]
    steps = local_run("toy_v1", tmp_path, overrides)
    print("\nGPU v1 run, per step (rollouts, errored, dropped, samples, completion tokens, mismatch KL): "
          + "; ".join(f"{m['rollout/rollouts']:.0f} {m['rollout/error_frac']:.2f} {m['rollout/dropped_frac']:.2f} "
                      f"{m['rollout/samples']:.0f} {m['rollout/completion_len_mean']:.1f} {m['train/mismatch_kl']:.1e}"
                      for m in steps))
    assert [m["step"] for m in steps] == [0, 1, 2]
    assert all(m["rollout/error_frac"] == 0 and m["rollout/dropped_frac"] == 0 for m in steps)
    assert all(m["rollout/samples"] + m["rollout/zero_advantage_samples"] == m["rollout/rollouts"] == 64 for m in steps)
    assert all(m["rollout/completion_len_mean"] > 0 and math.isfinite(m["train/loss"]) for m in steps)
    assert steps[0]["train/mismatch_kl"] < 1e-3


@pytest.mark.slow
def test_routing_replay_trains_an_moe_on_the_experts_vllm_chose(tmp_path):
    """configs/toy.yaml with the tiny Qwen3-MoE and trainer.routing_replay: vLLM (GPU only: the CPU build
    records no experts) returns every token's experts through /prl/generate, and the trainer routes all
    positions but each sample's last token as vLLM did; at step 0 (equal weights) the logprobs agree to bf16."""
    overrides = [f"run.output_dir={tmp_path}", "run.wandb.mode=disabled", f"model.name={tiny_model_dir('qwen3_moe')}",
                 "model.dtype=bfloat16", "inference.port=18749", "trainer.routing_replay=true", *TOOL_RUN]
    steps = local_run("toy", tmp_path, overrides)
    print("\nGPU routing replay, per step (replayed share, mismatch KL, compiled frames): "
          + "; ".join(f"{m['train/routing_replayed']:.3f} {m['train/mismatch_kl']:.1e} {m.get('perf/compiled_frames', 0):.0f}"
                      for m in steps))
    assert [m["step"] for m in steps] == [0, 1, 2]
    assert all(0.9 < m["train/routing_replayed"] < 1 for m in steps)  # every position but each sample's last
    assert steps[0]["train/mismatch_kl"] < 1e-3 and all(math.isfinite(m["train/loss"]) for m in steps)
