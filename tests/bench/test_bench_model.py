"""benchmarks/bench_model.py: the benchmark tokenizer decodes every id and round-trips text.

    pytest tests/bench/test_bench_model.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_model import PRESETS, SPECIAL_TOKENS, build_tokenizer  # noqa: E402


def test_tokenizer_has_exactly_the_models_vocabulary_and_every_id_decodes():
    size = PRESETS["qwen2-0.5b"]["vocab_size"]
    tok = build_tokenizer(size)
    assert len(tok) == size
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS[-1]) == tok.eos_token_id == size - 1
    ids = list(range(0, size - len(SPECIAL_TOKENS), 997))
    assert all(isinstance(tok.decode([i]), str) for i in ids)
    assert [tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(i)) for i in ids] == ids


def test_text_round_trips_and_chat_template_renders():
    tok = build_tokenizer(1000)
    for text in ["Write some text. (3)", "unicode: é ✓ 你好", "  spaces\nand\ttabs  "]:
        assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
