"""The trainer's one-time costs paid before its first batch arrives (`trainer.prewarm`).

The first training step of a launch takes 13-33 s instead of 5.7 (1.5B, compiled, 8 samples of 1,053
tokens a micro-batch, one H200; benchmarks/reports/one-node-slurm-3p1-1.5b_h200x4_2026-11-27.md and
benchmarks/reports/loop-fsync-prewarm-1.5b_h200x4_2026-11-27.md): torch.compile of
the decoder blocks and of the chunked loss (or loading them from the cache), kernels compiled and
tuned at their first launch with a shape, the allocator's first blocks. The trainer is ready a
minute or more before the servers have generated the first batch, so meanwhile it runs synthetic
micro-batches through the same forward and backward (and, with behaviour logprobs recomputed, the
no-grad forward that uses), and the first step should start warm.

The micro-batches are the largest a step can take (micro_batch_size samples of model.max_model_len,
or micro_batch_tokens): the allocator reaches a step's peak and every kernel meets full-size shapes.
Two of them, the second one token shorter, so that kernels which specialize on a size's parity or
divisibility (Triton specializes integer arguments divisible by 16) see both kinds. A first version
ran one micro-batch of 256 tokens: it took 12.5-25 s, and the first step still took 13.4-19.3 s
(benchmarks/reports/loop-fsync-prewarm-1.5b_h200x4_2026-11-27.md); what the full-size one leaves is measured by
benchmarks/first_step_bench.py.

Then smaller ones, each about half the one before, down to SMALLEST tokens. The decoder blocks are
compiled for any length (dynamic=True), but a graph Inductor compiles may hold only on one side of a
length where it chose differently, guarded. With torch 2.11 on GPU those were the size checks of its
mix-order reduction (TORCH_LOGS=recompiles: "4096 <= hidden_states.size()[1]" at 1.5B): the first
micro-batch under 4,096 tokens compiled anew, 15-19 s in the middle of a run, in 1 of 6 steps of the
loop packed by tokens (a step's last micro-batch is its remainder) and in 1 of 10 of the trainer alone
(benchmarks/reports/loop-7b-2p2_h200x4_2026-11-28.md). Halving down from 12,288 tokens still missed the band of
3,414-4,095 tokens, which 8 varied samples fill; prl.trainer.model.compile_layers now skips those
checks, and with them their guards (benchmarks/reports/compile-stall-fixes-warm-start_h200x2_2026-11-28.md). Halving
stays for thresholds of other origins: it meets every band between them that is at least a factor of 2 wide;
a narrower one still compiles once in a step, and the trainer's warning (perf/compiled_frames)
names it. With several ranks, last, the one-token micro-batch that tops up a rank short of them.

Nothing of the run changes: no optimizer step, the gradients are dropped, and every RNG the step
could draw from is restored, so the steps that follow are the same bit for bit (tests/unit/test_prewarm.py).
"""

from __future__ import annotations

import time

import torch
from loguru import logger
from torch.distributed.fsdp import FSDPModule

from prl.run.packing import empty_micro_batch
from prl.trainer.samples import pack, random_sample, to_device


FILLER = 1
"""Tokens of the micro-batch that tops up a rank short of micro-batches (prl.run.packing.empty_micro_batch)."""
SMALLEST = 32
"""Tokens of the prewarm's smallest micro-batch: a length band under it would need a kernel of 2**26
elements a token to cross 32-bit indexing."""


