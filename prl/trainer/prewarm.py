"""The trainer's one-time costs paid before its first batch arrives (`trainer.prewarm`).

The first training step of a launch used to take 20-33 s instead of 5.7 (1.5B, compiled, one H200;
benchmarks/results/h200x4-2026-11-27b): torch.compile of the decoder blocks and of the chunked
loss (or loading them from the cache), kernel autotuning, the allocator's first blocks. The trainer
is ready about a minute before the servers have generated the first batch, so it runs one small
synthetic micro-batch through the same forward and backward meanwhile (and, with behaviour
logprobs recomputed, the no-grad forward that uses), and the first step starts warm.

Nothing of the run changes: no optimizer step, the gradients are dropped, and every RNG the step
could draw from is restored, so the steps that follow are the same bit for bit (tests/test_prewarm.py).
"""

from __future__ import annotations

import time

import torch
from torch.distributed.fsdp import FSDPModule

from prl.trainer.samples import pack, random_sample, to_device

LENGTHS = (96, 160)
"""Two samples of different lengths (more than one, neither 0 nor 1: a dynamic-shape compile
specializes those sizes): the packed shape every real micro-batch takes."""


def synthetic_micro_batch(vocab_size: int, max_len: int) -> dict:
    """Random tokens packed like the orchestrator's micro-batches, each sample at most `max_len`."""
    generator = torch.Generator().manual_seed(0)
    lengths = [min(n, max_len) for n in LENGTHS]
    return pack([random_sample(n // 4, n - n // 4, vocab_size, generator) for n in lengths])


def prewarm(model, accumulate, device: torch.device, vocab_size: int, max_len: int, no_grad_forward: bool) -> float:
    """One forward and backward of a synthetic micro-batch (and a no-grad forward if `no_grad_forward`);
    seconds it took. `accumulate(model, last)`: the training step's own gradient-sync setting, so the
    backward reduces and reshards as the step's last micro-batch does. Every rank must call it: the
    backward's reduce-scatter is a collective."""
    start = time.perf_counter()
    mb = to_device(synthetic_micro_batch(vocab_size, max_len), device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        accumulate(model, last=True)
        logprobs, entropy = model(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"], mb["max_len"])
        # Any scalar of both outputs: the backward runs through every block and the loss kernels.
        (logprobs.float().mean() + entropy.float().mean()).backward()
        model.zero_grad(set_to_none=True)
        if no_grad_forward:
            with torch.no_grad():
                model(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"], mb["max_len"])
        # Blocks a forward left gathered (one rank, unsharded accumulation) go back to their shards,
        # as after a step's backward: the first step starts from the state it would have found.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
