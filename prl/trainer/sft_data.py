"""SFT data: chat-format rows -> token samples whose loss mask holds the assistant's tokens, and the
rows of each step in an order that depends on nothing but the config and the step.

    rows = load_rows(cfg.sft)                         # .jsonl/.json, .parquet, or a saved datasets dir
    order = DataOrder(len(rows), cfg.sft.batch_size, cfg.run.seed, cfg.sft.shuffle)
    samples = [tokenize(tok, rows[i][key], max_len) for i in order.rows(step)]

The assistant mask comes from the chat template itself: for assistant message i, the rendering of
messages[:i] with a generation prompt must be a prefix of the rendering of messages[:i + 1], which
must be a prefix of the whole conversation; the characters between the two are the message's own
(its content and the end-of-turn tokens the template adds, which the model must learn to emit).
A template that renders earlier turns differently once later ones follow (e.g. one that drops
reasoning from history) cannot be masked this way: the row is refused, naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prl.config.sft import SftConfig
from prl.run.packing import Sample


class DataError(ValueError):
    """Training data that cannot be used as it is; the message names the row."""


def load_rows(cfg: SftConfig) -> list[dict]:
    """Every row of `sft.data`, in file order."""
    path = Path(cfg.data)
    if path.is_dir():
        import datasets

        return datasets.load_from_disk(str(path)).to_list()
    if path.suffix == ".parquet":
        import pyarrow.parquet

        return pyarrow.parquet.read_table(path).to_pylist()
    text = path.read_text()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@dataclass(frozen=True)
class DataOrder:
    """Step n trains on rows n*B .. (n+1)*B - 1 of an endless sequence of passes over the data, each
    pass a permutation drawn from (seed, pass) (or file order without shuffle). A function of the
    step alone: a resumed job takes up the order exactly where the checkpoint left it."""

    rows_total: int
    batch_size: int
    seed: int
    shuffle: bool

    def pass_order(self, number: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.rows_total)
        return np.random.default_rng([self.seed, number]).permutation(self.rows_total)

    def rows(self, step: int) -> list[int]:
        first, orders, out = step * self.batch_size, {}, []
        for index in range(first, first + self.batch_size):
            number, position = divmod(index, self.rows_total)
            if number not in orders:
                orders[number] = self.pass_order(number)
            out.append(int(orders[number][position]))
        return out

    def epoch(self, step: int) -> float:
        """Passes over the data completed after `step` steps."""
        return step * self.batch_size / self.rows_total


def render(tokenizer, messages: list[dict], generation_prompt: bool = False, tools: list | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages: list[dict], row: int, tools: list | None = None) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation's text, the character spans of its assistant messages)."""
    full = render(tokenizer, messages, tools=tools)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render(tokenizer, messages[:i], generation_prompt=True, tools=tools)
        through = render(tokenizer, messages[: i + 1], tools=tools)
        if not (through.startswith(before) and full.startswith(through)):
            raise DataError(f"row {row}: the chat template renders the turns before message {i} differently once "
                            "later messages follow, so its assistant tokens cannot be told apart")
        spans.append((len(before), len(through)))
    return full, spans


def tokenize(tokenizer, messages, max_len: int, row: int, tools=None) -> tuple[Sample, bool]:
    """(the sample, whether it was cut to `max_len` tokens): loss on the assistant messages' tokens;
    `tools`: the row's tool schemas, rendered by the chat template."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError(f"row {row}: messages must be a list of {{role, content}} objects")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"row {row}: tools must be a list of OpenAI tool objects")
    text, spans = assistant_spans(tokenizer, messages, row, tools or None)
    if not spans:
        raise DataError(f"row {row}: no assistant message, nothing to learn")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    mask = [any(lo <= start < hi for lo, hi in spans) for start, _ in offsets]
    cut = len(ids) > max_len
    ids, mask = ids[:max_len], mask[:max_len]
    return Sample(list(ids), mask, [0.0] * len(ids), 0.0), cut
