"""A Qwen-shaped model (dense or MoE) with random weights and a tokenizer that covers its whole vocabulary.

    python benchmarks/bench_model.py --preset qwen2-1.5b --out /tmp/models/qwen2-1.5b

For GPU machines without a model hub. A random policy samples every id of the vocabulary about
equally often, so the tokenizer must decode every one of them (151,936 for Qwen2.5 and Qwen3) and its text must
encode back: a byte-level BPE whose vocabulary is the 256 byte symbols, every pair of them and then
byte triples, built from merges directly (no training, no corpus). Special tokens and chat template
are Qwen's (eos `<|im_end|>`), so prompts render the way the real model's would. Weights: transformers'
own initialisation (std 0.02), on the GPU when there is one, saved in bf16.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

from bench_shapes import QWEN25  # beside this script

PRESETS = {
    **QWEN25,  # Qwen2.5-0.5B / -1.5B / -7B
    # Qwen3-30B-A3B's layer (128 experts of width 768, top-8) cut from 48 to 4 layers, so that vLLM and
    # the trainer share one GPU (issue 52's loop): 3.11B parameters, 0.85B active.
    "qwen3-moe-30b-a3b-4l": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
                                 num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                 moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936,
                                 tie_word_embeddings=False),
    # Its dense twin: the same attention and active width (an MLP of 8 x 768), 0.85B parameters.
    "qwen3-dense-a3b-4l": dict(model_type="qwen3", hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
                               num_key_value_heads=4, head_dim=128, intermediate_size=6144, vocab_size=151936,
                               tie_word_embeddings=False),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def byte_bpe(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of exactly vocab_size - len(SPECIAL_TOKENS) tokens: bytes, byte pairs, byte triples."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    size = vocab_size - len(SPECIAL_TOKENS)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    pairs = [(a, b) for a, b in itertools.product(alphabet, alphabet)]
    # Every pair before any triple: a triple's merge needs its pair to exist (and to rank lower).
    triples = ((a + b, c) for (a, b), c in itertools.product(pairs, alphabet))
    merges = []
    for left, right in itertools.chain(pairs, triples):
        if len(vocab) >= size:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    return vocab, merges


def build_tokenizer(vocab_size: int):
    """A transformers tokenizer with exactly `vocab_size` ids, every one decodable."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = byte_bpe(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, model_max_length=32768)


def save_random_model(preset: str, tokenizer, out: Path) -> None:
    """Random bf16 weights of `preset`, initialised on the GPU when there is one (minutes less for 7B)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    shape = dict(PRESETS[preset])
    config = AutoConfig.for_model(shape.pop("model_type", "qwen2"), **shape, max_position_embeddings=32768,
                                  rope_theta=1e6, bos_token_id=None, eos_token_id=eos, pad_token_id=pad, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    # No sampling defaults: vLLM would apply them to every request that does not set its own.
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out)


def build(preset: str, out: Path) -> Path:
    """Tokenizer + config + weights into `out` (skipped when `out` already holds this preset)."""
    stamp = out / "bench_model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == {"preset": preset}:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(PRESETS[preset]["vocab_size"])
    tokenizer.save_pretrained(out)
    save_random_model(preset, tokenizer, out)
    stamp.write_text(json.dumps({"preset": preset}) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    build(args.preset, args.out)
    print(f"{args.preset} written to {args.out} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
