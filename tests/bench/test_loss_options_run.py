"""Each `trainer.loss` option in a short real run: `torchrun jobs/trainer.py` (gloo, CPU) on the tiny
model, three steps on the same on-policy batch (benchmarks/loss_options.py, which prints the figures).

Step 0 is exactly on-policy (every ratio 1), so its loss is known from the batch alone; the later
steps, n updates away from the sampling policy, show what each option does with drifting ratios.

    pytest -m bench tests/bench/test_loss_options_run.py    # about a minute on 2 cores (not in CI)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from loss_options import make_samples, run_options  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.bench]  # four trainer launches, about a minute on 2 cores

STEPS = 3


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    return run_options(tiny_model, tmp_path_factory.mktemp("loss_options"), ["clip", "dppo+kl1e-3", "custom", "clip+band0.5-2"],
                       STEPS, 3e-3)


@pytest.fixture(scope="module")
def batch(tiny_model):
    samples = make_samples(tiny_model)
    tokens = [(s.advantage, lp) for s in samples for lp, m in zip(s.logprobs, s.loss_mask) if m]
    return {"advantage": sum(a for a, _ in tokens) / len(tokens), "reinforce": -sum(a * lp for a, lp in tokens) / len(tokens)}


def test_step_0_is_on_policy_and_its_loss_is_known(runs, batch):
    assert batch["advantage"] == pytest.approx(-1 / 16)  # advantages -1, 0, 1: six -1, five 0, five 1
    for name, result in runs.items():
        first = result["metrics"][0]
        assert first["train/mismatch_kl"] < 1e-6, name  # the trainer's logprobs are the sampler's
        want = batch["reinforce"] if name == "custom" else -batch["advantage"]  # -mean(A * ratio), ratio 1
        assert first["train/loss"] == pytest.approx(want, rel=1e-4), name
    assert runs["clip"]["metrics"][0]["train/clip_fraction"] == 0
    assert runs["dppo+kl1e-3"]["metrics"][0]["train/masked_fraction"] == 0
    assert runs["dppo+kl1e-3"]["metrics"][0]["train/kl_term"] < 1e-9
    assert runs["custom"]["metrics"][0]["train/custom/advantage"] == pytest.approx(batch["advantage"], rel=1e-6)


def test_what_each_option_does_with_drifting_ratios(runs):
    clip, dppo, custom = (runs[name]["metrics"] for name in ("clip", "dppo+kl1e-3", "custom"))
    # The clip takes most tokens out of the gradient once the policy has moved (lr 3e-3): the loss stalls.
    assert clip[1]["train/clip_fraction"] > 0.5 and clip[2]["train/clip_fraction"] >= clip[1]["train/clip_fraction"]
    # DPPO measures probabilities: the tiny random model's are ~1/768, far from moving by 0.2, so
    # nothing is masked and the surrogate keeps falling; the KL term grows with the drift.
    assert all(m["train/masked_fraction"] == 0 for m in dppo)
    assert dppo[2]["train/loss"] < clip[2]["train/loss"]
    assert 0 < dppo[1]["train/kl_term"] < dppo[2]["train/kl_term"]
    assert {"train/clip_fraction", "train/masked_fraction", "train/kl_term"}.isdisjoint(custom[0])
    assert runs["dppo+kl1e-3"]["vs_clip"] > 0 and runs["custom"]["vs_clip"] > 0  # different weights at the end
    assert all(r["weight_change"] > 0 for r in runs.values())


def test_the_ratio_band_masks_what_drifted_out_of_it_which_the_clip_already_held_here(runs):
    """The same batch again and again: step 0 has every ratio at 1 (nothing out of [0.5, 2]); as the
    policy drifts, ratios leave the band, each in the direction its advantage pushes it (up for A > 0,
    down for A < 0), which is where the clip holds them already. So the band masks a subset of the
    clipped tokens, drops their clipped constant from the loss (a different loss value) and leaves
    the gradient, hence the final weights, exactly the clip's. Tokens it would change are those that
    moved against their advantage: a sampler's numerics or routing (docs/moe.md), not this drift."""
    band, clip = runs["clip+band0.5-2"]["metrics"], runs["clip"]["metrics"]
    fractions = [m["train/ratio_masked_fraction"] for m in band]
    assert fractions[0] == 0 and 0 < fractions[1] < fractions[2] < 1, fractions
    assert all(b["train/ratio_masked_fraction"] <= c["train/clip_fraction"] for b, c in zip(band, clip))
    assert band[0]["train/loss"] == pytest.approx(clip[0]["train/loss"], rel=1e-6)  # nothing masked yet
    assert band[1]["train/loss"] != pytest.approx(clip[1]["train/loss"], rel=1e-3)
    assert "train/ratio_masked_fraction" not in clip[0]
    assert runs["clip+band0.5-2"]["vs_clip"] == 0
