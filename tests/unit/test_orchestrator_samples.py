"""Orchestrator pieces without servers: advantages, samples and packing, batch files, rollouts left out
and the completions record.

    pytest tests/unit/test_orchestrator_samples.py        # a few seconds
"""

from __future__ import annotations

import json

import pytest
from loguru import logger

from prl.orchestrator.advantages import group_advantages
from prl.orchestrator.overlong import Overlong
from prl.orchestrator.trajectory import Dropped, sample_from_trajectory
from prl.run.packing import Sample, assign_to_ranks, pack_batch
from prl.orchestrator.resume import write_completions
from prl.run.batch import Batch, read_batch, write_batch
from prl.run.rundir import RunDir
from prl.orchestrator.rollouts import (
    check_trainable, completion_records, log_exclusions, score_groups, set_aside_over_budget, to_samples,
)
from prl.trainer.samples import count_tokens


def warnings_of(call) -> list[str]:
    """The WARNING lines loguru writes while `call()` runs."""
    lines = []
    handler = logger.add(lines.append, level="WARNING", format="{message}")
    try:
        call()
    finally:
        logger.remove(handler)
    return lines


def turn(prompt: list[int], completion: list[int], logprobs: list[float] | None = None) -> dict:
    """One trajectory step shaped like verifiers' (tokens as parsed from vLLM's response)."""
    logprobs = logprobs if logprobs is not None else [-1.0 - i for i in range(len(completion))]
    tokens = {
        "prompt_ids": prompt,
        "prompt_mask": [0] * len(prompt),
        "completion_ids": completion,
        "completion_mask": [1] * len(completion),
        "completion_logprobs": logprobs,
    }
    return {"tokens": tokens}


def make_sample(prompt_len: int, completion_len: int, advantage: float = 1.0) -> Sample:
    return sample_from_trajectory([turn(list(range(prompt_len)), list(range(100, 100 + completion_len)))], advantage)


# --- advantages -----------------------------------------------------------------------------------


def test_advantages_subtract_the_group_mean():
    assert group_advantages([1.0, 0.0, 0.5, 0.5, 2.0, 2.0], group_size=2) == [0.5, -0.5, 0.0, 0.0, 0.0, 0.0]


def test_advantages_std_normalisation():
    adv = group_advantages([0.0, 1.0, 0.0, 1.0], group_size=4, normalize_std=True)
    assert adv == pytest.approx([-1.0, 1.0, -1.0, 1.0], rel=1e-4)
    assert group_advantages([3.0] * 4, group_size=4, normalize_std=True) == [0.0] * 4


def test_errored_rollouts_stay_out_of_their_groups_baseline():
    assert group_advantages([1.0, 0.0, None], group_size=3) == [0.5, -0.5, None]
    # All errored: no advantages; the next group is untouched.
    assert group_advantages([None, None, 2.0, 4.0], group_size=2) == [None, None, -1.0, 1.0]
    adv = group_advantages([1.0, 0.0, None], group_size=3, normalize_std=True)
    assert adv[:2] == pytest.approx([1.0, -1.0], rel=1e-4) and adv[2] is None  # std of the scored two
    assert group_advantages([None, 0.7, None], group_size=3, normalize_std=True) == [None, 0.0, None]


def test_advantages_reject_ragged_groups():
    with pytest.raises(ValueError, match="do not form groups"):
        group_advantages([1.0, 2.0, 3.0], group_size=2)


# --- samples and packing --------------------------------------------------------------------------


def test_single_turn_sample_masks_completion_and_aligns_logprobs():
    sample = sample_from_trajectory([turn([1, 2, 3], [7, 8], [-0.5, -0.25])], advantage=0.5)
    assert sample.input_ids == [1, 2, 3, 7, 8]
    assert sample.loss_mask == [False, False, False, True, True]
    assert sample.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25]


def test_multi_turn_sample_joins_turns_when_prompts_extend():
    first = turn([1, 2], [3, 4])
    second = turn([1, 2, 3, 4, 9, 9], [5])  # the environment's reply (9, 9) is not trained on
    sample = sample_from_trajectory([first, second], advantage=1.0)
    assert sample.input_ids == [1, 2, 3, 4, 9, 9, 5]
    assert sample.loss_mask == [False, False, True, True, False, False, True]


