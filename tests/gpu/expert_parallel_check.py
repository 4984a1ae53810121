"""Run under torchrun (tests/gpu/test_expert_parallel_gpu.py): an MoE whose experts are split over the
ranks (prl.trainer.expert_parallel) against the whole model on every rank's own tokens. Prints one line per
rank: the largest logit difference and the experts' gradient difference (relative), which the test bounds.

    torchrun --nproc-per-node 2 tests/gpu/expert_parallel_check.py MODEL_DIR IMPLEMENTATION [compile|ac]
"""

import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from prl.trainer.expert_parallel import mesh_of, shard_experts


def main(model_dir: str, implementation: str, mode: str) -> None:
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def load() -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        model.set_experts_implementation(implementation)
        return model

    reference, split = load(), load()
    if mode == "ac":
        split.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        split.train()
    shard_experts(split, mesh_of(device))
    if mode == "compile":
        for layer in split.model.layers:
            layer.compile(dynamic=True)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 500, (1, 40 + 13 * r), generator=gen).to(device) for r in range(world)]

    def forward_backward(model, x):
        logits = model(input_ids=x).logits
        logits.float().pow(2).mean().backward()
        return logits

    mine = forward_backward(split, ids[rank])
    every = [forward_backward(reference, x) for x in ids]  # every rank's tokens: the gradients' sum
    worst = 0.0
    whole = dict(reference.named_parameters())
    for name, param in split.named_parameters():
        if hasattr(param.grad, "to_local"):
            local = param.grad.to_local()
            want = whole[name].grad[rank * local.shape[0] : (rank + 1) * local.shape[0]]
            worst = max(worst, ((local - want).abs().max() / want.abs().max()).item())
    print(f"rank {rank}: logits {(mine - every[rank]).abs().max().item():.3g} expert grads {worst:.3g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
