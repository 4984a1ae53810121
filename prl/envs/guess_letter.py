"""Guess a secret letter in up to `max_turns` turns; after each wrong guess the environment says
whether the secret comes earlier or later in the alphabet.

    orchestrator.environment: {id: prl.envs.guess_letter, args: {max_turns: 3}}

A multi-turn environment (verifiers MultiTurnEnv): the rollout is the model's turns and the
environment's replies in one sequence, the replies masked out of the loss. Reward: 1 for the secret,
else 1 - (alphabet distance of the last guess) / 25, so a random policy gets a graded signal. A guess is
the first ASCII letter of the answer, case-insensitive; an answer without one scores 0.

It exists to test multi-turn rollouts end to end (tests/integration/test_orchestrator_vllm.py): a random tiny
model emits arbitrary bytes, and every turn must continue from the earlier turns' token ids.
"""

from __future__ import annotations

import random
import string

import verifiers as vf
from datasets import Dataset

from prl.envs.common import check_arg, check_count, completion_text

DEFAULT_EXAMPLES = 256
SYSTEM_PROMPT = "Guess the secret lowercase letter. Answer with one letter."


def guess(text: str) -> str | None:
    """The first ASCII letter of `text`, lowercased; None without one."""
    return next((ch.lower() for ch in text if ch in string.ascii_letters), None)


def closeness(guessed: str | None, secret: str) -> float:
    if guessed is None:
        return 0.0
    return 1.0 - abs(ord(guessed) - ord(secret)) / 25


class GuessLetterEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        secret = state["answer"]
        guessed = guess(completion_text(messages))
        if guessed == secret:
            state["final_env_response"] = [vf.UserMessage(content="Correct.")]
            return state["final_env_response"]
        hint = "No letter found." if guessed is None else ("Earlier." if secret < guessed else "Later.")
        return [vf.UserMessage(content=f"{hint} Guess again.")]


def last_guess_reward(completion, answer: str, **kwargs) -> float:
    assistant = [m for m in completion or [] if (m.get("role") if isinstance(m, dict) else m.role) == "assistant"]
    return closeness(guess(completion_text(assistant[-1:])), answer) if assistant else 0.0


def load_environment(max_turns: int = 3, num_examples: int = DEFAULT_EXAMPLES, seed: int = 0) -> vf.Environment:
    ok = isinstance(max_turns, int) and not isinstance(max_turns, bool) and max_turns > 0
    check_arg(ok, "max_turns", f"must be a positive integer, got {max_turns!r}")
    check_count(num_examples, "num_examples")
    check_arg(isinstance(seed, int) and not isinstance(seed, bool), "seed", f"must be an integer, got {seed!r}")
    count = DEFAULT_EXAMPLES if num_examples == -1 else num_examples
    rng = random.Random(seed)
    rows = [{"question": f"Round {i}: which letter?", "answer": rng.choice(string.ascii_lowercase)} for i in range(count)]
    return GuessLetterEnv(dataset=Dataset.from_list(rows), system_prompt=SYSTEM_PROMPT, max_turns=max_turns,
                          rubric=vf.Rubric(funcs=[last_guess_reward]))
