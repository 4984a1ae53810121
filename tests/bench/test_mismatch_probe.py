"""benchmarks/mismatch_probe.py on the tiny Qwen3-MoE: a batch whose behaviour logprobs are the model's
own float32 logprobs (benchmarks/loss_options.py's make_samples), as if vLLM had sampled it in float32.

    pytest -m bench tests/bench/test_mismatch_probe.py    # the probe's test about 20 s on 2 cores with the tiny MoE's build: not in CI
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from loss_options import make_samples  # noqa: E402
from mismatch_probe import probe, table  # noqa: E402

from prl.run.batch import Batch, write_batch  # noqa: E402
from prl.run.packing import pack_batch  # noqa: E402
from prl.run.rundir import RunDir  # noqa: E402


def write_version_0_batches(run: Path, model: Path) -> int:
    """Batch 0 sampled by version 0, batch 1 by version 1 (not read); batch 0's loss tokens."""
    samples = make_samples(model, n=32)
    for step in (0, 1):
        write_batch(RunDir(run), Batch(step=step, policy_version=step, micro_batches=pack_batch(samples, 1, 8), metrics={}))
    return sum(sum(s.loss_mask) for s in samples)


@pytest.mark.slow  # CI's 25 minutes are spent
def test_the_probe_finds_no_mismatch_in_float32_and_the_routing_flips_of_bfloat16(tiny_moe_model, tmp_path):
    """float32: the trainer's forward is the "sampler's" to rounding. bfloat16: a few loss tokens are
    predicted from positions routed to other experts than float32's, and those carry more of the
    mismatch than the others (docs/moe.md: on CPU, vLLM float32 against a bfloat16 forward, 2.2 % of
    the tokens and 90x the mismatch KL)."""
    tokens = write_version_0_batches(tmp_path, tiny_moe_model)
    results = probe(tmp_path, tiny_moe_model, ["float32", "bfloat16"], torch.device("cpu"))
    f32, bf16, routing = results["float32"], results["bfloat16"], results["routing"]
    assert f32["tokens"] == bf16["tokens"] == tokens
    assert f32["mismatch_kl"] < 1e-9 and f32["max_abs_log_ratio"] < 1e-4, f32
    assert bf16["mismatch_kl"] > 100 * f32["mismatch_kl"] and bf16["out of [0.5, 5.0]"] == 0, bf16
    assert 0 < routing["flipped"] < 0.2 and routing["kl_flipped"] > routing["kl_same"], routing
    assert "routed to other experts" in table(results)


def test_a_run_without_a_version_0_batch_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no batch sampled by policy version 0"):
        probe(tmp_path, tmp_path, ["float32"], torch.device("cpu"))
