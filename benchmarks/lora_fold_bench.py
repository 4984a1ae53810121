"""What folding an adapter version into the base costs a GPU worker (prl.run.lora, prl.inference.worker),
against moving the same base weights to the GPU unchanged, which any in-place weight update does.

    python benchmarks/lora_fold_bench.py --preset qwen2-7b --rank 16 --rounds 3

The base lives in host memory in bf16 (as the memory-mapped safetensors a worker reads), the
adapters (every linear layer, rank --rank, bf16 as the trainer exports them) too. Per round: "copy"
moves every base tensor to the GPU; "fold" runs merged_weights with the GPU as its device: each
adapted weight goes up, gets scale * B @ A added in fp32, comes back as bf16. Printed: seconds of
each (median of --rounds), their difference (the fold's own cost) and the bytes of an adapter
version against a full one.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch

from prl.run import lora

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab (Qwen2.5 1.5B and 7B)
    "qwen2-1.5b": (1536, 8960, 28, 12, 2, 151936),
    "qwen2-7b": (3584, 18944, 28, 28, 4, 152064),
    "tiny": (128, 256, 2, 4, 2, 768),
}


def base_state(preset: str) -> dict[str, torch.Tensor]:
    hidden, inter, layers, heads, kv, vocab = SHAPES[preset]
    head = hidden // heads
    linear = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv * head, hidden),
              "self_attn.v_proj": (kv * head, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    state = {"model.embed_tokens.weight": torch.zeros(vocab, hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        for name, shape in linear.items():
            state[f"model.layers.{i}.{name}.weight"] = torch.full(shape, 0.01, dtype=torch.bfloat16)
    state["lm_head.weight"] = torch.zeros(vocab, hidden, dtype=torch.bfloat16)
    return state


def adapters_of(state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, weight in state.items():
        if ".layers." in name:
            module = lora.PREFIX + name.removesuffix(".weight")
            out[f"{module}.lora_A.weight"] = torch.randn(rank, weight.shape[1]).to(torch.bfloat16)
            out[f"{module}.lora_B.weight"] = torch.randn(weight.shape[0], rank).to(torch.bfloat16)
    return out


def timed(fn) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(SHAPES), default="qwen2-1.5b")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"machine: {socket.gethostname()}, {name}; torch {torch.__version__}")
    state = base_state(args.preset)
    adapters = adapters_of(state, args.rank)
    full = sum(t.numel() * t.element_size() for t in state.values())
    small = sum(t.numel() * t.element_size() for t in adapters.values())
    print(f"{args.preset}: full version {full / 2**30:.2f} GiB bf16; adapter version (rank {args.rank}, 7 linear "
          f"layers per block) {small / 2**20:.1f} MiB: {full / small:.0f}x smaller")

    def copy():
        for _, t in state.items():
            t.to(device)

    def fold():
        for _, t in lora.merged_weights(state.items(), adapters, 2.0, device):
            t.to(device)

    rounds = {"copy": [], "fold": []}
    for _ in range(args.rounds + 1):  # the first round warms up (allocator, cuBLAS)
        rounds["copy"].append(timed(copy))
        rounds["fold"].append(timed(fold))
    copy_s, fold_s = (statistics.median(rounds[k][1:]) for k in ("copy", "fold"))
    print(f"copy (base to GPU unchanged): {copy_s:.3f} s; fold (base to GPU with the adapters added): {fold_s:.3f} s; "
          f"the fold's own cost {fold_s - copy_s:+.3f} s; ratio fold/copy {fold_s / copy_s:.2f} "
          f"(median of {args.rounds} rounds after one warm-up; each {[round(x, 3) for x in rounds['fold'][1:]]})")


if __name__ == "__main__":
    main()
