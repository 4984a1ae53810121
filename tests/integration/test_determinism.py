"""Batch n is a function of (config, seed, n, weights): the orchestrator against one real vLLM server
(CPU build, tiny model), run twice with different request concurrency, must write the same batches.

    pytest -m vllm tests/integration/test_determinism.py -s      # ~2 minutes on 2 cores, most of it server start

The server is the session's one CPU server (conftest.cpu_server), started with a token budget of 512
per engine step and blocks of 32 tokens for this test. max_concurrent 64 vs 8 changes which requests
share a forward pass, and the small token budget splits every batch's prefills over many
differently composed engine steps. What makes the batches
equal: a vLLM per-request seed for every request (so sampling does not depend on arrival order),
groups and rollouts kept in input order, and vLLM's CPU kernels computing a request's logits the
same whatever else is in the batch (measured: bitwise, also in bfloat16, on this model and on a
896-wide one). Prefix caching stays on: the second run reads the prompts' KV from the first run's
cache (block size 32, so the ~70-token prompts fill blocks), which is what a resumed run's server
does not have, and the batches are still bitwise equal.

Chunked prefill must be off on CPU for seeded requests: in vLLM 0.32 a step that prefills only part of
a seeded request's prompt rewinds that request's generator with `Generator.set_offset`, which CPU
generators do not support; the engine dies ("CPU Generator does not use offset"). Whether a prompt
is split depends on how many requests arrive together, so without the flag this is a crash that
waits for a busy moment. The budget of 512 tokens here would split prompts on every batch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from inference_helpers import API_KEY

from prl.run.batch import Batch, read_batch
from prl.run.rundir import RunDir

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
BATCH, GROUP, MAX_TOKENS, STEPS = 32, 4, 16, 2
EXACT = ("input_ids", "position_ids", "loss_mask", "advantages", "behaviour_logprobs")


def write_config(path: Path, tiny_model: Path, max_concurrent: int) -> Path:
    path.write_text(
        f"run: {{name: run, output_dir: '{path.parent}', seed: 3, max_steps: {STEPS}, async_level: {STEPS}}}\n"
        f"model: {{name: '{tiny_model}', dtype: float32, max_model_len: 512}}\n"
        "inference: {gpus_per_node: 0, enforce_eager: true, api_key_env: PRL_TEST_API_KEY}\n"
        "trainer: {nodes: 2, gpus_per_node: 0, micro_batch_size: 4}\n"
        "orchestrator:\n"
        "  environment: {id: prl.envs.reverse_text, args: {num_examples: 40}}\n"
        f"  batch_size: {BATCH}\n  rollouts_per_example: {GROUP}\n  max_concurrent: {max_concurrent}\n"
        f"  sampling: {{max_tokens: {MAX_TOKENS}}}\n"
    )
    return path


@pytest.fixture
def server(vllm_server):
    return vllm_server


def generate(server, tiny_model: Path, work: Path, max_concurrent: int) -> list[Batch]:
    """`python jobs/orchestrator.py` for batches 0..STEPS-1 into a fresh run directory; the batches."""
    work.mkdir()
    config = write_config(work / "config.yaml", tiny_model, max_concurrent)
    env = {**os.environ, "PRL_INFERENCE_URLS": f"{server.url}/v1", "PRL_LOG_DIR": str(work / "logs"),
           "PRL_TEST_API_KEY": API_KEY}
    env.pop("PRL_RUN_DIR", None)
    argv = [sys.executable, str(REPO / "jobs" / "orchestrator.py"), str(config)]
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return [read_batch(RunDir(work / "run"), n) for n in range(STEPS)]


def prefix_cache_hits(server) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))


def completions(batch: Batch) -> list[tuple[int, ...]]:
    return [tuple(mb["input_ids"][0][mb["loss_mask"][0]].tolist()) for rank in batch.micro_batches for mb in rank]


def test_batches_do_not_depend_on_request_concurrency(server, tiny_model, tmp_path):
    wide = generate(server, tiny_model, tmp_path / "concurrent_64", max_concurrent=64)
    hits_before = prefix_cache_hits(server)
    narrow = generate(server, tiny_model, tmp_path / "concurrent_8", max_concurrent=8)
    assert prefix_cache_hits(server) > hits_before  # the second run really read cached prompt KV

    max_diff = 0.0
    for step, (a, b) in enumerate(zip(wide, narrow)):
        assert a.metrics["samples"] == BATCH
        assert len(set(completions(a))) > 1  # per-rollout seeds: a group's rollouts differ
        assert [len(rank) for rank in a.micro_batches] == [len(rank) for rank in b.micro_batches]
        for mb_a, mb_b in zip(sum(a.micro_batches, []), sum(b.micro_batches, [])):
            for key in EXACT:
                assert torch.equal(mb_a[key], mb_b[key]), f"batch {step}: {key} differs"
            max_diff = max(max_diff, (mb_a["behaviour_logprobs"] - mb_b["behaviour_logprobs"]).abs().max().item())
        assert a.metrics["reward_mean"] == b.metrics["reward_mean"]
        name = f"run/rollouts/step_{step}.completions.jsonl"  # and what the model wrote, byte for byte
        assert (tmp_path / "concurrent_64" / name).read_bytes() == (tmp_path / "concurrent_8" / name).read_bytes()
    # behaviour_logprobs are in EXACT: vLLM CPU computes them bitwise alike (no tolerance needed).
    print(f"\nmax |behaviour_logprobs difference| over {STEPS} batches (concurrency 64 vs 8): {max_diff:g}")