def test_rollouts_without_one_token_sequence_are_dropped_with_a_reason():
    assert sample_from_trajectory([], 1.0) == Dropped("no_tokens", "the trajectory has no turns")
    assert sample_from_trajectory([turn([1], [2]), {"tokens": None}], 1.0) == Dropped("no_tokens", "turn 2 has no token ids")
    re_rendered = sample_from_trajectory([turn([1, 2], [3]), turn([1, 2, 3], [4]), turn([1, 2, 3, 4, 5, 3], [4])], 1.0)
    assert isinstance(re_rendered, Sample)
    re_rendered = sample_from_trajectory([turn([1, 2], [3]), turn([1, 2, 3], [4]), turn([1, 2, 9, 4], [5])], 1.0)
    assert re_rendered == Dropped(
        "prompt_mismatch", "turn 3's prompt does not extend turns 1..2 (first difference at token 2: 3 became 9)"
    )
    shorter = sample_from_trajectory([turn([1, 2], [3]), turn([1, 2], [4])], 1.0)
    assert shorter.reason == "prompt_mismatch" and "the prompt has 2 tokens, the turns before it 3" in shorter.detail
    assert sample_from_trajectory([turn([1, 2], [])], 1.0) == Dropped("empty_completion", "no token in the loss mask (2 tokens in 1 turns)")


def test_ranks_get_equal_counts_and_balanced_tokens():
    samples = [make_sample(4, n) for n in (50, 40, 30, 20, 10, 5, 5, 1)]
    ranks = assign_to_ranks(samples, world_size=2)
    assert [len(r) for r in ranks] == [4, 4]
    totals = [sum(len(s) for s in r) for r in ranks]
    assert abs(totals[0] - totals[1]) <= 10


@pytest.mark.parametrize(("n", "world", "mbs"), [(16, 1, 8), (16, 2, 3), (7, 2, 2), (3, 4, 8), (64, 4, 8)])
def test_packed_batch_layout(n, world, mbs):
    samples = [make_sample(3 + i % 5, 1 + i % 7, advantage=float(i)) for i in range(n)]
    per_rank = pack_batch(samples, world, mbs)
    assert len(per_rank) == world
    assert len({len(r) for r in per_rank}) == 1  # same number of micro-batches on every rank
    assert sum(mb["num_samples"] for r in per_rank for mb in r) == n
    loss_tokens = 0
    for mb in (mb for r in per_rank for mb in r):
        T = mb["input_ids"].shape[1]
        for key in ("input_ids", "position_ids", "loss_mask", "advantages", "behaviour_logprobs"):
            assert mb[key].shape == (1, T), key
        assert mb["num_samples"] <= mbs
        assert int((mb["position_ids"][0] == 0).sum()) == max(mb["num_samples"], 1)  # positions restart per sample
        mask = mb["loss_mask"][0]
        assert (mb["behaviour_logprobs"][0][~mask] == 0).all() and (mb["advantages"][0][~mask] == 0).all()
        assert (mb["behaviour_logprobs"][0][mask] < 0).all()
        if mb["num_samples"] == 0:
            assert not mask.any()
        loss_tokens += int(mask.sum())
    assert loss_tokens == sum(sum(s.loss_mask) for s in samples)


def test_batch_file_passes_the_trainers_checks(tmp_path):
    samples = [make_sample(5, 3 + i) for i in range(10)]
    batch = Batch(step=4, policy_version=3, micro_batches=pack_batch(samples, 2, 4), metrics={"reward_mean": 0.5})
    path = write_batch(RunDir(tmp_path), batch)
    assert path == tmp_path / "rollouts" / "step_4.pt"
    assert [p.name for p in path.parent.iterdir()] == ["step_4.pt"]  # no temporary left behind
    loaded = read_batch(RunDir(tmp_path), step=4, world_size=2, async_level=1)
    tokens, loss_tokens = count_tokens(loaded.micro_batches[0] + loaded.micro_batches[1])
    assert loss_tokens == sum(3 + i for i in range(10))
    padding = sum(mb["num_samples"] == 0 for r in loaded.micro_batches for mb in r)
    assert tokens == sum(len(s) for s in samples) + padding  # one token per padding micro-batch


