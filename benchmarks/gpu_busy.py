"""Keeps one GPU busy until killed, for measuring what that costs a vLLM engine on another GPU
(rl_bench_engine.py offline --beside). Prints "busy" once its first iteration is done.

    CUDA_VISIBLE_DEVICES=3 python3 benchmarks/gpu_busy.py train --model /tmp/m15   # a training step
    CUDA_VISIBLE_DEVICES=3 python3 benchmarks/gpu_busy.py matmul                   # the GPU alone

train: forward and backward of the model (transformers, bf16, 8 x 1088 random tokens) and AdamW, as
a trainer's step keeps its GPU and one CPU core busy; matmul: 8192^3 bf16 products, nothing on the CPU
but the launches.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("train", "matmul"))
    parser.add_argument("--model", help="a model directory (train)")
    args = parser.parse_args()
    device = torch.device("cuda")
    if args.mode == "matmul":
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        step = lambda: a @ a  # noqa: E731
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=True)
        ids = torch.randint(0, model.config.vocab_size, (8, 1088), device=device)

        def step():
            loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    step()
    torch.cuda.synchronize()
    print("busy", flush=True)
    while True:
        step()
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
