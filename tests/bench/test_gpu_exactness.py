"""benchmarks/gpu_exactness.py: its pure pieces, and one CPU run of all three parts on the tiny model.

    pytest tests/bench/test_gpu_exactness.py                      # the pieces, a second
    pytest -m bench tests/bench/test_gpu_exactness.py    # with the CPU run, ~2 minutes on 2 cores (not in CI)
"""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from gpu_exactness_trainer import tensor_diff, token_groups  # noqa: E402
from gpu_exactness_vllm import compare, engine_kwargs, interleave, prl_config  # noqa: E402

from prl.inference.server import vllm_args  # noqa: E402


def options(tmp_path: Path, **overrides) -> Namespace:
    return Namespace(**{"work": tmp_path, "model": tmp_path / "my model", "prompt_len": "16,64", "max_tokens": 32,
                        "gpu_memory_utilization": 0.5, "enforce_eager": False, "vllm_extra": "", **overrides})


def test_engine_options_are_the_servers_without_its_http_flags(tmp_path):
    cpu = engine_kwargs(vllm_args(prl_config(options(tmp_path, enforce_eager=True), cuda=False)))
    assert cpu == {"model": str(tmp_path / "my model"), "dtype": "float32", "max_model_len": 96,
                   "tensor_parallel_size": 1, "gpu_memory_utilization": 0.5, "seed": 0, "generation_config": "vllm",
                   "logprobs_mode": "processed_logprobs", "enforce_eager": True, "enable_chunked_prefill": False}
    extra = options(tmp_path, vllm_extra="--attention-backend TRITON_ATTN")
    gpu = engine_kwargs(vllm_args(prl_config(extra, cuda=True)))
    assert gpu["dtype"] == "bfloat16" and gpu["attention_backend"] == "TRITON_ATTN"
    assert "enable_chunked_prefill" not in gpu and "enforce_eager" not in gpu


def test_probes_land_where_interleave_says():
    batch, where = interleave(["a", "b", "c"], list(range(7)))
    assert [batch[i] for i in where] == ["a", "b", "c"] and len(batch) == 10
    assert sorted(x for x in batch if isinstance(x, int)) == list(range(7))


def test_compare_finds_the_first_divergence_and_compares_logprobs_before_it():
    def out(ids, lps):
        return {"token_ids": ids, "logprobs": lps}

    xs = [out([1, 2, 3], [-1.0, -2.0, -3.0]), out([1, 2, 3], [-1.0, -2.0, -3.0]), None]
    ys = [out([1, 2, 3], [-1.0, -2.0, -3.0]), out([1, 5, 6], [-1.5, -9.0, -9.0]), out([7], [-1.0])]
    row = compare(xs, ys)
    assert row["requests"] == 2 and row["identical"] == 1
    assert row["first_divergence"]["all"] == [1]
    assert row["prefix_tokens"] == 4 and row["max_abs_logprob_diff"] == 0.5 and row["logprobs_bitwise_equal"] == 0.75


def test_tensor_diff_relative_to_the_update():
    base = [torch.zeros(4)]
    a, b = [torch.tensor([1.0, 0, 0, 0])], [torch.tensor([1.0, 0, 0, 0.5])]
    assert tensor_diff(a, a, base)["equal"]
    d = tensor_diff(a, b, base)
    assert not d["equal"] and d["max_abs"] == 0.5 and d["differing"] == 0.25 and d["rel"] == pytest.approx(0.5)


def test_token_groups_keep_order_and_budget():
    seqs = [{"prompt_ids": [0] * p, "token_ids": [0] * 2} for p in (3, 3, 10, 1)]
    assert [[len(s["prompt_ids"]) for s in g] for g in token_groups(seqs, 10)] == [[3, 3], [10], [1]]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.bench
def test_cpu_run_of_all_parts(tiny_model, tmp_path):
    """On CPU everything is bitwise: vLLM's batches and reruns, the trainer's reruns; layouts are not."""
    out = tmp_path / "exactness.json"
    argv = [sys.executable, str(BENCH / "gpu_exactness.py"), "--model", str(tiny_model), "--quick", "--enforce-eager",
            "--work", str(tmp_path / "work"), "--json", str(out)]
    subprocess.run(argv, check=True, timeout=600)
    parts = json.loads(out.read_text())["parts"]
    assert parts["vllm"]["status"] == "ok" and parts["trainer"]["status"] == "ok"
    rows = parts["vllm"]["comparisons"]
    assert len(rows) == 11 and all(row["identical"] == row["requests"] > 0 for row in rows.values())
    gap = parts["trainer"]["gap"]
    assert gap["sequences"] == gap["of"] == 8 + 56 and gap["max_abs"] < 1e-5  # float32 on both sides
    trainer = parts["trainer"]["trainer"]["comparisons"]
    for name in ("default kernels: run A vs run B", "deterministic kernels: run A vs run B"):
        assert trainer[name]["losses_equal"] and trainer[name]["weights"]["equal"], name
    layout = trainer["deterministic kernels: layout 1x8 vs 2x4"]
    assert not layout["grads"]["equal"] and layout["grads"]["rel"] < 1e-4
