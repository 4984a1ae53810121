"""Add two numbers, with an `add` tool the model may call before it answers (verifiers' ToolEnv;
StatefulToolEnv with `stateful: true`).

    orchestrator.environment: {id: prl.envs.calculator, args: {max_turns: 3}}
    inference.tool_call_parser: hermes     # vLLM's parser of the model family's tool calls (Qwen2.5: hermes)

A rollout ends at the model's first turn without a tool call, or after `max_turns` turns; each call's
result comes back as a tool message, outside the loss mask. Reward: 1 - |n - (a + b)| / 100 (at least
0) for the first number n of the last answer, 0 without one: graded, so a random policy's rollouts differ.

`stateful: true`: the tool also takes a hidden `calls`, the rollout's count of calls so far, put in by
the environment (StatefulToolEnv.update_tool_args) and never shown to the model.

`hermes_format: true` constrains each turn (vLLM's structured outputs, a regex) to a Hermes-format call
of add or an answer "= N": for a model that does not speak its tool-call format yet, such as the random
tiny test model (tools/make_tiny_model.py), which then calls the tool in about a quarter of its turns.
"""

from __future__ import annotations

import random
import re

import verifiers as vf
from datasets import Dataset

from prl.envs.common import check_arg, check_count, completion_text

DEFAULT_EXAMPLES = 256
SYSTEM_PROMPT = "Add the numbers; the add tool may help. Answer '= N'."
HERMES_REGEX = (r'(<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9]{1,2}, "b": [0-9]{1,2}\}\}\n</tool_call>'
                r"|= [0-9]{1,3})")
"""One turn under `hermes_format`: the call as the hermes parser reads it, or an answer."""


SCHEMA = vf.Tool(name="add", description="a + b", strict=True, parameters={
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False})
"""The tool as the model sees it: the schema verifiers derives from `add` less its titles, which cost the
tiny model's character-level tokenizer a hundred prompt tokens."""


def add(a: int, b: int) -> int:
    return a + b


def add_counted(a: int, b: int, calls: int) -> str:
    """`calls`: the rollout's calls so far, the environment's argument, not the model's."""
    return f"{a + b} (call {calls})"


add_counted.__name__ = "add"


def openai_tools() -> list[dict]:
    """The tools as a rollout's requests carry them (verifiers' OpenAI client): the SFT data's schema."""
    return [{"type": "function", "function": {"name": SCHEMA.name, "description": SCHEMA.description,
                                              "parameters": SCHEMA.parameters, "strict": SCHEMA.strict}}]


class CountingCalculator(vf.StatefulToolEnv):
    """The StatefulToolEnv variant: `calls` is the environment's, per rollout."""

    def __init__(self, **kwargs):
        super().__init__(tools=[], **kwargs)
        self.add_tool(add_counted, args_to_skip=["calls"])
        self.tool_defs = [SCHEMA]

    def update_tool_args(self, tool_name, tool_args, messages, state, **kwargs) -> dict:
        state["calls"] = state.get("calls", 0) + 1
        return {**tool_args, "calls": state["calls"]}


def closeness(completion, answer: str, **kwargs) -> float:
    """1 - |n - answer| / 100 for the first number n of the last assistant message, at least 0."""
    assistant = [m for m in completion or [] if (m.get("role") if isinstance(m, dict) else m.role) == "assistant"]
    found = re.search(r"-?[0-9]+", completion_text(assistant[-1:])) if assistant else None
    return max(0.0, 1.0 - abs(int(found.group()) - int(answer)) / 100) if found else 0.0


def load_environment(max_turns: int = 3, num_examples: int = DEFAULT_EXAMPLES, stateful: bool = False,
                     hermes_format: bool = False, seed: int = 0) -> vf.Environment:
    ok = isinstance(max_turns, int) and not isinstance(max_turns, bool) and max_turns > 0
    check_arg(ok, "max_turns", f"must be a positive integer, got {max_turns!r}")
    check_count(num_examples, "num_examples")
    for name, value in (("stateful", stateful), ("hermes_format", hermes_format)):
        check_arg(isinstance(value, bool), name, f"must be true or false, got {value!r}")
    check_arg(isinstance(seed, int) and not isinstance(seed, bool), "seed", f"must be an integer, got {seed!r}")
    rng = random.Random(seed)
    rows = []
    for _ in range(DEFAULT_EXAMPLES if num_examples == -1 else num_examples):
        a, b = rng.randrange(50), rng.randrange(50)
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    sampling = {"extra_body": {"structured_outputs": {"regex": HERMES_REGEX}}} if hermes_format else {}
    common = dict(dataset=Dataset.from_list(rows), system_prompt=SYSTEM_PROMPT, max_turns=max_turns,
                  rubric=vf.Rubric(funcs=[closeness]), sampling_args=sampling)
    env = CountingCalculator(**common) if stateful else vf.ToolEnv(tools=[add], **common)
    env.tool_defs = [SCHEMA]
    return env
