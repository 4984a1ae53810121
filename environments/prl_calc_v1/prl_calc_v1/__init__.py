"""prl's calculator (prl/envs/calculator.py) as a verifiers v1 taskset: add two numbers, with an `add`
tool the model may call first (as `calc_add`).

    orchestrator.environment: {id: prl_calc_v1, api: v1, renderer: {name: qwen3, enable_thinking: false}}

The tool is a v1 `Toolset` (prl_calc_v1.tools), shared by the taskset's episodes: the worker starts its
MCP server once, in the worker's own Python, and prl's chat harness (prl_chat) lists its tools, sends
them with each turn and calls them with the arguments the renderer parsed from the sampled tokens. The
reward is 1 for the right sum in the last reply (`= N`), less with the distance to it.

`hermes_format: MODEL` holds each turn to a Hermes-format call of `calc_add` or an answer `= N` (vLLM's
structured outputs, a structural tag, through the taskset's `sampling_args`): for a model that does not speak
the format yet, such as the random tiny test model (docs/tools.md, "Constrained decoding").
"""

import json
import random
import re

import verifiers.v1 as vf

from prl_calc_v1.tools import CalcTools

DEFAULT_EXAMPLES = 256
EVAL_EXAMPLES = 32
SYSTEM_PROMPT = "Add the numbers; the add tool may help. Answer '= N'."
ANSWER = re.compile(r"=\s*(-?\d+)")
CALL = r'\n\{"name": "calc_add", "arguments": \{"a": [0-9]{1,2}, "b": [0-9]{1,2}\}\}\n'


def hermes_format(model: str) -> str:
    """One turn, as xgrammar's structural tag: a call as the Qwen3 (Hermes) renderer parses it, or an
    answer. Not a regex: the renderer finds calls by the ids of the special tokens `<tool_call>` and
    `</tool_call>`, and a regex cannot tell those tokens from the same text spelled in characters (under
    one, the tiny model spelled every call out and none was parsed). The tag names the tokens by id
    (vLLM checks a tag without the tokenizer, so not by their text): read from `model`'s tokenizer."""
    from transformers import AutoTokenizer

    start, end = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    call = [{"type": "token", "token": start}, {"type": "regex", "pattern": CALL}, {"type": "token", "token": end}]
    answer = {"type": "regex", "pattern": "= [0-9]{1,3}"}
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "or", "elements": [{"type": "sequence", "elements": call}, answer]}})


class CalcData(vf.TaskData):
    a: int
    b: int


class CalcTask(vf.Task[CalcData]):
    @vf.reward(weight=1.0)
    async def closeness(self, trace: vf.Trace) -> float:
        """1 for the sum in the last reply, 1 / (1 + distance) otherwise, 0 without an answer."""
        found = ANSWER.findall(trace.last_reply or "")
        return 1.0 / (1.0 + abs(int(found[-1]) - (self.data.a + self.data.b))) if found else 0.0

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(sum(m.role == "tool" for m in trace.messages))


class CalcConfig(vf.TasksetConfig):
    num_examples: int = DEFAULT_EXAMPLES
    """Training problems (two numbers below 50 each)."""
    split: str = "train"
    """train, or eval: EVAL_EXAMPLES problems drawn from a stream of their own."""
    seed: int = 0
    """The problems' seed."""
    hermes_format: str | None = None
    """The model (its directory or hub id) whose turns to constrain to a call or an answer (see
    `hermes_format()`): for a model that cannot call tools yet. None: unconstrained."""
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    """Where the tool server runs: the worker's own Python (subprocess runtime), the default."""


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    @classmethod
    def toolsets(cls, config: CalcConfig) -> list[vf.Toolset]:
        return [CalcTools(config.tools)]

    @property
    def sampling_args(self) -> dict:
        """Read by prl's environment worker, as a classic environment's `sampling_args` are."""
        if self.config.hermes_format is None:
            return {}
        return {"extra_body": {"structured_outputs": {"structural_tag": hermes_format(self.config.hermes_format)}}}

    def load(self) -> list[CalcTask]:
        held_out = self.config.split == "eval"
        rng = random.Random(f"{self.config.seed}:{'eval' if held_out else 'train'}")
        tasks = []
        for _ in range(EVAL_EXAMPLES if held_out else self.config.num_examples):
            a, b = rng.randrange(50), rng.randrange(50)
            data = CalcData(prompt=f"What is {a} + {b}?", system_prompt=SYSTEM_PROMPT, a=a, b=b)
            tasks.append(CalcTask(data, self.config.task))
        return tasks


__all__ = ["CalcTaskset"]