def output(reward: float, completion: list[int] | None, error: dict | None = None, example: int = 0) -> dict:
    """A verifiers RolloutOutput as run_group returns it (with the trajectory state column)."""
    trajectory = [turn([1, 2], completion)] if completion is not None else []
    return {"example_id": example, "reward": reward, "trajectory": trajectory, "metrics": {"f": reward},
            "error": error, "prompt": [{"role": "user", "content": f"q{example}"}],
            "completion": [{"role": "assistant", "content": f"a{reward}"}]}


ERROR = {"error": "ConnectionError", "message": "server went away", "error_chain_repr": "", "error_chain_str": ""}


def test_outputs_to_samples_and_metrics():
    groups = [[output(1.0, [5, 6]), output(0.0, [7])], [output(0.5, [8]), output(0.25, None)]]
    result = to_samples(groups)
    # The tokenless rollout is not trained on but still counts in its group's mean.
    assert [s.advantage for s in result.samples] == [0.5, -0.5, 0.125]
    m = result.metrics
    assert m["reward_mean"] == 0.4375 and m["samples"] == 3 and m["dropped_frac"] == 0.25
    assert m["dropped/no_tokens"] == 1 and m["dropped/prompt_mismatch"] == 0 and m["dropped/empty_completion"] == 0
    assert m["zero_advantage_group_frac"] == 0.0 and m["metric/f"] == 0.4375 and m["errored"] == 0
    assert m["completion_len_mean"] == pytest.approx(4 / 3)


def test_errored_rollouts_are_neither_baseline_nor_trained():
    groups = [[output(1.0, [5, 6]), output(0.0, [7]), output(0.0, [8], ERROR)], [output(0.0, [9], ERROR)] * 3]
    result = to_samples(groups)
    assert [s.advantage for s in result.samples] == [0.5, -0.5]  # not [0.667, -0.333, -0.333]
    assert [r.dropped for r in result.rollouts] == [None, None] + ["errored"] * 4
    assert result.rollouts[2].detail == "ConnectionError: server went away"
    m = result.metrics
    assert m["errored"] == 4 and m["error_frac"] == 4 / 6 and m["dropped_frac"] == 0
    assert m["reward_mean"] == 0.5 and m["samples"] == 2
    assert m["zero_advantage_group_frac"] == 0  # a group that only errored is not a uniform group


@pytest.mark.parametrize("filter_zero", [True, False])
def test_zero_advantage_groups_leave_the_batch_and_its_token_denominator(filter_zero):
    uniform = [output(1.0, [5, 6, 7]), output(1.0, [8]), output(0.0, [9], ERROR)]  # equal among the scored
    mixed = [output(1.0, [5, 6]), output(0.0, [7]), output(0.5, [8, 9, 10, 11])]
    result = to_samples([uniform, mixed], filter_zero_advantage=filter_zero)
    m = result.metrics
    assert m["zero_advantage_group_frac"] == 0.5
    assert m["zero_advantage_samples"] == 2 and m["zero_advantage_loss_tokens"] == 4
    kept = 3 + (0 if filter_zero else 2)
    assert m["samples"] == len(result.samples) == kept
    expected = [None, None] if not filter_zero else ["zero_advantage", "zero_advantage"]
    assert [r.dropped for r in result.rollouts[:2]] == expected
    _, loss_tokens = count_tokens([mb for rank in pack_batch(result.samples, 2, 2) for mb in rank])
    assert loss_tokens == 7 + (0 if filter_zero else 4)  # what the trainer divides the loss by


