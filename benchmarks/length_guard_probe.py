"""Which micro-batch lengths make a compiled decoder block compile again after the prewarm's lengths,
with Inductor's mix-order reduction in its strict mode (torch's default) and in its non-strict mode.

    python benchmarks/length_guard_probe.py strict     # one process per mode: dynamo's state is per process
    python benchmarks/length_guard_probe.py non-strict

Torch and transformers only (no prl), so it runs on a GPU machine without the vLLM bundle. A Qwen2
block of the 1.5B shape (hidden 1,536) compiled as the trainer compiles it (layer.compile(dynamic=True)),
forward and backward at the prewarm's lengths (prl.trainer.prewarm.micro_batch_lengths: 12,288 and
12,287, then halving, down to 47), then at lengths between them. Per length: its seconds and the
graphs compiled for it. Strict mode guards on the lengths where the fusion pays (rows * hidden >=
5 * 2**20, rows >= 2 * hidden, rows >= 4,096: torch/_inductor/scheduler.py, MixOrderReduction.can_fuse),
so a length in a band the prewarm missed compiles in a step. Last stdout line: one JSON object.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from transformers import Qwen2Config, Qwen2ForCausalLM

PREWARM = [12288, 12287, 6143, 3071, 1535, 767, 383, 191, 95, 47]
BETWEEN = [3700, 3300, 4000, 2500, 9000, 100]


def main() -> None:
    mode = sys.argv[1]
    inductor_config.triton.mix_order_reduction_non_strict_mode = mode == "non-strict"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=2, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=1024, max_position_embeddings=16384)
    model = Qwen2ForCausalLM(config).to(device, torch.bfloat16)
    for layer in model.model.layers:
        layer.compile(dynamic=True)
    rows = []
    for phase, lengths in (("prewarm", PREWARM), ("between", BETWEEN)):
        for length in lengths:
            before = counters["stats"]["unique_graphs"]
            begin = time.perf_counter()
            ids = torch.randint(0, config.vocab_size, (1, length), device=device)
            model(input_ids=ids, labels=ids).loss.backward()
            if device == "cuda":
                torch.cuda.synchronize()
            rows.append({"phase": phase, "tokens": length, "s": round(time.perf_counter() - begin, 2),
                         "graphs": counters["stats"]["unique_graphs"] - before})
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"mode": mode, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                      "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
