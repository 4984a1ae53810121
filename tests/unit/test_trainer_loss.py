"""The RL objective: chunked logprobs against the naive computation; each loss option (clip, DPPO mask,
KL term, custom) on hand-made tensors with known answers; masking, normalisation."""

import math

import pytest
import torch

from prl.config import ConfigError, LossConfig
from prl.trainer.loss import LossInputs, PolicyLoss, build_loss, chunked_logprobs


def naive_logprobs(hidden, weight, targets, temperature):
    logp = torch.log_softmax((hidden @ weight.t()).double() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), entropy


@pytest.mark.parametrize("keep_logits", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
def test_chunked_logprobs_match_naive_values_and_gradients(chunk_size, keep_logits):
    gen = torch.Generator().manual_seed(0)
    n, h, v, temperature = 7, 16, 50, 0.7
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen, dtype=torch.float64)

    logp, entropy = chunked_logprobs(hidden, weight, targets, temperature, chunk_size, keep_logits=keep_logits)
    (logp.double() * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_logp, ref_entropy = naive_logprobs(hidden, weight, targets, temperature)
    (ref_logp * upstream).sum().backward()

    torch.testing.assert_close(logp.double(), ref_logp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-5, atol=1e-6)


def test_fp32_logprobs_and_entropy_match_float64_from_a_flat_row_to_one_that_takes_almost_all_the_mass():
    # Logits at the scale of a trained LM head (a top logit of 40, a 30,000 vocabulary): the entropy
    # from that of a flat row (about 9.8 nats) to under 1e-11, taken in fp32 against float64.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 30_000, generator=gen, dtype=torch.float64)
    logits -= torch.tensor([0.0, 30.0, 33.0, 36.0, 39.0, 42.0], dtype=torch.float64)[:, None] - 40.0
    logits[torch.arange(1, 6), torch.arange(1, 6)] = 40.0
    targets = torch.tensor([0, 1, 9, 3, 4, 5])
    eye = torch.eye(6, dtype=torch.float64)  # hidden @ weight.T = the logits
    logp, entropy = chunked_logprobs(eye.float(), logits.T.float().contiguous(), targets)
    ref_logp, ref_entropy = naive_logprobs(eye, logits.T.contiguous(), targets, 1.0)
    assert ref_entropy.min() < 1e-11 and ref_entropy.max() > 9
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=2e-7)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-6, atol=1e-6)