def test_a_step_of_uniform_groups_packs_an_empty_batch_and_warns(tmp_path):
    result = to_samples([[output(0.0, [5]), output(0.0, [6])], [output(0.0, [7]), output(0.0, None, ERROR)]])
    assert result.samples == [] and result.metrics["zero_advantage_group_frac"] == 1.0
    lines = warnings_of(lambda: check_trainable(7, result))
    assert len(lines) == 1 and lines[0].startswith("batch 7: nothing to train on: every group with usable rollouts")
    assert "1 errored" in lines[0]
    write_batch(RunDir(tmp_path), Batch(step=7, policy_version=6, micro_batches=pack_batch(result.samples, 2, 4),
                                        metrics=result.metrics))
    loaded = read_batch(RunDir(tmp_path), 7, 2, async_level=1)  # passes the trainer's checks
    assert [[mb["num_samples"] for mb in rank] for rank in loaded.micro_batches] == [[0], [0]]
    assert count_tokens(loaded.micro_batches[0] + loaded.micro_batches[1]) == (2, 0)


def test_a_step_where_nothing_came_back_usable_fails_naming_the_causes():
    result = to_samples([[output(0.0, [5], ERROR), output(1.0, None)], [output(0.0, [7], ERROR)] * 2])
    with pytest.raises(RuntimeError, match=r"batch 3: no rollout came back usable \(4 rollouts: 3 errored, 1 no_tokens, "
                                           r"0 prompt_mismatch, 0 empty_completion, 0 over_budget, 0 overlong\)"):
        check_trainable(3, result)


def test_each_exclusion_is_logged_once_with_its_reason():
    mismatch = output(1.0, [5])
    mismatch["trajectory"].append(turn([1, 7], [8]))
    groups = [[output(1.0, [5]), mismatch, output(0.0, [9], ERROR, example=4)], [output(0.0, [9], ERROR, example=6)] * 3]
    lines = warnings_of(lambda: log_exclusions(2, to_samples(groups)))
    assert lines == [
        "batch 2: rollout dropped (prompt_mismatch; example 0, group 0 rollout 1): turn 2's prompt does not extend "
        "turns 1..1 (first difference at token 1: 2 became 7)\n",
        "batch 2: 4 rollout(s) errored, left out of baselines and training (example 4, group 0 rollout 2; example 6, "
        "group 1 rollout 0; example 6, group 1 rollout 1; example 6, group 1 rollout 2): ConnectionError: server went away\n",
    ]


def test_samples_over_the_token_budget_leave_the_batch_and_say_so_in_the_record():
    """A sample longer than trainer.micro_batch_tokens (possible only with a server of a longer
    --max-model-len) is set aside: counted, and its completions record says over_budget."""
    result = to_samples([[output(1.0, [5] * 40), output(0.0, [6, 7]), output(0.5, [8])]])
    set_aside_over_budget(4, result, 32)  # the first sample: 2 prompt + 40 completion tokens
    assert [len(s) for s in result.samples] == [4, 3]
    assert (result.metrics["over_budget"], result.metrics["samples"]) == (1.0, 2.0)
    records = completion_records(4, result)
    assert [(r["trained"], r["dropped"]) for r in records] == [(False, "over_budget"), (True, None), (True, None)]
    assert records[0]["dropped_detail"] == "42 tokens > trainer.micro_batch_tokens=32"
    # Nothing but over-budget samples: no usable rollout, the step fails naming them.
    alone = to_samples([[output(1.0, [5] * 40), output(0.0, [6] * 40)]])
    set_aside_over_budget(5, alone, 32)
    with pytest.raises(RuntimeError, match=r"no rollout came back usable .*, 2 over_budget, 0 overlong\)"):
        check_trainable(5, alone)
    unlimited = to_samples([[output(1.0, [5] * 40), output(0.0, [6])]])
    set_aside_over_budget(6, unlimited, None)
    assert len(unlimited.samples) == 2 and unlimited.metrics["over_budget"] == 0


