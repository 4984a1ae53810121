"""Competition math (MATH / hendrycks_math format): reward 1 if the last \\boxed{} answer is right.

    orchestrator.environment: {id: prl.envs.hendrycks_math, args: {}}
    args: {dataset_name: EleutherAI/hendrycks_math, dataset_config: algebra}    # a hub dataset instead

Rows need `problem` and either `answer` or a `solution` ending in \\boxed{...} (MATH's own format).
The default is 100 generated problems shipped in prl/envs/data/math_sample.jsonl: train on the first
80, the last 20 (split test) held out as the `eval_dataset` evals use (`eval_split`; null: none).
Grading is math-verify in a process pool (see prl/envs/math_grading.py for why not in a thread).
"""

from __future__ import annotations

import atexit

import verifiers as vf
from datasets import Dataset

from prl.envs.common import check_arg, check_count, check_optional_str, completion_text, limit, load_rows
from prl.envs.math_grading import GradingPool

SYSTEM_PROMPT = "Solve the problem step by step. Put the final answer in \\boxed{}."


def reference_answer(row: dict) -> str:
    """The row's answer, else the last \\boxed{} of its solution."""
    if row.get("answer"):
        return str(row["answer"])
    return vf.extract_boxed_answer(str(row.get("solution", "")), strict=True)


def final_answer(text: str) -> str:
    """Content of the last \\boxed{} ('' without one: an unboxed answer earns nothing)."""
    return vf.extract_boxed_answer(text, strict=True)


def load_environment(
    dataset_name: str | None = None,
    dataset_config: str | None = None,
    dataset_split: str = "train",
    num_examples: int = -1,
    system_prompt: str = SYSTEM_PROMPT,
    grader_workers: int = 2,
    grade_timeout_s: int = 5,
    eval_split: str | None = "test",
) -> vf.Environment:
    check_optional_str(dataset_name, "dataset_name")
    check_optional_str(dataset_config, "dataset_config")
    check_optional_str(dataset_split, "dataset_split")
    check_optional_str(eval_split, "eval_split")
    check_count(num_examples, "num_examples")
    check_arg(isinstance(system_prompt, str), "system_prompt", f"must be a string, got {system_prompt!r}")
    for name, value in (("grader_workers", grader_workers), ("grade_timeout_s", grade_timeout_s)):
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        check_arg(ok, name, f"must be a positive integer, got {value!r}")

    def examples(split: str, arg: str) -> Dataset:
        rows = load_rows(dataset_name, dataset_config, split, "math_sample.jsonl", arg)
        rows = limit(rows, num_examples) if arg == "dataset_split" else rows
        check_arg(bool(rows) and "problem" in rows[0], "dataset_name", "rows need a 'problem' column")
        out = [{"question": row["problem"], "answer": reference_answer(row)} for row in rows]
        missing = sum(not ex["answer"] for ex in out)
        check_arg(missing == 0, "dataset_name", f"{missing} rows have neither 'answer' nor a \\boxed{{}} in 'solution'")
        return Dataset.from_list(out)

    dataset = examples(dataset_split, "dataset_split")
    held_out = (lambda: examples(eval_split, "eval_split")) if eval_split else None
    pool = GradingPool(grader_workers, grade_timeout_s)
    atexit.register(pool.close)

    async def correct_answer(completion, answer: str, **kwargs) -> float:
        return await pool.grade(final_answer(completion_text(completion)), answer)

    return vf.SingleTurnEnv(dataset=dataset, eval_dataset=held_out, system_prompt=system_prompt,
                            rubric=vf.Rubric(funcs=[correct_answer]))
