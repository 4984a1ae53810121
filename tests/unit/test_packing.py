"""Micro-batches by token budget (`trainer.micro_batch_tokens`): bounded, complete, deterministic,
the same count on every rank; and the step's loss and gradient do not depend on the packing."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loguru import logger
from transformers import Qwen2Config, Qwen2ForCausalLM

from prl.config import LossConfig
from prl.run.packing import Sample, by_tokens, over_budget, pack_batch
from prl.trainer.loss import PolicyLoss
from prl.trainer.attention import attn_implementation
from prl.trainer.model import PolicyModel
from prl.trainer.samples import count_tokens, to_device

VOCAB = 256


def sample(length: int, tag: int, prompt: int = 2) -> Sample:
    """`tag` in every token: which sample a packed token came from."""
    completion = length - prompt
    gen = torch.Generator().manual_seed(tag)
    logprobs = (-torch.rand(completion, generator=gen) * 4 - 0.01).tolist()
    return Sample([tag % VOCAB] * length, [False] * prompt + [True] * completion, [0.0] * prompt + logprobs,
                  advantage=float(torch.randn((), generator=gen)))


def layout(per_rank: list[list[dict]]) -> list[list[list[int]]]:
    """rank -> micro-batch -> lengths of its samples."""
    def lengths(mb):
        starts = (mb["position_ids"][0] == 0).nonzero().flatten().tolist() + [mb["position_ids"].shape[1]]
        return [b - a for a, b in zip(starts, starts[1:])] if mb["num_samples"] else []
    return [[lengths(mb) for mb in mbs] for mbs in per_rank]


def test_samples_that_fill_the_budget_exactly_share_one_micro_batch():
    assert layout(pack_batch([sample(6, 1), sample(10, 2), sample(16, 3)], 1, 8, micro_batch_tokens=32)) == [[[16, 10, 6]]]


def test_one_token_over_the_budget_opens_a_second_micro_batch():
    assert layout(pack_batch([sample(6, 1), sample(11, 2), sample(16, 3)], 1, 8, micro_batch_tokens=32)) == [[[16, 11], [6]]]


def test_a_sample_as_long_as_the_budget_is_alone():
    assert layout(pack_batch([sample(32, 1), sample(3, 2), sample(3, 3)], 1, 8, micro_batch_tokens=32)) == [[[32], [3, 3]]]


def test_a_sample_longer_than_the_budget_is_set_aside_logged_and_counted():
    samples = [sample(33, 1), sample(5, 2), sample(32, 3)]
    lines = []
    sink = logger.add(lines.append, level="WARNING", format="{message}")
    try:
        kept, dropped = over_budget(samples, 32, step=7)
    finally:
        logger.remove(sink)
    assert [len(s) for s in kept] == [5, 32] and dropped == 1
    assert [line.strip() for line in lines] == [
        "batch 7: a sample of 33 tokens exceeds trainer.micro_batch_tokens=32; not trained"]
    assert over_budget(samples, None, step=7) == (samples, 0)
    with pytest.raises(ValueError, match="33 tokens exceeds the micro-batch budget of 32"):
        by_tokens(samples, 32)


def test_many_tiny_samples_fill_each_micro_batch():
    per_rank = pack_batch([sample(3, i) for i in range(100)], 1, 8, micro_batch_tokens=32)
    assert [sum(x) for x in layout(per_rank)[0]] == [30] * 10  # 10 of 3 tokens; micro_batch_size does not apply


def test_two_ranks_get_the_same_number_of_micro_batches():
    samples = [sample(n, i) for i, n in enumerate([30, 30, 30, 4, 4, 3])]
    per_rank = pack_batch(samples, 2, 8, micro_batch_tokens=32)
    assert layout(per_rank) == [[[30], [30]], [[30], [4, 4, 3]]]
    # Fewer samples than ranks: the rank without any gets an empty micro-batch (one token, no loss).
    lone = pack_batch([sample(20, 1)], 2, 8, micro_batch_tokens=32)
    assert layout(lone) == [[[20]], [[]]] and lone[1][0]["input_ids"].shape == (1, 1)


def test_same_samples_same_layout_bit_for_bit():
    samples = [sample(n, i) for i, n in enumerate([7, 3, 12, 7, 9, 3, 20, 1 + 2])]
    one, two = (pack_batch(list(samples), 2, 8, micro_batch_tokens=24) for _ in range(2))
    for a, b in zip((mb for r in one for mb in r), (mb for r in two for mb in r), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "position_ids", "loss_mask", "advantages"))


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(3, 40), min_size=0, max_size=30), world=st.integers(1, 4),
       budget=st.integers(40, 120))
def test_token_packing_invariants(lengths, world, budget):
    samples = [sample(n, i) for i, n in enumerate(lengths)]
    per_rank = pack_batch(samples, world, 8, micro_batch_tokens=budget)
    assert len(per_rank) == world and len({len(mbs) for mbs in per_rank}) == 1
    tags = sorted(int(mb["input_ids"][0, s]) for mbs in per_rank for mb in mbs if mb["num_samples"]
                  for s in (mb["position_ids"][0] == 0).nonzero().flatten().tolist())
    assert tags == sorted(i % VOCAB for i in range(len(lengths)))  # every sample exactly once
    for mbs in per_rank:
        loads = [mb["input_ids"].shape[1] for mb in mbs if mb["num_samples"]]
        assert all(load <= budget for load in loads)
        # First fit: a later micro-batch's samples did not fit in any earlier one, so no two can merge.
        assert all(a + b > budget for i, a in enumerate(loads) for b in loads[i + 1 :])


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                         num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=True,
                         use_cache=False, attn_implementation=attn_implementation(torch.device("cpu")))
    return PolicyModel(Qwen2ForCausalLM(config), temperature=0.7, chunk_size=16)


def step_loss_and_grad(model, per_rank: list[list[dict]], loss_fn) -> tuple[float, torch.Tensor]:
    """What train_step computes on every rank together (gradients summed as the all-reduce would)."""
    model.zero_grad(set_to_none=True)
    total_loss_tokens = sum(count_tokens(mbs)[1] for mbs in per_rank)
    loss_sum = 0.0
    for mbs in per_rank:
        for mb in (to_device(mb, torch.device("cpu")) for mb in mbs):
            logprobs, entropy = model(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"], mb["max_len"])
            loss, _ = loss_fn(logprobs, entropy, mb, total_loss_tokens)
            loss.backward()
            loss_sum += loss.item()
    return loss_sum, torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("loss_cfg", [LossConfig(), LossConfig(type="dppo", kl_tau=1e-2)], ids=["clip", "dppo+kl"])
def test_step_loss_and_gradient_do_not_depend_on_the_packing(policy, loss_cfg):
    gen = torch.Generator().manual_seed(5)
    samples = []
    for i, n in enumerate([5, 17, 9, 30, 3, 12, 21, 8, 14]):
        s = sample(n, i)
        s.input_ids = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        samples.append(s)
    packings = {
        "one per micro-batch": pack_batch(samples, 1, 1),
        "3 per micro-batch": pack_batch(samples, 1, 3),
        "all in one": pack_batch(samples, 1, 100),
        "32 tokens": pack_batch(samples, 1, 8, micro_batch_tokens=32),
        "64 tokens, 2 ranks": pack_batch(samples, 2, 8, micro_batch_tokens=64),
        "30 tokens, 3 ranks": pack_batch(samples, 3, 8, micro_batch_tokens=30),
    }
    assert len({len(mbs) for mbs in packings.values()}) > 1  # the layouts do differ
    loss_fn = PolicyLoss(loss_cfg)
    results = {name: step_loss_and_grad(policy, per_rank, loss_fn) for name, per_rank in packings.items()}
    ref_loss, ref_grad = results["one per micro-batch"]
    assert ref_grad.abs().sum() > 0
    for name, (loss, grad) in results.items():
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7), name
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6, msg=name)