def test_completions_file_records_every_rollout_and_its_fate(tmp_path):
    groups = [[output(1.0, [5, 6], example=3), output(0.0, [7], ERROR, example=3), output(0.0, None, example=3)],
              [output(0.5, [8], example=9)] * 3]
    result = to_samples(groups)
    path = write_completions(RunDir(tmp_path), 5, completion_records(5, result))
    assert path == tmp_path / "rollouts" / "step_5.completions.jsonl"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 6
    assert records[0] == {
        "step": 5, "environment": None, "example_id": 3, "group": 0, "rollout": 0,
        "prompt": [{"role": "user", "content": "q3"}], "completion": [{"role": "assistant", "content": "a1.0"}],
        "answer": None, "reward": 1.0, "advantage": 0.5, "overlong_penalty": 0.0, "metrics": {"f": 1.0}, "truncated": False,
        "error": None, "trained": True, "dropped": None, "dropped_detail": None,
    }
    assert (records[1]["error"], records[1]["advantage"], records[1]["dropped"]) == ("ConnectionError: server went away", None, "errored")
    assert (records[2]["advantage"], records[2]["trained"], records[2]["dropped"]) == (-0.5, False, "no_tokens")
    assert {(r["group"], r["rollout"], r["dropped"]) for r in records[3:]} == {(1, i, "zero_advantage") for i in range(3)}
    assert "prompt_ids" not in path.read_text()  # text only: the trajectory's token ids stay out
    # verifiers hands back some messages as pydantic models: recorded as plain messages.
    import verifiers as vf

    models = [groups[0], [output(0.5, [8], example=9) | {"completion": [vf.AssistantMessage(content="b")]}] * 3]
    (record, *_) = completion_records(5, to_samples(models))[3:]
    assert record["completion"] == [{"role": "assistant", "content": "b"}]
    # verifiers' outputs carry tool calls as JSON strings: recorded as objects (a broken one as it is).
    call = '{"id": "c1", "name": "add", "arguments": "{\\"a\\": 1}"}'
    calls = [output(0.5, [8], example=9) | {"completion": [{"role": "assistant", "content": "", "tool_calls": [call, "{oops"]}]}] * 3
    (record, *_) = completion_records(5, to_samples([groups[0], calls]))[3:]
    assert record["completion"][0]["tool_calls"] == [{"id": "c1", "name": "add", "arguments": '{"a": 1}'}, "{oops"]
    # The same outputs (a resumed run regenerates the batch) give the same bytes.
    again = write_completions(RunDir(tmp_path / "again"), 5, completion_records(5, to_samples(groups)))
    assert again.read_bytes() == path.read_bytes()


def test_an_http_error_of_the_server_is_logged_with_its_status_and_message():
    """verifiers wraps a client's failure in a bare ModelError; the log line shows what it wraps (the
    server's 400 and its message), as verifiers' own error_data records the chain."""
    import httpx
    import openai
    import verifiers as vf
    from verifiers.legacy.utils.error_utils import error_data

    from prl.orchestrator.records import error_text

    body = {"error": {"message": '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'}}
    response = httpx.Response(400, json=body, request=httpx.Request("POST", "http://server/v1/chat/completions"))
    try:
        try:
            raise openai.BadRequestError("Error code: 400 - " + str(body), response=response, body=body)
        except openai.BadRequestError as e:
            raise vf.ModelError from e
    except vf.ModelError as e:
        text = error_text(error_data(e))
    assert text.startswith("ModelError: BadRequestError(") and "Error code: 400" in text
    assert "--tool-call-parser" in text
    assert error_text({"error": "ConnectionError", "message": "server went away"}) == "ConnectionError: server went away"


# --- over-long completions (EnvironmentConfig.overlong) -------------------------------------------


def truncated(reward: float, length: int, example: int = 0) -> dict:
    return output(reward, list(range(10, 10 + length)), example=example) | {"is_truncated": True}


def test_overlong_mask_leaves_truncated_rollouts_out_of_the_batch_but_in_their_groups_baseline():
    group = [truncated(1.0, 8), output(0.0, [5]), output(0.5, [6, 7])]
    kept = to_samples([group])
    assert len(kept.samples) == 3 and kept.metrics["overlong_masked"] == 0
    masked = to_samples([group], rules=[Overlong("mask", max_tokens=8)])
    assert [s.advantage for s in masked.samples] == [-0.5, 0.0]  # the mean still holds the truncated 1.0
    assert [r.dropped for r in masked.rollouts] == ["overlong", None, None]
    assert masked.metrics["overlong_masked"] == 1.0 and masked.metrics["groups_trained"] == 1.0
    assert completion_records(1, masked)[0]["dropped"] == "overlong"
    # A group of nothing but truncated rollouts leaves nothing: a legitimate empty step, not a failure.
    alone = to_samples([[truncated(1.0, 8), truncated(0.0, 8)]], rules=[Overlong("mask", max_tokens=8)])
    assert alone.samples == [] and alone.metrics["groups_trained"] == 0.0
    check_trainable(2, alone)  # warns, does not raise