def micro_batch_lengths(max_len: int, micro_batch_size: int, micro_batch_tokens: int | None,
                        ranks: int = 1) -> list[list[int]]:
    """Sample lengths of the prewarm's micro-batches: the largest one a step packs, the same one token
    shorter (at least 2 tokens a sample: a prompt token and a completion token), then micro-batches
    of about half as many tokens as the one before, odd, down to SMALLEST. With several ranks, last,
    [FILLER]: the one-token micro-batch a rank short of micro-batches gets (prl.run.packing), a length
    torch.compile does not take as dynamic (it specializes on 0 and 1): without it here, the first
    filler compiles the blocks anew mid-step (tests/unit/test_prewarm.py), the other ranks waiting in
    FSDP's collectives meanwhile."""
    count = micro_batch_tokens // max_len if micro_batch_tokens else micro_batch_size
    largest = [max_len] * max(count, 1)
    if micro_batch_tokens and micro_batch_tokens > sum(largest):
        largest.append(micro_batch_tokens - sum(largest))
    lengths = [largest, largest[:-1] + [max(2, largest[-1] - 1)]] if largest[-1] > 2 else [largest]
    tokens = sum(largest) // 2
    while tokens >= SMALLEST:
        odd = tokens - 1 + tokens % 2
        odd -= 2 if odd % max_len == 1 else 0  # no sample of one token
        lengths.append([max_len] * (odd // max_len) + ([odd % max_len] if odd % max_len else []))
        tokens //= 2
    return lengths + ([[FILLER]] if ranks > 1 else [])


def synthetic_micro_batch(vocab_size: int, lengths: list[int]) -> dict:
    """Random tokens packed like the orchestrator's micro-batches; [FILLER]: its filler itself."""
    if lengths == [FILLER]:
        return empty_micro_batch()
    generator = torch.Generator().manual_seed(0)
    return pack([random_sample(n // 4, n - n // 4, vocab_size, generator) for n in lengths])


def prewarm(model, accumulate, device: torch.device, vocab_size: int, lengths: list[list[int]],
            no_grad_forward: bool, loss_fn) -> float | None:
    """Forward, the step's loss (`loss_fn`, a PolicyLoss) and backward of a synthetic micro-batch of each
    of `lengths` (and a no-grad forward if `no_grad_forward`); seconds it took. `accumulate(model, last)`:
    the training step's own gradient-sync setting, so the backward reduces and reshards as the step's
    last micro-batch does. Every rank must call it: the backward's reduce-scatter is a collective.

    The step's own loss, not any scalar of the outputs: the gradient that reaches the compiled loss
    kernels has the loss's layout, and torch.compile guards on it. A mean's gradient (one value
    expanded) made the first real step recompile the gradient kernel (seen on CPU with the GPU's
    varlen path, TORCH_LOGS=recompiles: "tuple index out of range" on the gradient's base).

    None, with a warning, when the largest micro-batch does not fit the GPU: a run whose real batches
    are shorter may still train, so that is no reason to stop it here (one such batch would fail later)."""
    try:
        return _prewarm(model, accumulate, device, vocab_size, lengths, no_grad_forward, loss_fn)
    except torch.OutOfMemoryError as e:
        model.zero_grad(set_to_none=True)
        _reshard(model)
        torch.cuda.empty_cache()
        logger.warning(f"prewarm skipped: a micro-batch of {sum(lengths[0])} tokens (trainer.micro_batch_size or "
                       f"micro_batch_tokens at model.max_model_len) does not fit this GPU ({str(e).splitlines()[0]}); "
                       "a batch that long would not fit either")
        return None


def _prewarm(model, accumulate, device: torch.device, vocab_size: int, lengths: list[list[int]],
             no_grad_forward: bool, loss_fn) -> float:
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for sample_lengths in lengths:
            host = synthetic_micro_batch(vocab_size, sample_lengths)
            mb = to_device(host, device)
            accumulate(model, last=True)
            logprobs, entropy = model(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"], mb["max_len"])
            loss, _ = loss_fn(logprobs, entropy, mb, max(1, int(host["loss_mask"].sum())))  # the filler has none
            loss.backward()
            model.zero_grad(set_to_none=True)
            del logprobs, entropy
            if no_grad_forward:
                with torch.no_grad():
                    model(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"], mb["max_len"])
        _reshard(model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _reshard(model) -> None:
    """Blocks a forward left gathered (one rank, unsharded accumulation) go back to their shards, as
    after a step's backward, and flat gradients (trainer.flat_params) start anew: the first step starts
    from the state it would have found."""
    if getattr(model, "flat", None) is not None:
        model.flat.reset()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
