"""Helpers shared by the environments: argument checks, the shipped samples, HF datasets, completion text."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


class EnvArgError(ValueError):
    """An environment argument that cannot work; the message names the argument (the orchestrator
    puts the config path of the environment in front: orchestrator.environments[1].args.NAME)."""

    def __init__(self, arg: str, message: str):
        super().__init__(f"orchestrator.environment.args.{arg}: {message}")
        self.arg, self.message = arg, message


def check_arg(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise EnvArgError(name, message)


def check_count(value: Any, name: str) -> None:
    """`num_examples`-style limits: -1 (all) or a positive int (bool is an int, but never meant)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and (value == -1 or value > 0)
    check_arg(ok, name, f"must be -1 (all) or a positive integer, got {value!r}")


def check_optional_str(value: Any, name: str) -> None:
    ok = value is None or (isinstance(value, str) and value != "")
    check_arg(ok, name, f"must be a non-empty string, got {value!r}")


def read_sample(filename: str) -> list[dict]:
    """Rows of `prl/envs/data/<filename>` (JSON lines), shipped with the package."""
    text = resources.files("prl.envs").joinpath("data", filename).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


SAMPLE_SPLITS = ("train", "test")
"""The shipped samples' splits: test is the last fifth of the rows (held out for evals), train the rest."""


def sample_split(rows: list[dict], split: str, arg: str) -> list[dict]:
    check_arg(split in SAMPLE_SPLITS, arg, f"the shipped sample has the splits {', '.join(SAMPLE_SPLITS)}; got {split!r}")
    held_out = len(rows) - len(rows) // 5
    return rows[held_out:] if split == "test" else rows[:held_out]


def load_rows(dataset_name: str | None, dataset_config: str | None, split: str, sample: str,
              arg: str = "dataset_split") -> list[dict]:
    """The named HF dataset split (needs hub access or a local HF cache), else that split of the
    shipped sample; `arg` is the argument that named the split."""
    if dataset_name is None:
        return sample_split(read_sample(sample), split, arg)
    from datasets import load_dataset

    return load_dataset(dataset_name, dataset_config, split=split).to_list()


def limit(rows: list[dict], num_examples: int) -> list[dict]:
    return rows if num_examples == -1 else rows[:num_examples]


def completion_text(completion: Any) -> str:
    """Text of the last assistant message (chat) or the completion itself (str); '' if none."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion or []):
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
        if role == "assistant":
            content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
            return content if isinstance(content, str) else ""
    return ""