def test_kept_logits_give_the_recomputed_gradients_bit_for_bit():
    """Keeping the forward's logits skips one LM-head GEMM in the backward; nothing else changes."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 16, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=gen)
    upstream = torch.randn(37, generator=gen)
    results = []
    for keep in (False, True):
        logp, entropy = chunked_logprobs(hidden, weight, targets, 0.7, 8, keep_logits=keep)
        (logp * upstream).sum().backward(retain_graph=True)
        results.append((logp.detach(), entropy, hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
        if keep:  # a second backward over the same graph recomputes (the kept chunks are gone)
            (logp * upstream).sum().backward()
            assert torch.equal(hidden.grad, results[0][2]) and torch.equal(weight.grad, results[0][3])
    for recomputed, kept in zip(*results):
        assert torch.equal(kept, recomputed)


def test_chunked_logprobs_gradcheck():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 9, (5,), generator=gen)
    # The forward returns fp32 by design; gradcheck needs float64 end to end, so compare analytic
    # gradients to central differences of the fp32 outputs at a loose tolerance instead.
    fn = lambda hh, ww: chunked_logprobs(hh, ww, targets, 1.3, 2)[0].double()  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden, weight), eps=1e-3, atol=1e-3, rtol=1e-3)


def micro_batch(behaviour_logprobs, advantages, loss_mask):
    as_row = lambda x, dtype: torch.tensor(x, dtype=dtype)[None]  # noqa: E731
    return {
        "behaviour_logprobs": as_row(behaviour_logprobs, torch.float32),
        "advantages": as_row(advantages, torch.float32),
        "loss_mask": as_row(loss_mask, torch.bool),
        "position_ids": torch.arange(len(loss_mask))[None],
    }


def clip(clip_low=0.2, clip_high=0.2, **kw):
    return PolicyLoss(LossConfig(clip_low=clip_low, clip_high=clip_high, **kw))


def test_ratio_is_clipped_in_the_direction_the_advantage_pushes():
    # ratios exp(logp - inf) = [2.0, 0.5, 2.0, 0.5, 1.1]
    ratios = torch.tensor([2.0, 0.5, 2.0, 0.5, 1.1])
    inf = [-1.0] * 5
    logp = (torch.log(ratios) - 1.0)[None].requires_grad_()
    adv = [1.0, -1.0, -1.0, 1.0, 1.0]
    mb = micro_batch(inf, adv, [True] * 5)
    loss_fn = clip(clip_low=0.2, clip_high=0.28)
    loss, stats = loss_fn(logp, torch.zeros(1, 5), mb, 5)
    loss.backward()
    # token 0: A>0, r>1.28 -> clipped to 1.28, no gradient; token 1: A<0, r<0.8 -> clipped to 0.8, no grad;
    # tokens 2, 3: the pessimistic min keeps the unclipped ratio (gradient flows); token 4 inside the region.
    expected = -(1.28 * 1 + 0.8 * -1 + 2.0 * -1 + 0.5 * 1 + 1.1 * 1) / 5
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    grad = logp.grad[0]
    assert grad[0] == 0 and grad[1] == 0
    # d/dlogp of -r*A/5 = -r*A/5
    torch.testing.assert_close(grad[2:], -ratios[2:] * torch.tensor(adv[2:]) / 5)
    metrics = loss_fn.metrics(stats)
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)
    assert metrics["loss_tokens"] == 5


def test_masked_tokens_contribute_nothing():
    logp = torch.tensor([[0.0, -50.0, -1.0, 30.0]], requires_grad=True)  # junk where the mask is False
    mb = micro_batch([0.0, 0.0, -1.0, 0.0], [5.0, 5.0, 1.0, 5.0], [False, False, True, False])
    loss_fn = clip()
    loss, stats = loss_fn(logp, torch.full((1, 4), 3.0), mb, 1)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    assert logp.grad[0].tolist() == [0.0, 0.0, -1.0, 0.0]
    metrics = loss_fn.metrics(stats)
    assert metrics["entropy"] == pytest.approx(3.0)
    assert metrics["mismatch_kl"] == pytest.approx(0.0)


def test_accumulated_micro_batches_equal_one_big_batch():
    """Dividing by the step's loss-token count makes gradient accumulation exact (unequal micro-batches)."""
    gen = torch.Generator().manual_seed(2)
    logits_param = torch.randn(10, generator=gen, requires_grad=True)
    inf = torch.randn(10, generator=gen) - 2
    adv = torch.randn(10, generator=gen)
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 0, 1, 1, 1], dtype=torch.bool)

    loss_fn = clip(clip_low=0.2, clip_high=0.3)

    def run(splits):
        logits_param.grad = None
        total, stats = 0.0, 0.0
        for a, b in splits:
            mb = micro_batch(inf[a:b].tolist(), adv[a:b].tolist(), mask[a:b].tolist())
            loss, s = loss_fn(logits_param[a:b][None] - 1, torch.zeros(1, b - a), mb, int(mask.sum()))
            loss.backward()
            total += loss.item()
            stats = stats + s
        return total, logits_param.grad.clone(), loss_fn.metrics(stats)

    whole = run([(0, 10)])
    parts = run([(0, 3), (3, 4), (4, 10)])
    assert parts[0] == pytest.approx(whole[0], rel=1e-6)
    torch.testing.assert_close(parts[1], whole[1])
    assert parts[2]["loss"] == pytest.approx(whole[0], rel=1e-6)


