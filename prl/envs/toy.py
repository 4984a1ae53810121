"""Toy task a randomly initialised tiny model learns in a few dozen RL steps on CPU.

    orchestrator.environment: {id: prl.envs.toy, args: {target_chars: aeiou}}
    orchestrator.environment: {id: prl.envs.toy, args: {pass_fraction: 0.4}}   # pass/fail: 1 or 0

Reward = fraction of the completion's characters that are in `target_chars` (0 for an empty one).
Why this is learnable from scratch: the reward is dense and context-free. A random policy samples
tokens almost uniformly, and byte-level BPE tokens carry different amounts of the target characters
(with the default vowels: ~20% of sampled characters at step 0), so 8 rollouts of one prompt always
differ in reward and group-relative advantages are never all zero. Raising it needs only a shift of
unigram preferences (the LM-head/embedding rows of vowel-rich tokens such as "a", "e", "ou"), the
easiest thing for policy gradient to move; the prompt is irrelevant. Measured on the tiny Qwen2 of
tools/make_tiny_model.py with prl's own trainer, vLLM and orchestrator on 2 CPU cores (trainer.lr 3e-3,
async_level 1, 8 x 8 rollouts of 24 tokens per step): mean reward 0.27 -> 0.72 in 30 steps, ~2.5 min.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

from prl.envs.common import check_arg, check_count, completion_text

DEFAULT_EXAMPLES = 512


def target_fraction(text: str, target_chars: str) -> float:
    """Share of `text`'s characters found in `target_chars`."""
    if not text:
        return 0.0
    targets = set(target_chars)
    return sum(ch in targets for ch in text) / len(text)


EVAL_EXAMPLES = 64
"""Prompts of the eval split (`eval_dataset`), none of them a training prompt."""


def _prompts(num_examples: int, tag: str = "") -> list[dict]:
    # Distinct prompts only so that groups are distinct examples; the task ignores them.
    return [{"question": f"Write some text. ({tag}{i})", "answer": ""} for i in range(num_examples)]


def load_environment(target_chars: str = "aeiou", num_examples: int = DEFAULT_EXAMPLES,
                     pass_fraction: float | None = None) -> vf.Environment:
    """`pass_fraction`: reward 1 when at least this share of the characters are targets, else 0 (a
    pass/fail task: groups with equal rewards happen, the case of orchestrator.refill_max_prompts)."""
    ok = isinstance(target_chars, str) and target_chars != ""
    check_arg(ok, "target_chars", f"must be a non-empty string, got {target_chars!r}")
    check_count(num_examples, "num_examples")
    ok = pass_fraction is None or (isinstance(pass_fraction, (int, float)) and 0 < pass_fraction <= 1)
    check_arg(ok, "pass_fraction", f"must be a number in (0, 1], got {pass_fraction!r}")
    num_examples = DEFAULT_EXAMPLES if num_examples == -1 else num_examples

    def target_char_fraction(completion, **kwargs) -> float:
        share = target_fraction(completion_text(completion), target_chars)
        return share if pass_fraction is None else float(share >= pass_fraction)

    dataset = Dataset.from_list(_prompts(num_examples))
    held_out = Dataset.from_list(_prompts(EVAL_EXAMPLES, "eval "))
    return vf.SingleTurnEnv(dataset=dataset, eval_dataset=held_out, rubric=vf.Rubric(funcs=[target_char_fraction]))
