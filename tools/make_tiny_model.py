"""Build the tiny offline test model: a random-init causal LM with its own byte-level BPE tokenizer.

    python tools/make_tiny_model.py --out .cache/tiny-qwen2     # what tools/setup.sh runs
    python tools/make_tiny_model.py --family qwen3_moe --out .cache/tiny-qwen3-moe   # docs/moe.md
    python tools/make_tiny_model.py --family mixtral --out .cache/tiny-mixtral
    python tools/make_tiny_model.py --family qwen2_moe --out .cache/tiny-qwen2-moe
    python tools/make_tiny_model.py --family qwen3 --out .cache/tiny-qwen3   # v1 multi-turn (docs/environments.md)

Families (FAMILIES): qwen2 (dense, the default), three mixture-of-experts ones that both vLLM's CPU build
and transformers run: qwen3_moe (8 experts, top-2), mixtral (8 experts, top-2; its checkpoint names
differ from transformers' in-memory ones by more than the experts' fusion) and qwen2_moe (8 experts,
top-2, and a shared expert with its own gate), and qwen3 (dense), whose
tokenizer also holds Qwen3's tool and thinking tokens as special tokens and no unknown token: what the
`renderers` package's Qwen3 renderer needs to render and bridge a conversation's turns as token ids
(verifiers v1 multi-turn, docs/environments.md). The others share one tokenizer.

Compute nodes and CI cannot reach a model hub, so tests and toy runs use this model. Everything comes
from the repo: the tokenizer is trained on `tools/data/tiny_corpus.txt` (English, digits, reversed
text, arithmetic with \\boxed{}), the weights from a fixed seed. Same recipe -> same files, byte for byte.

The model is built in a sibling temporary directory and renamed into place, then stamped with the
recipe (`prl_recipe.json`): re-running with an unchanged recipe is a no-op; a changed recipe rebuilds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"
STAMP = "prl_recipe.json"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's split pattern: digits one by one (arithmetic stays tokenizable), words with a leading space.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Without tools: each message as <|im_start|>ROLE\nCONTENT<|im_end|>\n. With tools, Qwen2.5's layout: a
# system block listing them (after the first system message's text), an assistant's calls as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> (vLLM's hermes parser reads them), a run of
# tool results as one user message of <tool_response> blocks.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(first=0) %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- set ns.first = 1 %}{%- endif %}"
    "{{- 'Tools:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[ns.first:] %}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set call = call['function'] if call['function'] is defined else call %}"
    "{%- set arguments = call['arguments'] if call['arguments'] is string else (call['arguments'] | tojson) %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' + arguments + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- set previous = messages[ns.first:][loop.index0 - 1]['role'] if not loop.first else '' %}"
    "{%- if previous != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[ns.first:][loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Bump "version" whenever the code below changes what gets written; the stamp then forces a rebuild.
RECIPE = {
    "version": 2,
    "vocab_size": 768,
    "min_frequency": 2,
    # head_dim = 128 / 4 = 32: vLLM's CPU attention needs head_dim >= 32.
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "seed": 0,
}
FAMILIES = {
    "qwen2": {},
    # head_dim is explicit: Qwen3's default (128) is not hidden_size / heads.
    "qwen3": {"head_dim": 32},
    "qwen3_moe": {"head_dim": 32, "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
                  "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64},
    # Qwen2-MoE: routed experts beside a shared expert with its own sigmoid gate.
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 64, "norm_topk_prob": True},
}
"""--family -> what its config adds to (or changes in) RECIPE."""
FAMILY_SPECIAL_TOKENS = {"qwen3": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]}
"""--family -> special tokens beyond SPECIAL_TOKENS (they take the place of merges: vocab_size stays)."""


def recipe_stamp(family: str = "qwen2") -> dict:
    """The recipe plus hashes of the corpus and the chat template: what decides the output. The dense
    family's stamp is the one it always had (its built models stay current)."""
    extra = {} if family == "qwen2" else {"family": family, **FAMILIES[family]}
    if family in FAMILY_SPECIAL_TOKENS:
        extra["special_tokens"] = FAMILY_SPECIAL_TOKENS[family]
    return {**RECIPE, **extra, "corpus_sha256": hashlib.sha256(CORPUS.read_bytes()).hexdigest(),
            "chat_template_sha256": hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()}


def is_current(out: Path, family: str = "qwen2") -> bool:
    """True when `out` holds a finished model built from this very recipe."""
    try:
        return json.loads((out / STAMP).read_text()) == recipe_stamp(family)
    except (OSError, ValueError):
        return False


def train_tokenizer(family: str = "qwen2"):
    """Byte-level BPE over the corpus, Qwen-style pre-tokenization and chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=RECIPE["vocab_size"],
        min_frequency=RECIPE["min_frequency"],
        special_tokens=SPECIAL_TOKENS + FAMILY_SPECIAL_TOKENS.get(family, []),
        # All 256 byte symbols, seen in the corpus or not: any text stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=RECIPE["max_position_embeddings"],
    )


def build_model(tokenizer, family: str = "qwen2"):
    """Random model of `family` in float32 from the fixed seed, sized to the tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    keys += ("num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")
    config = AutoConfig.for_model(
        family, vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=eos, pad_token_id=pad, dtype="float32",
        **{k: RECIPE[k] for k in keys} | FAMILIES[family],
    )
    torch.manual_seed(RECIPE["seed"])
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    # Only token ids, no sampling defaults: vLLM would apply a temperature/top_p found here to every
    # request that does not set its own, silently changing rollouts.
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    return model


def _portable_tokenizer_class(path: Path, family: str = "qwen2") -> None:
    """transformers 5 writes `TokenizersBackend`, unknown to 4.x; the 4.x name loads the same tokenizer.json.
    Families with their own special tokens say "no unknown token", as Qwen's own tokenizers do: loaded as
    Qwen2Tokenizer, <|endoftext|> (id 0) would otherwise be the unknown token, which renderers refuse."""
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if family in FAMILY_SPECIAL_TOKENS:
        config["unk_token"] = None
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def _readable(path: Path) -> None:
    """mkdtemp and safetensors create owner-only files; a shared cache must be readable by the group."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    for f in path.iterdir():
        f.chmod(0o666 & ~umask)


def build(out: Path, family: str = "qwen2") -> None:
    """Write tokenizer + model + stamp into a temporary sibling of `out`, then rename it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tokenizer = train_tokenizer(family)
        tokenizer.save_pretrained(tmp)
        _portable_tokenizer_class(tmp, family)
        build_model(tokenizer, family).save_pretrained(tmp)
        (tmp / STAMP).write_text(json.dumps(recipe_stamp(family), indent=2) + "\n")
        _readable(tmp)
        if out.exists():
            shutil.rmtree(out)  # only reached for a stamped (ours) but stale model, see main()
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/tiny-qwen2"), help="model directory")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen2", help="model architecture")
    args = parser.parse_args(argv)
    out, family = args.out.resolve(), args.family
    if is_current(out, family):
        print(f"tiny model up to date: {out}")
        return 0
    if out.exists() and any(out.iterdir()) and not (out / STAMP).exists():
        # Not built by this script: never delete what we did not write.
        print(f"error: {out} exists, is not empty and holds no {STAMP}; choose another --out", file=sys.stderr)
        return 1
    try:
        build(out, family)
    except OSError:
        # A concurrent builder may have renamed its identical result into place first.
        if not is_current(out, family):
            raise
    print(f"tiny model written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
