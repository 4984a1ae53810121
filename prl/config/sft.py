"""The `sft` section: a supervised fine-tuning job (trainer only) instead of an RL run."""

from __future__ import annotations

from dataclasses import dataclass

from prl.config.common import _check, _positive, _single_line

DATA_FORMATS = (".jsonl", ".json", ".parquet")
"""Files `sft.data` may name; a directory is a `datasets` dataset saved with save_to_disk."""


@dataclass(kw_only=True)
class SftConfig:
    data: str
    """Chat-format training data: a .jsonl/.json or .parquet file, or a directory written by
    `datasets.Dataset.save_to_disk`; each row holds a list of {role, content} messages."""
    messages_key: str = "messages"
    """The column that holds each row's messages."""
    tools_key: str = "tools"
    """The column that holds a row's tool schemas (OpenAI format), rendered by the chat template as an
    RL rollout's are; a row without it has no tools."""
    batch_size: int = 32
    """Conversations per optimizer step (all ranks together)."""
    shuffle: bool = True
    """A new order of the rows in every pass over the data (from run.seed and the pass number);
    false: the rows in file order, pass after pass."""

    def __post_init__(self) -> None:
        _check(bool(self.data) and "\0" not in self.data, "sft.data", "must be a path")
        _single_line(self.data, "sft.data")
        _check(bool(self.messages_key), "sft.messages_key", "must be set")
        _check(bool(self.tools_key), "sft.tools_key", "must be set")
        _positive(self.batch_size, "sft.batch_size")
