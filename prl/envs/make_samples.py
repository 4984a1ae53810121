"""Generate the datasets shipped in `prl/envs/data/` (model hubs are unreachable from many clusters).

    python -m prl.envs.make_samples          # rewrites prl/envs/data/{math_sample,reverse_text}.jsonl

Same code -> same files, byte for byte (fixed seed); tests/unit/test_envs.py checks the shipped files match.
- math_sample.jsonl: 100 MATH-format problems (problem, solution with a final \\boxed{}, answer, level,
  type) built with exact arithmetic (`fractions.Fraction`), so every answer is right by construction.
- reverse_text.jsonl: 200 short sentences ({"text": ...}) for the reverse_text environment.
"""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
PER_KIND = 10


def _frac(q: Fraction) -> str:
    """LaTeX of a rational the way MATH writes answers: integer, or \\frac{p}{q} with the sign in front."""
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def _problem(kind: str, problem: str, steps: str, answer: str) -> dict:
    solution = f"{steps} The answer is $\\boxed{{{answer}}}$."
    return {"problem": problem, "solution": solution, "answer": answer, "level": "Level 1", "type": kind}


def _arithmetic(r: random.Random) -> dict:
    a, b, c = r.randint(2, 19), r.randint(2, 19), r.randint(-30, 30)
    value = a * b + c
    steps = f"First ${a} \\times {b} = {a * b}$, then ${a * b} + ({c}) = {value}$."
    return _problem("Prealgebra", f"Compute ${a} \\times {b} + ({c})$.", steps, str(value))


def _linear(r: random.Random) -> dict:
    x, a, b = r.randint(-12, 12), r.randint(2, 9), r.randint(-20, 20)
    c = a * x + b
    steps = f"Subtract ${b}$ from both sides: ${a}x = {c - b}$. Divide by ${a}$: $x = {x}$."
    return _problem("Algebra", f"Solve for $x$: ${a}x + ({b}) = {c}$.", steps, str(x))


def _simplify_fraction(r: random.Random) -> dict:
    q = Fraction(r.randint(1, 12), r.randint(13, 25))
    k = r.randint(2, 9)
    num, den = q.numerator * k, q.denominator * k
    steps = f"Both ${num}$ and ${den}$ are divisible by ${math.gcd(num, den)}$."
    problem = f"Simplify $\\frac{{{num}}}{{{den}}}$. Express your answer as a common fraction."
    return _problem("Prealgebra", problem, steps, _frac(q))


def _add_fractions(r: random.Random) -> dict:
    p, q = Fraction(r.randint(1, 9), r.randint(2, 9)), Fraction(r.randint(1, 9), r.randint(2, 9))
    total = p + q
    steps = f"With the common denominator ${p.denominator * q.denominator}$ the sum is ${_frac(total)}$."
    problem = f"Compute ${_frac(p)} + {_frac(q)}$. Express your answer in simplest form."
    return _problem("Prealgebra", problem, steps, _frac(total))


def _power(r: random.Random) -> dict:
    a, n = r.randint(2, 9), r.randint(2, 4)
    steps = f"Multiply ${a}$ by itself ${n}$ times."
    return _problem("Prealgebra", f"What is ${a}^{{{n}}}$?", steps, str(a**n))


def _gcd(r: random.Random) -> dict:
    g = r.randint(2, 12)
    a, b = g * r.randint(2, 15), g * r.randint(2, 15)
    steps = f"Factor both numbers; the common part is ${math.gcd(a, b)}$."
    problem = f"What is the greatest common divisor of ${a}$ and ${b}$?"
    return _problem("Number Theory", problem, steps, str(math.gcd(a, b)))


def _percent(r: random.Random) -> dict:
    p, n = r.choice([10, 20, 25, 40, 50, 75]), 20 * r.randint(1, 30)
    value = p * n // 100
    steps = f"${p}\\%$ of ${n}$ is $\\frac{{{p}}}{{100}} \\cdot {n} = {value}$."
    return _problem("Prealgebra", f"What is ${p}\\%$ of ${n}$?", steps, str(value))


def _sum_to_n(r: random.Random) -> dict:
    n = r.randint(5, 60)
    steps = f"The sum $1 + 2 + \\cdots + {n}$ equals $\\frac{{{n} \\cdot {n + 1}}}{{2}}$."
    return _problem("Algebra", f"What is the sum of the integers from $1$ to ${n}$?", steps, str(n * (n + 1) // 2))


def _radical(r: random.Random) -> dict:
    k, m = r.randint(2, 7), r.choice([2, 3, 5, 6, 7])
    steps = f"$\\sqrt{{{k * k * m}}} = \\sqrt{{{k * k}}} \\cdot \\sqrt{{{m}}}$."
    return _problem("Algebra", f"Simplify $\\sqrt{{{k * k * m}}}$.", steps, f"{k}\\sqrt{{{m}}}")


def _root_sum(r: random.Random) -> dict:
    u, v = r.randint(-9, 9), r.randint(-9, 9)
    s, p = u + v, u * v
    steps = f"By Vieta's formulas the sum of the roots is ${s}$."
    problem = f"What is the sum of the roots of $x^2 - ({s})x + ({p}) = 0$?"
    return _problem("Algebra", problem, steps, str(s))


KINDS = (_arithmetic, _linear, _simplify_fraction, _add_fractions, _power)
KINDS += (_gcd, _percent, _sum_to_n, _radical, _root_sum)

ADJECTIVES = "quick lazy bright quiet small large green old young happy calm brave".split()
NOUNS = "fox dog cat bird river tree house garden window robot teacher child".split()
VERBS = "jumps over|walks past|looks at|runs around|sits near|sings to|waits for|reads about".split("|")
ENDINGS = ["today.", "at night.", "in the rain.", "every morning.", "again.", "with care.", "."]


def math_problems(seed: int = 0) -> list[dict]:
    """PER_KIND distinct problems of each kind, interleaved (any prefix mixes all kinds); distinct,
    so the held-out last fifth (prl.envs.common.sample_split) repeats no training problem."""
    r = random.Random(seed)
    rows, seen = [], set()
    for _ in range(PER_KIND):
        for kind in KINDS:
            row = kind(r)
            while row["problem"] in seen:
                row = kind(r)
            seen.add(row["problem"])
            rows.append(row)
    return rows


def reverse_texts(seed: int = 0, n: int = 200) -> list[dict]:
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = r.sample(NOUNS, 2)
        text = f"The {r.choice(ADJECTIVES)} {a} {r.choice(VERBS)} the {b} {r.choice(ENDINGS)}".replace(" .", ".")
        rows.append({"text": text})
    return rows


def to_jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


SAMPLES = {"math_sample.jsonl": math_problems, "reverse_text.jsonl": reverse_texts}


def main() -> None:
    DATA_DIR.mkdir(exist_ok=True)
    for name, make in SAMPLES.items():
        (DATA_DIR / name).write_text(to_jsonl(make()), encoding="utf-8")
        print(f"wrote {DATA_DIR / name}")


if __name__ == "__main__":
    main()
