"""Writes prl/envs/data/sft_toy.jsonl, the toy SFT data (configs/sft_toy.yaml): the toy task's
prompts (prl.envs.toy) answered with vowel-only words, the answers its reward scores highest.

    python tools/make_sft_toy_data.py            # the same bytes on every run (seed 0)
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "prl/envs/data/sft_toy.jsonl"
ROWS = 256


def main() -> None:
    rng = random.Random(0)
    lines = []
    for i in range(ROWS):
        words = ["".join(rng.choice("aeiou") for _ in range(rng.randint(2, 5))) for _ in range(rng.randint(2, 4))]
        messages = [{"role": "user", "content": f"Write some text. ({i})"},
                    {"role": "assistant", "content": " ".join(words)}]
        lines.append(json.dumps({"messages": messages}))
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT} ({ROWS} conversations)")


if __name__ == "__main__":
    main()
