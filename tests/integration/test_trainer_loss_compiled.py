"""The loss's torch.compile'd per-chunk kernels (what the GPU trainer runs with trainer.compile) on CPU:
the same function as eager, and no recompile for a remainder row. Compiling takes a minute on 2 cores,
which is why these are not in tests/unit/test_trainer_loss.py beside the rest of the loss's tests.

    pytest tests/integration/test_trainer_loss_compiled.py
"""

import pytest
import torch

from prl.trainer.loss import chunked_logprobs


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


@pytest.mark.slow
def test_compiled_kernels_do_not_recompile_for_a_remainder_of_one_row():
    """Past chunks of 8 and 7 rows (the prewarm's kind), 4 chunks and one row (33 rows) compile
    nothing new: that row joins the chunk before. Compiled, a 1-row chunk recompiled both kernels."""
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)

    def step(rows):
        hidden = torch.randn(rows, 16, generator=gen, requires_grad=True)
        targets = torch.randint(0, 50, (rows,), generator=gen)
        chunked_logprobs(hidden, weight, targets, 0.7, 8, compiled=True)[0].sum().backward()

    for rows in (23, 22):
        step(rows)
    frames = counters["frames"]["total"]
    step(33)
    assert counters["frames"]["total"] == frames