def test_overlong_penalty_grows_over_the_buffer_before_the_limit_and_moves_the_advantages():
    rule = Overlong("penalty", buffer=4, penalty=0.5, max_tokens=10)
    lengths = [6, 7, 8, 10]  # up to max_tokens - buffer = 6 free, then 1/4, 2/4, all of the penalty
    assert [rule.reward_penalty(output(1.0, [1] * n)) for n in lengths] == [0.0, 0.125, 0.25, 0.5]
    result = to_samples([[output(1.0, [1] * n) for n in lengths]], rules=[rule])
    assert [s.advantage for s in result.samples] == pytest.approx([0.21875, 0.09375, -0.03125, -0.28125])
    assert result.metrics["reward_mean"] == 1.0  # the environment's reward; the penalty has its own metric
    assert result.metrics["overlong_penalty_mean"] == pytest.approx(0.21875)
    assert [r["overlong_penalty"] for r in completion_records(0, result)] == [0.0, 0.125, 0.25, 0.5]
    # Without the penalty these equal rewards would be a zero-advantage group, left out.
    assert to_samples([[output(1.0, [1] * n) for n in lengths]]).samples == []


def test_per_environment_overlong_rules_and_truncation_rates():
    result = score_groups(["a", "b"], [[[truncated(1.0, 4), output(0.0, [5])]], [[truncated(1.0, 4), output(0.0, [5])]]],
                          1.0, rules=[Overlong("mask", max_tokens=4), Overlong()])
    m = result.metrics
    assert (m["env/a/overlong_masked"], m["env/b/overlong_masked"], m["overlong_masked"]) == (1.0, 0.0, 1.0)
    assert m["env/a/truncated_frac"] == m["env/b/truncated_frac"] == m["truncated_frac"] == 0.5
    assert len(result.samples) == 3


@pytest.mark.parametrize("field, value, message", [
    ("mode", "cut", r"overlong\.mode: must be one of"),
    ("buffer", 0, r"overlong\.buffer: mode penalty needs a buffer of tokens > 0"),
    ("buffer", 16, r"overlong\.buffer: 16 must be below orchestrator\.sampling\.max_tokens=16"),
    ("penalty", -1.0, r"overlong\.penalty: must be a finite number > 0"),
])
def test_overlong_settings_are_checked_naming_the_key(field, value, message):
    from prl.config import ConfigError, EnvironmentConfig, OrchestratorConfig, OverlongConfig, SamplingConfig

    overlong = OverlongConfig(**{"mode": "penalty", "buffer": 4, field: value})
    with pytest.raises(ConfigError, match=r"orchestrator\.environment\." + message):
        OrchestratorConfig(environment=EnvironmentConfig(id="prl.envs.toy", overlong=overlong),
                           sampling=SamplingConfig(max_tokens=16))


def test_each_seat_is_its_own_baseline():
    """An episode of two agents: the writer's rewards and the editor's are centred separately within the
    group, an errored seat's trace stays out of its seat's mean; one seat everywhere is plain GRPO."""
    rewards = [1.0, 0.0, 0.9, 0.7, None, 0.2]
    seats = ["writer", "writer", "editor", "editor", "editor", "writer"]
    assert group_advantages(rewards, 6, seats=seats) == pytest.approx([0.6, -0.4, 0.1, -0.1, None, -0.2])
    assert group_advantages(rewards, 3, seats=[None] * 6) == group_advantages(rewards, 3)


# --- groups of different sizes in one step (environments of different seat counts) ----------------


