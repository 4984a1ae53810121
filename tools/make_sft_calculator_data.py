"""Writes prl/envs/data/sft_calculator.jsonl (configs/sft_calculator.yaml): prl.envs.calculator's task
solved the way its tool is meant to be used: the model calls add(a, b), reads the result, answers.

    python tools/make_sft_calculator_data.py      # the same bytes on every run (seed 0)

Each row holds its `tools` (the schema prl.envs.calculator gives the model, as verifiers sends it) and
its `messages` (system, user, the assistant's call, the tool's result, the answer): SFT teaches a model
the tool-call format of its chat template before RL (docs/tools.md).
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "prl/envs/data/sft_calculator.jsonl"
ROWS = 512


def main() -> None:
    from prl.envs.calculator import SYSTEM_PROMPT, openai_tools

    tools, rng, lines = openai_tools(), random.Random(0), []
    for i in range(ROWS):
        a, b = rng.randrange(50), rng.randrange(50)
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"What is {a} + {b}?"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{i}", "content": str(a + b)},
                    {"role": "assistant", "content": f"= {a + b}"}]
        lines.append(json.dumps({"tools": tools, "messages": messages}))
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT} ({ROWS} conversations)")


if __name__ == "__main__":
    main()
