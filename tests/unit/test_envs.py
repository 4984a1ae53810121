"""The shipped environments: datasets, rewards through their real verifiers rubrics, argument errors.

    pytest tests/unit/test_envs.py          # ~15 s (math-verify grading starts a process pool)
"""

from __future__ import annotations

import asyncio
import random

import pytest
import verifiers as vf
from helpers import ROOT

from prl.config import ConfigError, EnvironmentConfig
from prl.envs import calculator, hendrycks_math, make_samples, reverse_text, toy
from prl.envs.common import EnvArgError, read_sample
from prl.envs.math_grading import grade
from prl.orchestrator.dataset import load_env


def rewards(env: vf.Environment, completions: list[str], answer: str = "") -> list[float]:
    """Score one group of chat completions with the environment's own rubric."""
    states = []
    for text in completions:
        state = vf.State(input={"prompt": [{"role": "user", "content": "q"}], "answer": answer, "example_id": 0})
        state["prompt"] = state["input"]["prompt"]
        state["completion"] = [{"role": "assistant", "content": text}]
        state["trajectory"] = []
        states.append(state)
    asyncio.run(env.rubric.score_group(states))
    return [state["reward"] for state in states]


# --- shipped data ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(make_samples.SAMPLES))
def test_shipped_samples_are_what_the_generator_writes(name):
    expected = make_samples.to_jsonl(make_samples.SAMPLES[name]())
    assert (make_samples.DATA_DIR / name).read_text(encoding="utf-8") == expected


def test_math_sample_is_math_format_with_boxed_answers():
    rows = read_sample("math_sample.jsonl")
    assert len(rows) == 100
    for row in rows:
        assert set(row) >= {"problem", "solution", "answer"}
        assert hendrycks_math.final_answer(row["solution"]) == row["answer"]


def test_math_verify_grades_every_shipped_solution_correct():
    # Graded in this (main) thread: math-verify's signal.alarm timeouts work here.
    for row in read_sample("math_sample.jsonl"):
        assert grade(hendrycks_math.final_answer(row["solution"]), row["answer"]) == 1.0, row


def test_math_verify_equivalent_forms_and_wrong_answers():
    assert grade("0.5", "\\frac{1}{2}") == 1.0
    assert grade("\\sqrt{32}", "4\\sqrt{2}") == 1.0
    assert grade("-4", "-4") == 1.0
    assert grade("4", "-4") == 0.0
    assert grade("", "3") == 0.0
    assert grade("\\frac{", "3") == 0.0


# --- rewards through the environments' rubrics ----------------------------------------------------


def test_hendrycks_math_rewards_boxed_correct_answers_only():
    env = hendrycks_math.load_environment(num_examples=5)
    assert len(env.get_dataset()) == 5
    completions = ["so $\\boxed{\\frac{3}{4}}$", "it is 0.75", "$\\boxed{0.75}$", "$\\boxed{3/5}$", ""]
    got = rewards(env, completions, "\\frac{3}{4}")
    assert got == [1.0, 0.0, 1.0, 0.0, 0.0]


