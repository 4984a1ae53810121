"""trainer_bench's workload: the model shapes, the synthetic samples of each step, their packing per
rank or padding for the baseline, and the FLOPs MFU counts.

    from bench_workload import PRESETS, make_steps, model_config   # benchmarks/, beside trainer_bench.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from bench_shapes import QWEN25  # beside this module
from prl.trainer.routing import experts_of
from prl.trainer.samples import pack, random_sample

PRESETS = {
    **QWEN25,  # Qwen2.5-0.5B / -1.5B / -7B
    # Qwen2.5-14B's shape: 14.8B parameters, 16 bytes each in the trainer with fp32 master weights
    # (237 GB): on one H200 only with trainer.offload and master_dtype bfloat16 (8 bytes, on the host).
    "qwen2-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                      num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=768, tie_word_embeddings=True),
    # Qwen3-30B-A3B's layer (128 experts, top-8) cut from 48 to 10 layers to train on one H200: 6.85B
    # parameters, 0.88B active without the embedding; full fine-tuning holds 18 bytes a parameter
    # (fp32 weights, gradients, AdamW's two moments, the bf16 copy FSDP gathers) = 114.9 GiB, leaving
    # about 24 GiB of 139 for activations (11 layers: 125.3 GiB).
    "qwen3-moe-30b-a3b-10l": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=10, num_attention_heads=32,
                                  num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                  moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936,
                                  tie_word_embeddings=False),
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=64, intermediate_size=256, vocab_size=768, tie_word_embeddings=True),
}

def model_config(preset: str, seq_len: int) -> PretrainedConfig:
    shape = dict(PRESETS[preset])
    return AutoConfig.for_model(shape.pop("model_type", "qwen2"), **shape, max_position_embeddings=max(seq_len, 4096),
                                rope_theta=1e6, use_cache=False)


def new_model(config: PretrainedConfig, device: torch.device, seed: int, attn: str) -> torch.nn.Module:
    torch.manual_seed(seed)  # every side and every rank starts from the same weights
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn).float().train()


def make_steps(args, vocab_size: int) -> list[list[dict]]:
    """steps x samples (the global batch of each step); the same on every rank."""
    gen = torch.Generator().manual_seed(args.seed)

    def sample() -> dict:
        n = int(torch.randint(args.seq_len // 4, args.seq_len + 1, (), generator=gen))
        return random_sample(n // 4, n - n // 4, vocab_size, gen)

    return [[sample() for _ in range(args.micro_batch * args.micro_batches)] for _ in range(args.warmup + args.steps)]


def chunks(samples: list, size: int) -> list[list]:
    return [samples[i : i + size] for i in range(0, len(samples), size)]


def pad(samples: list[dict], pad_id: int = 0) -> dict:
    """[B, longest] with right padding and an attention mask (what a plain HF trainer feeds)."""
    longest = max(len(s["input_ids"]) for s in samples)

    def stack(key, value):
        return torch.stack([torch.cat([s[key], torch.full((longest - len(s[key]),), value, dtype=s[key].dtype)]) for s in samples])

    return {
        "input_ids": stack("input_ids", pad_id),
        "attention_mask": (torch.arange(longest)[None] < torch.tensor([len(s["input_ids"]) for s in samples])[:, None]).long(),
        "loss_mask": stack("loss_mask", False), "advantages": stack("advantages", 0.0),
        "behaviour_logprobs": stack("behaviour_logprobs", 0.0),
        "position_ids": torch.arange(longest).expand(len(samples), longest),
    }


def model_flops(config: PretrainedConfig, n_params: int, steps: list[list[dict]]) -> float:
    lengths = torch.tensor([len(s["input_ids"]) for step in steps for s in step], dtype=torch.float64)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    d_attn = config.num_attention_heads * head_dim
    return 6 * n_params * float(lengths.sum()) + 12 * config.num_hidden_layers * d_attn * float((lengths**2).sum())


def non_embedding_params(model: torch.nn.Module) -> int:
    """Parameters a token's forward multiplies by: without the input embedding (a lookup), and for an
    MoE only top_k / experts of each layer's expert weights (the active parameters)."""
    embedding = model.get_input_embeddings().weight
    n = sum(p.numel() for p in model.parameters() if p is not embedding)
    if moe := experts_of(model):
        experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        n -= experts - experts * moe[1] // moe[0]
    # A tied LM head is still a [vocab, hidden] matmul per token: count it once.
    return n + (embedding.numel() if model.get_output_embeddings().weight is embedding else 0)


def rank_share(step: list[dict], micro_batch: int) -> list[dict]:
    """This rank's packed micro-batches of a global step (contiguous share, like the orchestrator)."""
    mbs = chunks(step, micro_batch)
    per_rank = len(mbs) // dist.get_world_size()
    mine = mbs[dist.get_rank() * per_rank : (dist.get_rank() + 1) * per_rank]
    return [pack(samples) for samples in mine]


def experts_of_config(config: PretrainedConfig) -> tuple[int, int] | None:
    experts, top_k = getattr(config, "num_experts", None), getattr(config, "num_experts_per_tok", None)
    return (experts, top_k) if experts and top_k else None
