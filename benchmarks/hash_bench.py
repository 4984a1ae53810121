"""What hashing a policy version for its broadcast tag costs on this machine's CPU: each tensor (or a
receiving worker's bucket) as one task, as before, against HASH_PIECE_BYTES pieces (prl.run.broadcast.Hashes).

    python benchmarks/hash_bench.py --preset qwen2-1.5b --rounds 3

The tensors have a Qwen2 preset's shapes (bf16, in host memory; benchmarks/bench_model.py's presets).
Two patterns, each timed from the first tensor queued to the last digest, median of --rounds, the two
ways alternating in each round:
- sender: trainer rank 0 queues every tensor, then waits for the tag's digests (prl.trainer.broadcast_sender);
- worker: a receiving vLLM worker queues each BUCKET_BYTES bucket as it arrives, and before reusing one
  of its HOST_SLOTS host buffers waits until the bucket it held is hashed (prl.run.broadcast.Receiver);
  here buckets arrive as fast as that allows, so this is hashing's own floor under the transfer.
The old way's digests are not the tag's any more (a tensor's digest is now over its pieces'): it is timed
for its cost alone. The machine and thread count are printed; the ratio is old / new.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import PRESETS  # noqa: E402
from rl_bench import cpu_model  # noqa: E402

from prl.run import broadcast as bc  # noqa: E402


def shapes(preset: str) -> dict[str, tuple[int, ...]]:
    """The preset's tensors in state-dict order (no LM head where it is tied)."""
    c = PRESETS[preset]
    h, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    kv_dim = h // heads * kv
    out = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                p + "self_attn.k_proj.weight": (kv_dim, h), p + "self_attn.k_proj.bias": (kv_dim,),
                p + "self_attn.v_proj.weight": (kv_dim, h), p + "self_attn.v_proj.bias": (kv_dim,),
                p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    out["model.norm.weight"] = (h,)
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (c["vocab_size"], h)
    return out


def whole_tensor(tensor: torch.Tensor) -> bytes:
    """The earlier scheme: one SHA-256 over the tensor, one task."""
    return hashlib.sha256(tensor.reshape(-1).view(torch.uint8).numpy()).digest()


def sender_old(pool, state: dict) -> None:
    for future in [pool.submit(whole_tensor, t) for t in state.values()]:
        future.result()


def sender_new(pool, state: dict) -> None:
    hashes = bc.Hashes(pool)
    for tensor in state.values():
        hashes.add(tensor)
    hashes.digests()


def worker(pool, buffer: torch.Tensor, plan: list, new: bool) -> None:
    """Buckets queued in order; a slot's bucket hashed before the slot takes the next (HOST_SLOTS)."""
    hashes, slots, queued = bc.Hashes(pool), [None] * bc.HOST_SLOTS, []
    for index, (start, end, members) in enumerate(plan):
        if slots[index % bc.HOST_SLOTS] is not None:
            slots[index % bc.HOST_SLOTS].result()
        host = buffer[start:end]
        if new:
            slots[index % bc.HOST_SLOTS] = hashes.add_bucket(host, members, start)
        else:
            slots[index % bc.HOST_SLOTS] = pool.submit(
                lambda h=host, m=members, s=start: [whole_tensor(t) for _, t in bc.views(h, m, s)])
            queued.append(slots[index % bc.HOST_SLOTS])
    if new:
        hashes.digests()
    for future in queued:
        future.result()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2-1.5b")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    state = {name: torch.ones(shape, dtype=torch.bfloat16) for name, shape in shapes(args.preset).items()}
    entries, total = bc.layout(bc.manifest_of(state))
    buffer = torch.zeros(total, dtype=torch.uint8)
    for name, view in bc.views(buffer, entries):
        view.copy_(state[name])
    plan = bc.buckets(entries)
    largest = max(t.numel() * 2 for t in state.values())
    print(f"machine: {platform.node()}, CPU {cpu_model()} x {os.cpu_count()}; torch {torch.__version__}")
    print(f"{args.preset}: {len(state)} tensors, {total / 1e9:.2f} GB (largest {largest / 1e6:.0f} MB), "
          f"{len(plan)} buckets of <= {bc.BUCKET_BYTES >> 20} MiB; {bc.HASH_THREADS} hashing threads, "
          f"pieces of {bc.HASH_PIECE_BYTES >> 20} MiB, {bc.HOST_SLOTS} host slots per worker")
    times = {k: [] for k in ("sender_old", "sender_new", "worker_old", "worker_new")}
    with bc.hash_pool() as pool:
        for _ in range(args.rounds):
            times["sender_old"].append(timed(lambda: sender_old(pool, state)))
            times["sender_new"].append(timed(lambda: sender_new(pool, state)))
            times["worker_old"].append(timed(lambda: worker(pool, buffer, plan, new=False)))
            times["worker_new"].append(timed(lambda: worker(pool, buffer, plan, new=True)))
    med = {k: statistics.median(v) for k, v in times.items()}
    print("| pattern | one task per tensor/bucket s | pieces s | old / new | runs (old; new) |")
    print("| --- | ---: | ---: | ---: | --- |")
    for pattern in ("sender", "worker"):
        old, new = med[f"{pattern}_old"], med[f"{pattern}_new"]
        runs = "; ".join(", ".join(f"{t:.3f}" for t in times[f"{pattern}_{way}"]) for way in ("old", "new"))
        print(f"| {pattern} | {old:.3f} | {new:.3f} | {old / new:.2f} | {runs} |")
    print(f"hash rate, pieces, sender: {total / med['sender_new'] / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