def test_mismatch_kl_is_the_k3_estimator():
    logp = torch.tensor([[math.log(0.5)]])
    mb = micro_batch([math.log(0.25)], [0.0], [True])
    loss_fn = clip()
    _, stats = loss_fn(logp, torch.zeros(1, 1), mb, 1)
    r = 2.0
    assert loss_fn.metrics(stats)["mismatch_kl"] == pytest.approx(r - math.log(r) - 1)


def test_no_loss_tokens_gives_zero_loss_not_nan():
    mb = micro_batch([0.0, 0.0], [1.0, 1.0], [False, False])
    for cfg in (LossConfig(), LossConfig(type="dppo", kl_tau=1e-3)):
        loss_fn = PolicyLoss(cfg)
        loss, stats = loss_fn(torch.zeros(1, 2, requires_grad=True), torch.zeros(1, 2), mb, 0)
        assert loss.item() == 0.0
        assert loss_fn.metrics(stats)["loss_tokens"] == 0


def logp_of(probs):
    return torch.log(torch.tensor(probs))[None]


def test_dppo_masks_tokens_whose_probability_left_the_trust_region_in_the_advantages_direction():
    p_inf = [0.1, 0.5, 0.1, 0.5, 0.01]
    p = [0.5, 0.1, 0.5, 0.1, 0.1]
    adv = [1.0, -1.0, -1.0, 1.0, 1.0]
    # token 0: A>0, p up by 0.4 > 0.2: masked; token 1: A<0, p down by 0.4: masked; token 2: up, but A<0
    # pushes it down: kept; token 3: down, A>0: kept; token 4: ratio 10 (the clip would drop it), yet
    # p moved by only 0.09: kept.
    logp = logp_of(p).requires_grad_()
    loss_fn = PolicyLoss(LossConfig(type="dppo", dppo_mask_low=0.2, dppo_mask_high=0.2))
    loss, stats = loss_fn(logp, torch.zeros(1, 5), micro_batch(logp_of(p_inf)[0].tolist(), adv, [True] * 5), 5)
    loss.backward()
    ratios = [5.0, 0.2, 5.0, 0.2, 10.0]
    assert loss.item() == pytest.approx(-(0 + 0 + 5.0 * -1 + 0.2 * 1 + 10.0 * 1) / 5, rel=1e-5)
    want = [0.0, 0.0] + [-r * a / 5 for r, a in zip(ratios[2:], adv[2:])]
    torch.testing.assert_close(logp.grad[0], torch.tensor(want))
    metrics = loss_fn.metrics(stats)
    assert metrics["masked_fraction"] == pytest.approx(2 / 5)
    assert "clip_fraction" not in metrics and "kl_term" not in metrics

    # The same tokens under the clip: 0 and 1 are clipped, and so is 4, which DPPO keeps.
    clip_fn = clip(clip_low=0.2, clip_high=0.28)
    _, clip_stats = clip_fn(logp.detach(), torch.zeros(1, 5), micro_batch(logp_of(p_inf)[0].tolist(), adv, [True] * 5), 5)
    assert clip_fn.metrics(clip_stats)["clip_fraction"] == pytest.approx(3 / 5)


@pytest.mark.parametrize("edge,masked", [(0.2 - 1e-4, False), (0.2 + 1e-4, True)])
def test_dppo_threshold_is_exclusive(edge, masked):
    logp = logp_of([0.3 + edge])
    loss_fn = PolicyLoss(LossConfig(type="dppo"))
    _, stats = loss_fn(logp, torch.zeros(1, 1), micro_batch([math.log(0.3)], [1.0], [True]), 1)
    assert loss_fn.metrics(stats)["masked_fraction"] == float(masked)


