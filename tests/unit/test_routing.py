"""The routing statistics of prl.trainer.routing on hand-made router logits, the config key of the
load-balancing loss, and the routing in `prl status` and `prl plot`.

    pytest tests/unit/test_routing.py
"""

import json
import math

import pytest
import torch
from helpers import fake_run, prl

from prl.config import TrainerConfig
from prl.config.validate import ConfigError
from prl.trainer.routing import Tally, layer_sums, metrics_of


def onehot_logits(experts: list[int], n_experts: int = 4, high: float = 30.0) -> torch.Tensor:
    """One token per entry, its router all but certain of that expert."""
    logits = torch.zeros(len(experts), n_experts)
    logits[torch.arange(len(experts)), torch.tensor(experts)] = high
    return logits


def test_balanced_layer_has_ratio_one_and_peaked_router_no_entropy():
    m = metrics_of(layer_sums([onehot_logits([0, 1, 2, 3] * 2)], top_k=1))
    assert m["routing/load_max_over_mean/layer_0"] == pytest.approx(1.0)
    assert m["routing/entropy/layer_0"] == pytest.approx(0.0, abs=1e-6)


def test_collapsed_layer_has_ratio_experts_over_top_k_and_uniform_router_log_experts():
    collapsed = onehot_logits([2] * 6)
    uniform = torch.zeros(6, 4)  # top-1 of a tie: torch picks one expert for every token
    m = metrics_of(layer_sums([collapsed, uniform], top_k=1))
    assert m["routing/load_max_over_mean/layer_0"] == pytest.approx(4.0)
    assert m["routing/entropy/layer_1"] == pytest.approx(math.log(4))
    assert m["routing/load_max_over_mean"] == pytest.approx(4.0)  # the worst layer
    assert m["routing/entropy"] == pytest.approx(math.log(4) / 2)  # the mean over layers


def test_top_k_picks_count_each_and_shares_add_over_micro_batches():
    # top-2 over 4 experts: tokens pick {0, 1} three times, {2, 3} once -> shares .375 .375 .125 .125
    first = torch.tensor([[5.0, 4.0, 0.0, 0.0]] * 2)
    second = torch.tensor([[5.0, 4.0, 0.0, 0.0], [0.0, 0.0, 5.0, 4.0]])
    sums = layer_sums([first], top_k=2) + layer_sums([second], top_k=2)
    assert sums[0, :4].tolist() == [3, 3, 1, 1] and sums[0, -1].item() == 4
    assert metrics_of(sums)["routing/load_max_over_mean/layer_0"] == pytest.approx(0.375 * 4)


def test_tally_reports_a_token_weighted_aux_loss_and_keeps_its_graph():
    class FakeMoe(torch.nn.Module):  # the attributes transformers' MoE causal LMs carry
        num_experts, num_experts_per_tok = 4, 2

    # load_balancing_loss_func is looked up in the model's module: this one's (below)
    tally = Tally.of(FakeMoe())
    logits = torch.randn(5, 4, requires_grad=True)
    tally.add(FakeMoe(), [logits])
    assert tally.aux_loss.requires_grad
    m = tally.metrics()
    assert m["train/router_aux_loss"] == pytest.approx(tally.aux_loss.item())
    assert Tally.of(torch.nn.Linear(2, 2)) is None  # dense: no tally


def load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask):
    """A stand-in with transformers' signature: the mean squared router probability, times experts."""
    probs = torch.softmax(torch.cat(gate_logits), dim=-1)
    return (probs ** 2).mean() * num_experts


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf")])
def test_router_aux_loss_coef_must_be_finite_and_not_negative(value):
    with pytest.raises(ConfigError, match="trainer.router_aux_loss_coef"):
        TrainerConfig(router_aux_loss_coef=value)


def routed_run(tmp_path):
    """fake_run whose steps also carry an MoE's routing metrics: load 1.5 then 3.0, entropy 1.2."""
    rd = fake_run(tmp_path, steps=4, attempts=1)
    path = rd.logs / "attempt_0/trainer/metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r | {"routing/load_max_over_mean": 1.5 if r["step"] < 3 else 3.0,
                                            "routing/entropy": 1.2}) + "\n" for r in records))
    return rd


def test_status_shows_the_routing_of_an_moe_run(tmp_path):
    r = prl("status", str(routed_run(tmp_path).path))
    assert r.returncode == 0, r.stderr
    line = next(line for line in r.stdout.splitlines() if line.startswith("routing:"))
    assert "max/mean (worst layer) last 3.00" in line and "router entropy last 1.200" in line, line
    assert "routing:" not in prl("status", str(fake_run(tmp_path / "dense").path)).stdout


def test_plot_adds_the_routing_panels_for_an_moe_run(tmp_path):
    mpl = pytest.importorskip("matplotlib")
    mpl.use("Agg")
    import matplotlib.image

    rd = routed_run(tmp_path)
    assert prl("plot", str(rd.path)).returncode == 0
    dense = fake_run(tmp_path / "dense", steps=4, attempts=1)
    assert prl("plot", str(dense.path)).returncode == 0
    tall, short = (matplotlib.image.imread(d.path / "metrics.png").shape[0] for d in (rd, dense))
    assert tall > short * 1.3  # a third row of panels