def test_hendrycks_math_prompt_has_system_prompt_and_problem():
    row = hendrycks_math.load_environment().get_dataset()[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["prompt"][1]["content"] == read_sample("math_sample.jsonl")[0]["problem"]


def test_reverse_text_reward_is_similarity_to_the_reversal():
    env = reverse_text.load_environment()
    text = env.get_dataset()[0]["prompt"][-1]["content"]
    answer = env.get_dataset()[0]["answer"]
    assert answer == text[::-1]
    exact, partial, wrong, empty = rewards(env, [text[::-1], text[::-1][: len(text) // 2], text, ""], answer)
    assert exact == 1.0
    assert 0.3 < partial < 1.0
    assert wrong < partial
    assert empty == 0.0
    assert len(env.get_dataset()) == 160  # the last 40 of the 200 shipped sentences are held out


def test_toy_reward_is_target_character_fraction():
    env = toy.load_environment(target_chars="ab")
    assert rewards(env, ["abab", "abcd", "xyz", ""]) == [1.0, 0.5, 0.0, 0.0]
    passing = toy.load_environment(target_chars="ab", pass_fraction=0.5)  # pass/fail
    assert rewards(passing, ["abab", "abcd", "axyz", ""]) == [1.0, 1.0, 0.0, 0.0]


def test_toy_random_text_groups_have_reward_variance():
    # What a random policy emits: arbitrary characters. Groups of 8 must differ in reward, or
    # group-relative advantages would all be zero and nothing could be learned.
    env = toy.load_environment()
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,.'0123456789"
    for _ in range(20):
        group = ["".join(rng.choice(alphabet) for _ in range(40)) for _ in range(8)]
        got = rewards(env, group)
        assert max(got) > min(got)
        assert 0.0 < sum(got) / 8 < 0.5


def test_calculator_reward_is_the_last_answers_closeness_and_its_tools_answer():
    env = calculator.load_environment()
    assert rewards(env, ["= 57", "= 60", "the sum is 157 or 3", "no number", "= -100"], answer="57") == [1.0, 0.97, 0.0, 0.0, 0.0]
    assert env.tool_defs == [calculator.SCHEMA] and env.tool_map["add"](a=2, b=3) == 5
    stateful = calculator.load_environment(stateful=True)
    state = {}
    assert [stateful.update_tool_args("add", {"a": 2, "b": 3}, [], state) for _ in range(2)] == [
        {"a": 2, "b": 3, "calls": 1}, {"a": 2, "b": 3, "calls": 2}]  # the environment's count, per rollout state
    assert stateful.tool_defs == [calculator.SCHEMA] and stateful.tool_map["add"](a=2, b=3, calls=1) == "5 (call 1)"


def test_shipped_calculator_sft_data_is_what_its_generator_writes(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen", ROOT / "tools/make_sft_calculator_data.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    shipped = gen.OUT.read_text()
    monkeypatch.setattr(gen, "OUT", tmp_path / "out.jsonl")
    gen.main()
    assert (tmp_path / "out.jsonl").read_text() == shipped


# --- malformed arguments --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "args", "named"),
    [
        ("prl.envs.toy", {"target_chars": ""}, "target_chars"),
        ("prl.envs.toy", {"num_examples": 0}, "num_examples"),
        ("prl.envs.toy", {"num_examples": True}, "num_examples"),
        ("prl.envs.toy", {"pass_fraction": 1.5}, "pass_fraction"),
        ("prl.envs.reverse_text", {"text_key": "nope"}, "text_key"),
        ("prl.envs.reverse_text", {"num_examples": "10"}, "num_examples"),
        ("prl.envs.hendrycks_math", {"dataset_name": ""}, "dataset_name"),
        ("prl.envs.hendrycks_math", {"grader_workers": 0}, "grader_workers"),
        ("prl.envs.calculator", {"max_turns": 0}, "max_turns"),
        ("prl.envs.calculator", {"stateful": "yes"}, "stateful"),
        ("prl.envs.calculator", {"hermes_format": 1}, "hermes_format"),
    ],
)
def test_bad_argument_values_name_the_argument(module, args, named):
    with pytest.raises(ConfigError, match=f"^orchestrator.environment.args.{named}: "):
        load_env(EnvironmentConfig(id=module, args=args))
    with pytest.raises(ConfigError, match=rf"^orchestrator.environments\[1\].args.{named}: "):
        load_env(EnvironmentConfig(id=module, args=args), "orchestrator.environments[1]")


def test_env_arg_error_names_the_argument_outside_prl_too():
    with pytest.raises(EnvArgError, match="^orchestrator.environment.args.target_chars: ") as e:
        toy.load_environment(target_chars="")
    assert e.value.arg == "target_chars"


# --- held-out splits for evals --------------------------------------------------------------------


@pytest.mark.parametrize(("module", "total"), [(reverse_text, 200), (hendrycks_math, 100)])
def test_shipped_samples_hold_out_their_last_fifth_for_evals(module, total):
    env = module.load_environment()
    train, held_out = env.get_dataset(), env.get_eval_dataset()
    assert (len(train), len(held_out)) == (total - total // 5, total // 5)
    assert not {row["question"] for row in train} & {row["question"] for row in held_out}
    assert len(env.get_eval_dataset(n=3)) == 3
    assert module.load_environment(num_examples=5).get_eval_dataset().num_rows == total // 5  # limits training only
    assert module.load_environment(eval_split=None).eval_dataset is None


def test_toy_eval_prompts_are_not_training_prompts():
    env = toy.load_environment(num_examples=8)
    assert len(env.get_eval_dataset()) == toy.EVAL_EXAMPLES
    assert not {row["question"] for row in env.get_dataset()} & {row["question"] for row in env.get_eval_dataset()}


def test_unknown_sample_split_is_named():
    message = "the shipped sample has the splits train, test; got 'validation'"
    with pytest.raises(ConfigError, match=f"^orchestrator.environment.args.dataset_split: {message}"):
        load_env(EnvironmentConfig(id="prl.envs.reverse_text", args={"dataset_split": "validation"}))
    env = load_env(EnvironmentConfig(id="prl.envs.reverse_text", args={"eval_split": "validation"}))
    with pytest.raises(EnvArgError, match=f"eval_split: {message}"):  # built when an eval first asks for it
        env.get_eval_dataset()


def test_unknown_argument_is_named():
    with pytest.raises(ConfigError, match="orchestrator.environment.args: .*unexpected keyword argument 'target'"):
        load_env(EnvironmentConfig(id="prl.envs.toy", args={"target": "x"}))


def test_unknown_environment_module_is_named():
    with pytest.raises(ConfigError, match="orchestrator.environment.id: cannot import 'prl.envs.nope'"):
        load_env(EnvironmentConfig(id="prl.envs.nope"))
    with pytest.raises(ConfigError, match="has no load_environment"):
        load_env(EnvironmentConfig(id="prl.envs.common"))