@pytest.mark.parametrize("loss_type", ["clip", "dppo"])
def test_kl_term_adds_tau_log_ratio_squared_on_every_loss_token(loss_type):
    # ratio 2 with A = 1: out of the trust region for both losses (no policy gradient), yet the KL
    # term pulls it back: gradient 2 tau log r. The prompt token (mask False) contributes nothing.
    tau, r = 0.1, 2.0
    logp = torch.tensor([[0.0, math.log(0.8)]], requires_grad=True)
    loss_fn = PolicyLoss(LossConfig(type=loss_type, clip_high=0.28, dppo_mask_high=0.2, kl_tau=tau))
    loss, stats = loss_fn(logp, torch.zeros(1, 2), micro_batch([0.0, math.log(0.4)], [0.0, 1.0], [False, True]), 1)
    loss.backward()
    pg = -1.28 if loss_type == "clip" else 0.0  # the clip keeps the constant 1.28 * A; DPPO drops the token
    assert loss.item() == pytest.approx(pg + tau * math.log(r) ** 2, rel=1e-5)
    torch.testing.assert_close(logp.grad[0], torch.tensor([0.0, 2 * tau * math.log(r)]))
    metrics = loss_fn.metrics(stats)
    assert metrics["kl_term"] == pytest.approx(tau * math.log(r) ** 2, rel=1e-5)
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_custom_loss_is_loaded_by_import_path_and_reports_its_stats():
    loss_fn = build_loss(LossConfig(type="custom", custom="custom_loss:reinforce", custom_args={"scale": 2.0}))
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    mb = micro_batch([0.0, -1.5, -1.5], [0.0, 0.5, -1.0], [False, True, True])
    loss, stats = loss_fn(logp, torch.zeros(1, 3), mb, 4)  # 4: the step's loss tokens, other micro-batches too
    loss.backward()
    assert loss.item() == pytest.approx(-2.0 * (0.5 * -1.0 + -1.0 * -2.0) / 4)
    torch.testing.assert_close(logp.grad[0], torch.tensor([0.0, -2.0 * 0.5 / 4, -2.0 * -1.0 / 4]))
    metrics = loss_fn.metrics(stats)
    assert metrics["custom/advantage"] == pytest.approx(-0.5 / 2) and metrics["custom/logprob"] == pytest.approx(-1.5)
    assert loss_fn.stats == ("loss", "entropy", "mismatch_kl", "custom/advantage", "custom/logprob", "tokens")
    # The dotted form names the same function.
    assert build_loss(LossConfig(type="custom", custom="custom_loss.reinforce")).custom is loss_fn.custom


def test_custom_loss_whose_stat_names_change_is_refused():
    calls = []

    def fickle(inputs):
        calls.append(1)
        return (inputs.logprobs * inputs.loss_mask).sum(), {f"s{len(calls)}": inputs.logprobs.sum()}

    loss_fn = PolicyLoss(LossConfig(type="custom", custom="x:y"), custom=fickle)
    mb = micro_batch([0.0], [1.0], [True])
    loss_fn(torch.zeros(1, 1), torch.zeros(1, 1), mb, 1)
    with pytest.raises(ValueError, match="the names must not change"):
        loss_fn(torch.zeros(1, 1), torch.zeros(1, 1), mb, 1)


def test_custom_loss_inputs_are_flat_rows():
    seen = {}

    def spy(inputs: LossInputs):
        seen.update(vars(inputs))
        return inputs.logprobs.sum() * 0, {}

    PolicyLoss(LossConfig(type="custom", custom="x:y"), custom=spy)(torch.zeros(1, 3), torch.ones(1, 3), micro_batch([0.0] * 3, [1.0] * 3, [True] * 3), 3)
    assert {k: tuple(v.shape) for k, v in seen.items()} == {k: (3,) for k in seen}
    assert seen["loss_mask"].dtype == torch.bool