def test_groups_of_different_sizes_each_take_their_own_baseline():
    """A group of 2 episodes x 2 seats beside groups of 2 and of 3 rollouts of one seat: each group's
    (each seat's) mean is its own, whatever the other groups' sizes; sizes that do not cover the rewards
    are refused."""
    rewards = [1.0, 0.0, 0.6, 0.2, 0.5, 0.0, None, 3.0, 2.0]
    seats = ["writer", "writer", "editor", "editor", None, None, None, None, None]
    assert group_advantages(rewards, [4, 2, 3], seats=seats) == pytest.approx([0.5, -0.5, 0.2, -0.2, 0.25, -0.25, None, 0.5, -0.5])
    assert group_advantages(rewards[4:6], [2]) == group_advantages(rewards[4:6], 2)  # a list of one size is plain GRPO
    for sizes in ([4, 2, 2], [4, 2, 4], [4, 0, 2, 3]):
        with pytest.raises(ValueError, match=r"9 rewards do not form groups of sizes"):
            group_advantages(rewards, sizes, seats=seats)


def seated(reward: float, seat: str | None, ids: list[int] | None, example: int, error: dict | None = None) -> dict:
    return output(reward, ids, error, example) | ({"seat": seat} if seat else {})


def test_a_step_mixes_groups_of_two_seats_with_groups_of_one():
    """The duo's group (2 episodes x writer and editor) beside two calculator groups of 2 in one step: per-seat
    baselines in the duo's group, per-group ones in the calculator's; a uniform calculator group leaves the
    batch alone; each environment's over-long rule reaches its own rollouts; group metrics count groups,
    not rollouts / a size; the completions file names each rollout's environment and numbers each group's
    rollouts from 0; the logs name the right group; per-environment metrics cover each one's rollouts."""
    duo = [seated(1.0, "writer", [5], 1), seated(0.0, "writer", [6], 1) | {"is_truncated": True},
           seated(0.25, "editor", [7], 1), seated(0.75, "editor", None, 1)]
    calc = [[seated(0.5, None, [8], 7), seated(0.0, None, [9, 9], 7) | {"is_truncated": True}],
            [seated(1.0, None, [10], 8), seated(1.0, None, [11], 8, ERROR)]]
    rules = [Overlong(), Overlong("mask", max_tokens=8)]
    result = score_groups(["duo", "calc"], [[duo], calc], 2.0, rules=rules)
    assert result.group_sizes == [4, 2, 2]
    assert [r.advantage for r in result.rollouts] == [0.5, -0.5, -0.25, 0.25, 0.25, -0.25, 0.0, None]
    # The calculator's rule (mask) holds its truncated rollout out; the duo's (keep) trains its own.
    assert [r.dropped for r in result.rollouts] == [None, None, None, "no_tokens", None, "overlong", "zero_advantage", "errored"]
    assert [s.advantage for s in result.samples] == [0.5, -0.5, -0.25, 0.25]
    m = result.metrics
    assert (m["rollouts"], m["samples"], m["groups_trained"]) == (8, 4, 2)
    assert (m["env/duo/overlong_masked"], m["env/calc/overlong_masked"]) == (0, 1)
    assert m["zero_advantage_group_frac"] == pytest.approx(1 / 3) and m["zero_advantage_samples"] == 1
    assert (m["env/duo/rollouts"], m["env/calc/rollouts"]) == (4, 4)
    assert m["env/duo/seat/writer/reward_mean"] == 0.5 and m["env/duo/seat/editor/reward_mean"] == 0.5
    assert not any(key.startswith("env/calc/seat/") for key in m) and m["env/calc/error_frac"] == 0.25
    records = completion_records(3, result)
    assert [(r["environment"], r["group"], r["rollout"], r.get("seat")) for r in records] == [
        ("duo", 0, 0, "writer"), ("duo", 0, 1, "writer"), ("duo", 0, 2, "editor"), ("duo", 0, 3, "editor"),
        ("calc", 1, 0, None), ("calc", 1, 1, None), ("calc", 2, 0, None), ("calc", 2, 1, None)]
    lines = warnings_of(lambda: log_exclusions(3, result))
    assert "example 1, group 0 rollout 3" in lines[0] and "(example 8, group 2 rollout 1)" in lines[1], lines
