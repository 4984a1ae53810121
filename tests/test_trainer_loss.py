"""The RL objective: chunked logprobs against the naive computation; clipping, masking, normalisation."""

import math

import pytest
import torch

from prl.trainer.loss import chunked_logprobs, policy_gradient_loss, stats_to_metrics


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


def micro_batch(inference_logprobs, advantages, loss_mask):
    as_row = lambda x, dtype: torch.tensor(x, dtype=dtype)[None]  # noqa: E731
    return {
        "inference_logprobs": as_row(inference_logprobs, torch.float32),
        "advantages": as_row(advantages, torch.float32),
        "loss_mask": as_row(loss_mask, torch.bool),
    }


def test_ratio_is_clipped_in_the_direction_the_advantage_pushes():
    # ratios exp(logp - inf) = [2.0, 0.5, 2.0, 0.5, 1.1]
    ratios = torch.tensor([2.0, 0.5, 2.0, 0.5, 1.1])
    inf = [-1.0] * 5
    logp = (torch.log(ratios) - 1.0)[None].requires_grad_()
    adv = [1.0, -1.0, -1.0, 1.0, 1.0]
    mb = micro_batch(inf, adv, [True] * 5)
    loss, stats = policy_gradient_loss(logp, torch.zeros(1, 5), mb, 5, clip_low=0.2, clip_high=0.28)
    loss.backward()
    # token 0: A>0, r>1.28 -> clipped to 1.28, no gradient; token 1: A<0, r<0.8 -> clipped to 0.8, no grad;
    # tokens 2, 3: the pessimistic min keeps the unclipped ratio (gradient flows); token 4 inside the region.
    expected = -(1.28 * 1 + 0.8 * -1 + 2.0 * -1 + 0.5 * 1 + 1.1 * 1) / 5
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    grad = logp.grad[0]
    assert grad[0] == 0 and grad[1] == 0
    # d/dlogp of -r*A/5 = -r*A/5
    torch.testing.assert_close(grad[2:], -ratios[2:] * torch.tensor(adv[2:]) / 5)
    metrics = stats_to_metrics(stats)
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)
    assert metrics["loss_tokens"] == 5


def test_masked_tokens_contribute_nothing():
    logp = torch.tensor([[0.0, -50.0, -1.0, 30.0]], requires_grad=True)  # junk where the mask is False
    mb = micro_batch([0.0, 0.0, -1.0, 0.0], [5.0, 5.0, 1.0, 5.0], [False, False, True, False])
    loss, stats = policy_gradient_loss(logp, torch.full((1, 4), 3.0), mb, 1, 0.2, 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    assert logp.grad[0].tolist() == [0.0, 0.0, -1.0, 0.0]
    metrics = stats_to_metrics(stats)
    assert metrics["entropy"] == pytest.approx(3.0)
    assert metrics["mismatch_kl"] == pytest.approx(0.0)


def test_accumulated_micro_batches_equal_one_big_batch():
    """Dividing by the step's loss-token count makes gradient accumulation exact (unequal micro-batches)."""
    gen = torch.Generator().manual_seed(2)
    logits_param = torch.randn(10, generator=gen, requires_grad=True)
    inf = torch.randn(10, generator=gen) - 2
    adv = torch.randn(10, generator=gen)
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 0, 1, 1, 1], dtype=torch.bool)

    def run(splits):
        logits_param.grad = None
        total, stats = 0.0, torch.zeros(5, dtype=torch.float64)
        for a, b in splits:
            mb = micro_batch(inf[a:b].tolist(), adv[a:b].tolist(), mask[a:b].tolist())
            loss, s = policy_gradient_loss(logits_param[a:b][None] - 1, torch.zeros(1, b - a), mb, int(mask.sum()), 0.2, 0.3)
            loss.backward()
            total += loss.item()
            stats += s
        return total, logits_param.grad.clone(), stats_to_metrics(stats)

    whole = run([(0, 10)])
    parts = run([(0, 3), (3, 4), (4, 10)])
    assert parts[0] == pytest.approx(whole[0], rel=1e-6)
    torch.testing.assert_close(parts[1], whole[1])
    assert parts[2]["loss"] == pytest.approx(whole[0], rel=1e-6)


def test_mismatch_kl_is_the_k3_estimator():
    logp = torch.tensor([[math.log(0.5)]])
    mb = micro_batch([math.log(0.25)], [0.0], [True])
    _, stats = policy_gradient_loss(logp, torch.zeros(1, 1), mb, 1, 0.2, 0.2)
    r = 2.0
    assert stats_to_metrics(stats)["mismatch_kl"] == pytest.approx(r - math.log(r) - 1)


def test_no_loss_tokens_gives_zero_loss_not_nan():
    mb = micro_batch([0.0, 0.0], [1.0, 1.0], [False, False])
    loss, stats = policy_gradient_loss(torch.zeros(1, 2, requires_grad=True), torch.zeros(1, 2), mb, 0, 0.2, 0.2)
    assert loss.item() == 0.0
    assert stats_to_metrics(stats)["loss_tokens"] == 0


@pytest.mark.slow
def test_compiled_kernels_match_eager():
    """The torch.compile'd per-chunk kernels (used on GPU with trainer.compile) compute the same function."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(37, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=gen)
    upstream = torch.randn(37, generator=gen)
    results = []
    for compiled in (False, True):
        logp, entropy = chunked_logprobs(hidden, weight, targets, 0.7, 8, compiled=compiled)  # last chunk: 5 rows
        (logp * upstream).sum().backward()
        results.append((logp.detach(), entropy, hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
