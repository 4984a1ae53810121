"""Reverse a text character by character; reward = similarity of the completion to the reversed text.

    orchestrator.environment: {id: prl.envs.reverse_text, args: {}}
    args: {dataset_name: PrimeIntellect/Reverse-Text-RL, text_key: prompt}   # a hub dataset instead

Trains on `dataset_split` (default train) and keeps `eval_split` (default test) as its held-out
`eval_dataset` for evals, loaded only when an eval asks; with the shipped sample (200 sentences)
test is the last 40 and train the other 160. `eval_split: null` for a hub dataset without one.

Similarity is difflib's ratio 2*M/(len(a)+len(b)) (M = characters in matching blocks, close to the
longest common subsequence): dense, 1.0 only for the exact reversal, and partial credit for
partly right answers, which is what gives small models a gradient to follow.
"""

from __future__ import annotations

import difflib

import verifiers as vf
from datasets import Dataset

from prl.envs.common import check_arg, check_count, check_optional_str, completion_text, limit, load_rows

SYSTEM_PROMPT = "Reverse the given text character by character. Answer with the reversed text only."


def similarity(completion: str, target: str) -> float:
    """difflib ratio in [0, 1]; autojunk off, or frequent characters of long texts would be ignored."""
    if not completion and not target:
        return 1.0
    return difflib.SequenceMatcher(None, completion, target, autojunk=False).ratio()


def reversal_reward(completion, answer: str, **kwargs) -> float:
    return similarity(completion_text(completion).strip(), answer)


def load_environment(
    dataset_name: str | None = None,
    dataset_config: str | None = None,
    dataset_split: str = "train",
    text_key: str = "text",
    num_examples: int = -1,
    system_prompt: str = SYSTEM_PROMPT,
    eval_split: str | None = "test",
) -> vf.Environment:
    check_optional_str(dataset_name, "dataset_name")
    check_optional_str(dataset_config, "dataset_config")
    check_optional_str(dataset_split, "dataset_split")
    check_optional_str(text_key, "text_key")
    check_optional_str(eval_split, "eval_split")
    check_count(num_examples, "num_examples")
    check_arg(isinstance(system_prompt, str), "system_prompt", f"must be a string, got {system_prompt!r}")

    def examples(split: str, arg: str) -> Dataset:
        rows = load_rows(dataset_name, dataset_config, split, "reverse_text.jsonl", arg)
        rows = limit(rows, num_examples) if arg == "dataset_split" else rows
        check_arg(bool(rows) and text_key in rows[0], "text_key", f"{text_key!r} is not a column of the dataset")
        texts = [str(row[text_key]).strip() for row in rows]
        return Dataset.from_list([{"question": t, "answer": t[::-1]} for t in texts])

    held_out = (lambda: examples(eval_split, "eval_split")) if eval_split else None
    return vf.SingleTurnEnv(dataset=examples(dataset_split, "dataset_split"), eval_dataset=held_out,
                            system_prompt=system_prompt, rubric=vf.Rubric(funcs=[reversal_reward]))
