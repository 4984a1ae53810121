"""trainer.prewarm: the synthetic forward and backward before the first batch changes nothing of the run.

The real trainer model (prl.trainer.model.build_model: FSDP2 over a one-rank gloo group, the tiny
Qwen2 of tools/make_tiny_model.py) takes one training step with and without the prewarm first; the
step's metrics and the weights after it must be the same bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from loguru import logger

from prl.config import LossConfig, ModelConfig, TrainerConfig
from prl.trainer.loss import build_loss
from prl.trainer.model import build_model
from prl.trainer.prewarm import micro_batch_lengths, prewarm
from prl.trainer.samples import synthetic_batch
from prl.trainer.train import accumulate, build_optimizer, train_step

CPU = torch.device("cpu")


def one_step(model_dir, prewarmed: bool, no_grad_forward: bool = False) -> tuple[dict, dict, list]:
    """(the step's metrics plus "initial": the weights as loaded, the weights after the step, what the
    prewarm left: [RNG state kept, gradients, weights kept])."""
    trainer_cfg = TrainerConfig(gpus_per_node=0, lr=1e-2)
    model = build_model(ModelConfig(name=str(model_dir), dtype="float32"), trainer_cfg, 1.0, CPU)
    optimizer, scheduler = build_optimizer(model, trainer_cfg, CPU)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    left = []
    if prewarmed:
        torch.manual_seed(123)
        rng = torch.get_rng_state()
        lengths = micro_batch_lengths(64, 3, None)
        assert lengths == [[64, 64, 64], [64, 64, 63], [64, 31], [47]]
        seconds = prewarm(model, accumulate, CPU, model.causal_lm.config.vocab_size, lengths, no_grad_forward,
                          build_loss(LossConfig()))
        assert seconds > 0
        left = [torch.equal(torch.get_rng_state(), rng), [p.grad for p in model.parameters()],
                all(torch.equal(p.detach(), before[name]) for name, p in model.named_parameters())]
    batch = synthetic_batch(0, world_size=1, micro_batches_per_rank=2, samples_per_micro_batch=3, seq_len=64,
                            vocab_size=model.causal_lm.config.vocab_size, seed=5)
    metrics = train_step(model, optimizer, scheduler, batch.micro_batches[0], trainer_cfg, CPU, build_loss(LossConfig()))
    return metrics | {"initial": before}, {name: p.detach().clone() for name, p in model.named_parameters()}, left


def test_the_prewarm_takes_the_largest_micro_batch_a_step_can_take_then_halves_it():
    lengths = micro_batch_lengths(1536, 8, None)
    assert lengths[:2] == [[1536] * 8, [1536] * 7 + [1535]]
    assert [sum(n) for n in lengths[2:]] == [6143, 3071, 1535, 767, 383, 191, 95, 47]  # odd, down to SMALLEST
    assert lengths[2] == [1536, 1536, 1536, 1535] and lengths[-1] == [47]
    # micro_batch_tokens: as many longest samples as fit, the rest of the budget in one more.
    assert micro_batch_lengths(1000, 8, 2500)[:3] == [[1000, 1000, 500], [1000, 1000, 499], [1000, 249]]
    assert micro_batch_lengths(2, 1, None) == [[2]]  # nothing shorter to pack
    assert micro_batch_lengths(129, 1, None) == [[129], [128], [63], [31]]
    assert all(min(n) >= 2 for m in (65, 66, 129) for n in micro_batch_lengths(m, 4, None))  # no 1-token sample


def test_after_the_prewarm_no_length_on_either_side_of_a_compiled_threshold_compiles(tiny_model, process_group):
    """A compiled piece whose graph holds only on one side of a length threshold, as Inductor's on GPU
    did (torch 2.11's mix-order reduction in its strict mode: "4096 <= hidden_states.size()[1]" at
    1.5B, so the first micro-batch under 4,096 tokens compiled in the middle of a run). The prewarm's
    smaller micro-batches meet the side its largest ones do not; then steps of micro-batches on both
    sides compile nothing. With the two largest micro-batches alone the short step compiled."""
    from torch._dynamo.utils import counters

    class Banded(torch.nn.Module):  # around the final norm: [1, tokens, hidden]
        def __init__(self, norm: torch.nn.Module, threshold: int):
            super().__init__()
            self.norm, self.threshold = norm, threshold

        def forward(self, hidden):
            return self.norm(hidden) if hidden.shape[1] >= self.threshold else self.norm(hidden) * 1.0

    trainer_cfg = TrainerConfig(gpus_per_node=0, lr=1e-2)
    model = build_model(ModelConfig(name=str(tiny_model), dtype="float32"), trainer_cfg, 1.0, CPU)
    inner = model.causal_lm.model
    inner.norm = torch.compile(Banded(inner.norm, threshold=120), dynamic=True)
    optimizer, scheduler = build_optimizer(model, trainer_cfg, CPU)
    loss_fn = build_loss(LossConfig())
    lengths = micro_batch_lengths(64, 3, None)  # 192, 191, then 95 and 47 tokens
    assert prewarm(model, accumulate, CPU, model.causal_lm.config.vocab_size, lengths, False, loss_fn) > 0
    frames = counters["frames"]["total"]
    for step, samples in enumerate((3, 1, 2)):  # micro-batches of 120, 40 and 80 tokens
        batch = synthetic_batch(step, world_size=1, micro_batches_per_rank=2, samples_per_micro_batch=samples,
                                seq_len=40, vocab_size=model.causal_lm.config.vocab_size, seed=5)
        train_step(model, optimizer, scheduler, batch.micro_batches[0], trainer_cfg, CPU, loss_fn)
    assert counters["frames"]["total"] == frames


@pytest.mark.parametrize("ranks", [2, 1], ids=["with-filler", "without"])
def test_after_a_several_rank_prewarm_a_ranks_filler_micro_batch_compiles_nothing(tiny_model, process_group, ranks):
    """A rank short of micro-batches trains a one-token filler (prl.run.packing.empty_micro_batch), a
    length torch.compile specializes on even with dynamic=True. The prewarm of a several-rank trainer
    ends with one, so a step with a filler compiles nothing; without it (one rank's prewarm) the same
    step compiled, as the first filler would mid-step on a GPU while the other ranks waited."""
    from torch._dynamo.utils import counters

    from prl.run.packing import empty_micro_batch

    torch._dynamo.reset()  # the graphs the other case compiled for the same norm's code would serve this one
    trainer_cfg = TrainerConfig(gpus_per_node=0, lr=1e-2)
    model = build_model(ModelConfig(name=str(tiny_model), dtype="float32"), trainer_cfg, 1.0, CPU)
    inner = model.causal_lm.model
    inner.norm = torch.compile(inner.norm, dynamic=True)  # [1, tokens, hidden], as the compiled blocks take
    optimizer, scheduler = build_optimizer(model, trainer_cfg, CPU)
    loss_fn = build_loss(LossConfig())
    lengths = micro_batch_lengths(64, 3, None, ranks)
    assert lengths[-1] == ([1] if ranks > 1 else [47])
    assert prewarm(model, accumulate, CPU, model.causal_lm.config.vocab_size, lengths, False, loss_fn) > 0
    frames = counters["frames"]["total"]
    batch = synthetic_batch(0, world_size=1, micro_batches_per_rank=1, samples_per_micro_batch=3, seq_len=40,
                            vocab_size=model.causal_lm.config.vocab_size, seed=5)
    metrics = train_step(model, optimizer, scheduler, [*batch.micro_batches[0], empty_micro_batch()], trainer_cfg,
                         CPU, loss_fn)
    assert all(v == v for v in metrics.values())  # the filler adds no NaN
    assert (counters["frames"]["total"] == frames) == (ranks > 1)


@pytest.mark.parametrize("no_grad_forward", [False, True], ids=["train", "train+recompute"])
def test_the_prewarm_leaves_weights_gradients_rng_and_the_next_step_as_they_were(tiny_model, process_group,
                                                                                  no_grad_forward):
    cold_metrics, cold_weights, _ = one_step(tiny_model, prewarmed=False)
    warm_metrics, warm_weights, (rng_kept, grads, weights_kept) = one_step(tiny_model, True, no_grad_forward)
    assert rng_kept and weights_kept
    assert all(g is None for g in grads)
    initial = warm_metrics.pop("initial")
    cold_metrics.pop("initial")
    assert warm_metrics == cold_metrics
    assert warm_weights.keys() == cold_weights.keys()
    assert all(torch.equal(warm_weights[n], cold_weights[n]) for n in cold_weights)
    # ... after a step that moved them, so that equal weights mean something
    assert sum(not torch.equal(warm_weights[n], w) for n, w in initial.items()) > len(initial) // 2


def test_a_prewarm_that_does_not_fit_is_skipped_and_changes_nothing(tiny_model, process_group, monkeypatch):
    """Out of memory in the middle of the prewarm's backward (the largest micro-batch is larger than this
    run's batches need): a warning, no prewarm time, and the next step as without any prewarm."""
    cold_metrics, cold_weights, _ = one_step(tiny_model, prewarmed=False)
    cold_metrics.pop("initial")
    real_backward = torch.Tensor.backward

    def backward_out_of_memory(self, *args, **kwargs):
        monkeypatch.setattr(torch.Tensor, "backward", real_backward)  # only the prewarm's first backward fails
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")

    monkeypatch.setattr(torch.Tensor, "backward", backward_out_of_memory)
    trainer_cfg = TrainerConfig(gpus_per_node=0, lr=1e-2)
    model = build_model(ModelConfig(name=str(tiny_model), dtype="float32"), trainer_cfg, 1.0, CPU)
    optimizer, scheduler = build_optimizer(model, trainer_cfg, CPU)
    warnings = []
    handler = logger.add(lambda message: warnings.append(str(message)), level="WARNING")
    try:
        assert prewarm(model, accumulate, CPU, model.causal_lm.config.vocab_size, micro_batch_lengths(64, 3, None),
                       False, build_loss(LossConfig())) is None
    finally:
        logger.remove(handler)
    assert len(warnings) == 1 and "prewarm skipped: a micro-batch of 192 tokens" in warnings[0]
    assert all(p.grad is None for p in model.parameters())
    batch = synthetic_batch(0, world_size=1, micro_batches_per_rank=2, samples_per_micro_batch=3, seq_len=64,
                            vocab_size=model.causal_lm.config.vocab_size, seed=5)
    metrics = train_step(model, optimizer, scheduler, batch.micro_batches[0], trainer_cfg, CPU, build_loss(LossConfig()))
    assert metrics == cold_metrics
    assert all(torch.equal(p.detach(), cold_weights[name]) for name, p in model.named_parameters())

