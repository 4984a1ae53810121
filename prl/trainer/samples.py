"""Micro-batches on the trainer's side: sample bounds, device copies, token counts; and
`synthetic_batch`, a batch of the orchestrator's shape from random tokens (tests, benchmarks).

The batch file itself (format, writer, reader and its checks) is prl.run.batch's.
"""

from __future__ import annotations

import torch

from prl.run.batch import MICRO_BATCH_KEYS, ROUTED_KEY, TEACHER_KEY, Batch


def sample_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 [N + 1], longest sample) of a packed [1, T] row whose positions restart
    at 0 per sample. Meant for the host copy: on the GPU the max() would be a device sync."""
    starts = (position_ids[0] == 0).nonzero().flatten()
    total = torch.tensor([position_ids.shape[1]], device=position_ids.device)
    cu_seqlens = torch.cat([starts, total]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def to_device(mb: dict, device: torch.device) -> dict:
    """The micro-batch's tensors plus its sample bounds (`cu_seqlens`, `max_len`, from the host
    copy) on `device`. On CUDA the copies go from pinned memory without blocking, so a step can
    queue all its micro-batches up front and then run without a host-device sync."""
    out = dict(zip(("cu_seqlens", "max_len"), sample_bounds(mb["position_ids"])))
    for key in (*MICRO_BATCH_KEYS, "cu_seqlens", *(k for k in (TEACHER_KEY, ROUTED_KEY) if k in mb)):
        tensor = out.get(key, mb.get(key))
        if device.type == "cuda":
            tensor = tensor.pin_memory()
        out[key] = tensor.to(device, non_blocking=True)
    return out


def count_tokens(micro_batches: list[dict]) -> tuple[int, int]:
    """(all tokens, loss tokens) of a rank's micro-batches."""
    tokens = sum(mb["input_ids"].numel() for mb in micro_batches)
    loss_tokens = sum(int(mb["loss_mask"].sum()) for mb in micro_batches)
    return tokens, loss_tokens


def random_sample(prompt_len: int, completion_len: int, vocab_size: int, generator: torch.Generator) -> dict:
    """One rollout as 1-D tensors: random tokens, a random advantage, random inference logprobs."""
    n = prompt_len + completion_len
    mask = torch.arange(n) >= prompt_len
    advantage = float(torch.randn((), generator=generator))
    return {
        "input_ids": torch.randint(0, vocab_size, (n,), generator=generator),
        "loss_mask": mask,
        "advantages": torch.full((n,), advantage) * mask,
        "behaviour_logprobs": -torch.rand(n, generator=generator) * 8 * mask,
    }


def pack(samples: list[dict]) -> dict:
    """Samples concatenated into one [1, T] micro-batch, positions restarting at 0 per sample."""
    micro_batch = {key: torch.cat([s[key] for s in samples])[None] for key in samples[0]}
    micro_batch["position_ids"] = torch.cat([torch.arange(len(s["input_ids"])) for s in samples])[None]
    micro_batch["num_samples"] = len(samples)
    return micro_batch


def synthetic_batch(
    step: int,
    world_size: int,
    micro_batches_per_rank: int,
    samples_per_micro_batch: int,
    seq_len: int,
    vocab_size: int,
    seed: int = 0,
) -> Batch:
    """A batch of random packed samples; each micro-batch is exactly `seq_len` tokens. Generated, it
    says, by version `step` itself (on-policy); no data order.

    Samples are split 1:3 prompt:completion, like short-prompt RL tasks.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    per_sample = seq_len // samples_per_micro_batch
    lengths = [per_sample] * (samples_per_micro_batch - 1) + [seq_len - per_sample * (samples_per_micro_batch - 1)]

    def micro_batch() -> dict:
        return pack([random_sample(n // 4, n - n // 4, vocab_size, generator) for n in lengths])

    micro_batches = [[micro_batch() for _ in range(micro_batches_per_rank)] for _ in range(world_size)]
    return Batch(step=step, policy_version=step, micro_batches=micro_batches, metrics={"reward_mean": 0.0})
