"""trainer.prewarm against the compiled loss (trainer.compile on GPU), on CPU: the first real step
finds the loss kernels compiled. Compiling takes a minute on 2 cores; the prewarm's other tests are
in tests/unit/test_prewarm.py.

    pytest tests/integration/test_prewarm_compile.py
"""

from __future__ import annotations

import pytest
import torch

from prl.config import LossConfig, ModelConfig, TrainerConfig
from prl.trainer.loss import build_loss
from prl.trainer.model import build_model
from prl.trainer.prewarm import micro_batch_lengths, prewarm
from prl.trainer.samples import synthetic_batch
from prl.trainer.train import accumulate, build_optimizer, train_step

CPU = torch.device("cpu")


@pytest.mark.slow
def test_after_the_prewarm_the_first_step_compiles_nothing_in_the_loss(tiny_model, process_group):
    """The prewarm's backward goes through the step's own loss: the gradient that reaches the compiled
    loss kernels (trainer.compile on GPU) has the layout of a real step's, so the first step finds
    them compiled. With a mean of the outputs instead, its gradient kernel recompiled there (a guard
    on the gradient's base failed)."""
    from torch._dynamo.utils import counters

    trainer_cfg = TrainerConfig(gpus_per_node=0, lr=1e-2)
    model = build_model(ModelConfig(name=str(tiny_model), dtype="float32"), trainer_cfg, 1.0, CPU)
    model.compiled_loss, model.chunk_size = True, 64  # as parallelize sets them on GPU; layers stay eager
    optimizer, scheduler = build_optimizer(model, trainer_cfg, CPU)
    loss_fn = build_loss(LossConfig())
    assert prewarm(model, accumulate, CPU, model.causal_lm.config.vocab_size, micro_batch_lengths(64, 3, None),
                   False, loss_fn) > 0
    frames = counters["frames"]["total"]
    batch = synthetic_batch(0, world_size=1, micro_batches_per_rank=2, samples_per_micro_batch=3, seq_len=40,
                            vocab_size=model.causal_lm.config.vocab_size, seed=5)
    train_step(model, optimizer, scheduler, batch.micro_batches[0], trainer_cfg, CPU, loss_fn)
    assert counters["frames"]["total"] == frames