@pytest.mark.parametrize("path,message", [
    ("custom_loss:nope", "trainer.loss.custom: custom_loss has no function nope"),
    ("no_such_module_prl:f", "trainer.loss.custom: cannot import no_such_module_prl: ModuleNotFoundError"),
])
def test_custom_loss_that_cannot_be_loaded_fails_at_trainer_start_naming_the_key(path, message):
    with pytest.raises(ConfigError) as e:
        build_loss(LossConfig(type="custom", custom=path))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_custom_loss_module_that_raises_on_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_loss_prl.py").write_text("raise RuntimeError('no GPU here\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^trainer\.loss\.custom: cannot import broken_loss_prl: RuntimeError: no GPU here$"):
        build_loss(LossConfig(type="custom", custom="broken_loss_prl:f"))


@pytest.mark.parametrize("loss_type", ["clip", "dppo"])
def test_ratio_band_drops_the_policy_gradient_of_tokens_outside_it_whatever_the_advantage(loss_type):
    """trainer.loss.ratio_mask_low/high (IcePop's band): ratios [20, 20, 0.05, 0.05, 0.5, 5, 1.1] with
    advantages [-1, 1, 1, -1, 1, -1, 1]. Without the band token 0 (r 20, A < 0) keeps a gradient of
    weight 20 under both losses and token 2 (r 0.05, A > 0) one of 0.05; with [0.5, 5] every token
    outside gets none, the edges (0.5, 5) and the inside keep theirs. The prompt token (mask False,
    ratio 100) is neither trained nor counted."""
    ratios = [20.0, 20.0, 0.05, 0.05, 0.5, 5.0, 1.1, 100.0]
    adv = [-1.0, 1.0, 1.0, -1.0, 1.0, -1.0, 1.0, 0.0]
    mask = [True] * 7 + [False]
    grads = {}
    for band in ({}, {"ratio_mask_low": 0.5, "ratio_mask_high": 5.0}):
        logp = (torch.log(torch.tensor(ratios)) - 1.0)[None].requires_grad_()
        loss_fn = PolicyLoss(LossConfig(type=loss_type, clip_low=0.2, clip_high=0.28, **band))
        loss, stats = loss_fn(logp, torch.zeros(1, 8), micro_batch([-1.0] * 8, adv, mask), 7)
        loss.backward()
        grads[bool(band)] = logp.grad[0]
        metrics = loss_fn.metrics(stats)
    assert grads[False][0] == pytest.approx(20 / 7) and grads[False][2] == pytest.approx(-0.05 / 7)
    assert grads[True][:4].tolist() == [0.0] * 4 and grads[True][7] == 0
    torch.testing.assert_close(grads[True][4:7], grads[False][4:7])  # the edges and inside: untouched
    assert metrics["ratio_masked_fraction"] == pytest.approx(4 / 7)
    assert metrics["loss_tokens"] == 7


def test_ratio_band_with_one_side_and_the_kl_term():
    """Only ratio_mask_high set: a token far below 1 keeps its gradient; the one above loses its
    policy gradient but keeps the KL term's pull back (2 tau log r)."""
    tau = 0.1
    logp = torch.log(torch.tensor([[3.0, 0.01]])).requires_grad_()
    loss_fn = PolicyLoss(LossConfig(ratio_mask_high=2.0, kl_tau=tau))
    loss, stats = loss_fn(logp, torch.zeros(1, 2), micro_batch([0.0, 0.0], [-1.0, 1.0], [True, True]), 2)
    loss.backward()
    torch.testing.assert_close(logp.grad[0], torch.tensor([2 * tau * math.log(3.0), (-0.01 + 2 * tau * math.log(0.01))]) / 2)
    assert loss_fn.metrics(stats)["ratio_masked_fraction"] == pytest.approx(1 / 2)


def test_no_band_no_ratio_masked_metric():
    _, stats = (loss_fn := clip())(torch.zeros(1, 2), torch.zeros(1, 2), micro_batch([0.0, 0.0], [1.0, 1.0], [True, True]), 2)
    assert "ratio_masked_fraction" not in loss_fn.metrics(stats)


def test_ratio_band_of_one_side_is_open_on_the_other():
    assert LossConfig(ratio_mask_low=0.5).ratio_band == (0.5, math.inf)
    assert LossConfig(ratio_mask_high=5).ratio_band == (0.0, 5)
    assert LossConfig().ratio_band is None


def test_teacher_kl_enters_each_tokens_advantage_as_a_hand_computation_says():
    """trainer.loss.teacher_kl_coef: advantage_t = reward_weight x A - coef x (behaviour_t - teacher_t)
    on the loss tokens; at ratio 1 (inside the clip) the loss is -sum(advantage_t) / tokens and its
    gradient -advantage_t / tokens; train/teacher_kl is the token mean of behaviour - teacher."""
    behaviour, teacher = [0.0, -1.0, -2.0, -0.5], [-3.0, -1.5, -1.0, -0.5]
    mb = micro_batch(behaviour, [0.0, 1.0, 1.0, 1.0], [False, True, True, True])
    mb["teacher_logprobs"] = torch.tensor([teacher])
    logp = torch.tensor([behaviour], requires_grad=True)  # ratio 1 everywhere
    loss_fn = clip(teacher_kl_coef=0.5, reward_weight=0.25)
    loss, stats = loss_fn(logp, torch.zeros(1, 4), mb, 3)
    loss.backward()
    # per loss token: 0.25 * 1 - 0.5 * (b - t) = 0.25 - 0.5 * [0.5, -1.0, 0.0] = [0.0, 0.75, 0.25]
    advantage = [0.0, 0.0, 0.75, 0.25]
    assert loss.item() == pytest.approx(-sum(advantage) / 3, abs=1e-6)
    torch.testing.assert_close(logp.grad[0], -torch.tensor(advantage) / 3)
    metrics = loss_fn.metrics(stats)
    assert metrics["teacher_kl"] == pytest.approx((0.5 - 1.0 + 0.0) / 3)
    assert loss_fn.stats[:4] == ("loss", "entropy", "mismatch_kl", "teacher_kl")


def test_reward_weight_zero_is_pure_distillation_and_a_missing_teacher_key_is_refused():
    mb = micro_batch([-1.0, -1.0], [0.0, 5.0], [False, True])
    mb["teacher_logprobs"] = torch.tensor([[0.0, -1.0]])  # teacher agrees: nothing to learn
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    loss, _ = clip(teacher_kl_coef=1.0, reward_weight=0.0)(logp, torch.zeros(1, 2), mb, 1)
    loss.backward()
    assert loss.item() == 0.0 and logp.grad.abs().sum() == 0  # the reward's advantage 5 weighs nothing
    del mb["teacher_logprobs"]
    with pytest.raises(ValueError, match="no teacher_logprobs"):
        clip(teacher_kl_coef=1.0)(logp, torch.zeros(1, 2), mb, 1)


def test_teacher_kl_reaches_a_custom_loss_through_its_advantages():
    loss_fn = build_loss(LossConfig(type="custom", custom="custom_loss:reinforce", custom_args={"scale": 1.0},
                                    teacher_kl_coef=2.0))
    mb = micro_batch([0.0, -1.0], [0.0, 0.0], [False, True])
    mb["teacher_logprobs"] = torch.tensor([[0.0, -1.25]])
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    loss, stats = loss_fn(logp, torch.zeros(1, 2), mb, 1)
    assert loss.item() == pytest.approx(-(-2.0 * 0.25) * -1.0)  # reinforce: -A x logp, A = -2 x (b - t)
    assert loss_fn.stats[:4] == ("loss", "entropy", "mismatch_kl", "teacher_kl")
    assert loss_fn.metrics(stats)["teacher_kl"] == pytest.approx(0.25)
