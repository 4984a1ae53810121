"""Orchestrator pieces without servers: advantages, packing, data order, run-directory bookkeeping.

    pytest tests/test_orchestrator.py        # a few seconds
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from loguru import logger

from prl.config import (
    Config, ConfigError, EnvironmentConfig, EvalConfig, EvalSamplingConfig, ModelConfig, OrchestratorConfig, RunConfig,
    SamplingConfig,
)
from prl.orchestrator.advantages import group_advantages
from prl.orchestrator.client import RolloutClient, inference_urls, server_url
from prl.orchestrator.data import (
    SEED_KEY, derive_seed, example_indices, load_env, load_train_envs, rollout_groups, step_parts,
)
from prl.orchestrator.evals import OnlineEval, eval_metrics, eval_parts, make_record, weights_label, write_record
from prl.orchestrator.loop import ensure_policy
from prl.orchestrator.packing import Dropped, Sample, assign_to_ranks, pack_batch, sample_from_trajectory
from prl.orchestrator.progress import (
    check_resume,
    policy_version,
    progress_at,
    record_checkpoints,
    record_final,
    resume_step,
    stand_in_version,
    wait_for_weights,
    write_batch,
    write_completions,
)
from prl.orchestrator.rollouts import (
    check_trainable, completion_records, log_exclusions, outcome_metrics, sampling_args, set_aside_over_budget,
    to_samples,
)
from prl.trainer.data import count_tokens, load_batch
from prl.trainer.weights import prune_weights


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
        for key in ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs"):
            assert mb[key].shape == (1, T), key
        assert mb["num_samples"] <= mbs
        assert int((mb["position_ids"][0] == 0).sum()) == max(mb["num_samples"], 1)  # positions restart per sample
        mask = mb["loss_mask"][0]
        assert (mb["inference_logprobs"][0][~mask] == 0).all() and (mb["advantages"][0][~mask] == 0).all()
        assert (mb["inference_logprobs"][0][mask] < 0).all()
        if mb["num_samples"] == 0:
            assert not mask.any()
        loss_tokens += int(mask.sum())
    assert loss_tokens == sum(sum(s.loss_mask) for s in samples)


def test_batch_file_passes_the_trainers_checks(tmp_path):
    samples = [make_sample(5, 3 + i) for i in range(10)]
    batch = {"step": 4, "micro_batches": pack_batch(samples, 2, 4), "metrics": {"reward_mean": 0.5}}
    path = write_batch(tmp_path, batch)
    assert path == tmp_path / "rollouts" / "step_4.pt"
    assert [p.name for p in path.parent.iterdir()] == ["step_4.pt"]  # no temporary left behind
    loaded = load_batch(path, step=4, world_size=2)
    tokens, loss_tokens = count_tokens(loaded["micro_batches"][0] + loaded["micro_batches"][1])
    assert loss_tokens == sum(3 + i for i in range(10))
    padding = sum(mb["num_samples"] == 0 for r in loaded["micro_batches"] for mb in r)
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
    lines = []
    handler = logger.add(lines.append, level="WARNING", format="{message}")
    try:
        check_trainable(7, result)
    finally:
        logger.remove(handler)
    assert len(lines) == 1 and lines[0].startswith("batch 7: nothing to train on: every group with usable rollouts")
    assert "1 errored" in lines[0]
    batch = {"step": 7, "micro_batches": pack_batch(result.samples, 2, 4), "metrics": result.metrics}
    loaded = load_batch(write_batch(tmp_path, batch), 7, 2)  # passes the trainer's checks
    assert [[mb["num_samples"] for mb in rank] for rank in loaded["micro_batches"]] == [[0], [0]]
    assert count_tokens(loaded["micro_batches"][0] + loaded["micro_batches"][1]) == (2, 0)


def test_a_step_where_nothing_came_back_usable_fails_naming_the_causes():
    result = to_samples([[output(0.0, [5], ERROR), output(1.0, None)], [output(0.0, [7], ERROR)] * 2])
    with pytest.raises(RuntimeError, match=r"batch 3: no rollout came back usable \(4 rollouts: 3 errored, 1 no_tokens, "
                                           r"0 prompt_mismatch, 0 empty_completion, 0 over_budget\)"):
        check_trainable(3, result)


def test_each_exclusion_is_logged_once_with_its_reason():
    mismatch = output(1.0, [5])
    mismatch["trajectory"].append(turn([1, 7], [8]))
    groups = [[output(1.0, [5]), mismatch, output(0.0, [9], ERROR, example=4)], [output(0.0, [9], ERROR, example=6)] * 3]
    lines = []
    handler = logger.add(lines.append, level="WARNING", format="{message}")
    try:
        log_exclusions(2, to_samples(groups))
    finally:
        logger.remove(handler)
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
    with pytest.raises(RuntimeError, match=r"no rollout came back usable .*, 2 over_budget\)"):
        check_trainable(5, alone)
    unlimited = to_samples([[output(1.0, [5] * 40), output(0.0, [6])]])
    set_aside_over_budget(6, unlimited, None)
    assert len(unlimited.samples) == 2 and unlimited.metrics["over_budget"] == 0


def test_completions_file_records_every_rollout_and_its_fate(tmp_path):
    groups = [[output(1.0, [5, 6], example=3), output(0.0, [7], ERROR, example=3), output(0.0, None, example=3)],
              [output(0.5, [8], example=9)] * 3]
    result = to_samples(groups)
    path = write_completions(tmp_path, 5, completion_records(5, result))
    assert path == tmp_path / "rollouts" / "step_5.completions.jsonl"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 6
    assert records[0] == {
        "step": 5, "example_id": 3, "group": 0, "rollout": 0,
        "prompt": [{"role": "user", "content": "q3"}], "completion": [{"role": "assistant", "content": "a1.0"}],
        "answer": None, "reward": 1.0, "advantage": 0.5, "metrics": {"f": 1.0}, "truncated": False,
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
    # The same outputs (a resumed run regenerates the batch) give the same bytes.
    again = write_completions(tmp_path / "again", 5, completion_records(5, to_samples(groups)))
    assert again.read_bytes() == path.read_bytes()


def test_outcome_metrics_need_no_tokens():
    groups = [[{"reward": 1.0, "metrics": {"f": 1.0}}, {"reward": 0.0, "error": "boom", "is_truncated": True}],
              [{"reward": None}, {"reward": 0.5, "metrics": {"f": 0.0}}]]
    m = outcome_metrics(groups)
    assert m["reward_mean"] == 0.5 and m["rollouts"] == 4 and m["error_frac"] == 0.25  # errored: not scored
    assert m["truncated_frac"] == 0.25 and m["metric/f"] == 0.5  # averaged over the rollouts that report it
    assert m["reward_std"] == pytest.approx(0.4082482905)


def test_sampling_args_ask_vllm_for_tokens_and_logprobs():
    env = load_env(EnvironmentConfig(id="prl.envs.toy", args={"num_examples": 8}))
    args = sampling_args(SamplingConfig(temperature=0.7, max_tokens=12), env)
    assert args["logprobs"] is True and args["extra_body"]["return_token_ids"] is True
    assert (args["temperature"], args["top_p"], args["max_tokens"]) == (0.7, 1.0, 12)


def test_sampling_extra_body_reaches_vllm_but_cannot_turn_off_token_ids():
    env = load_env(EnvironmentConfig(id="prl.envs.toy", args={"num_examples": 8}))
    extra = {"ignore_eos": True, "return_token_ids": False}
    args = sampling_args(SamplingConfig(max_tokens=12, extra_body=extra), env)
    assert args["extra_body"] == {"ignore_eos": True, "return_token_ids": True}


@pytest.mark.parametrize("own,key", [
    ({"top_k": 20}, "environment sampling_args.top_k"),
    ({"presence_penalty": 0.5}, "environment sampling_args.presence_penalty"),
    ({"extra_body": {"min_p": 0.1}}, "environment sampling_args.extra_body.min_p"),
    ({"extra_body": {"top_p": 0.9}}, "environment sampling_args.extra_body.top_p"),
    ({"extra_body": {"temperature": 0.3}}, "environment sampling_args.extra_body.temperature"),
])
def test_environment_sampling_args_that_truncate_the_distribution_are_refused(own, key):
    """The config's own fields are checked at load; an environment's are known only once it is loaded."""
    env = load_env(EnvironmentConfig(id="prl.envs.toy", args={"num_examples": 8}))
    env.sampling_args = own
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: "):
        sampling_args(SamplingConfig(max_tokens=12), env)
    env.sampling_args = {"top_p": 0.5, "top_k": -1, "extra_body": {"top_k": 0}}  # top_p: the config's 1.0 wins
    assert sampling_args(SamplingConfig(max_tokens=12), env)["top_p"] == 1.0


# --- data order -----------------------------------------------------------------------------------


def test_data_order_is_a_pure_function_of_seed_and_step():
    assert example_indices(0, 3, 4, 10) == example_indices(0, 3, 4, 10)
    # Pinned: a change here silently changes what resumed runs train on.
    assert example_indices(0, 3, 4, 10) == [9, 7, 5, 3]
    assert example_indices(1, 3, 4, 10) != example_indices(0, 3, 4, 10)


def test_each_epoch_visits_every_example_once():
    per_step, n = 4, 12
    seen = [i for step in range(6) for i in example_indices(7, step, per_step, n)]
    assert sorted(seen[:12]) == list(range(12)) and sorted(seen[12:]) == list(range(12))
    assert seen[:12] != seen[12:]  # reshuffled per epoch


def test_epoch_boundary_inside_a_batch():
    batch = example_indices(0, 2, 4, 10)  # positions 8..11: two of epoch 0, two of epoch 1
    assert len(batch) == 4 and all(0 <= i < 10 for i in batch)


def test_rollout_groups_copy_the_row_per_rollout():
    env = load_env(EnvironmentConfig(id="prl.envs.toy", args={"num_examples": 8}))
    groups = rollout_groups(env.get_dataset(), [5, 2], rollouts_per_example=3, seed=0, step=0)
    assert [len(g) for g in groups] == [3, 3]
    assert [g[0]["example_id"] for g in groups] == [5, 2]
    assert groups[0][0]["prompt"][-1]["content"] == "Write some text. (5)"
    groups[0][0]["prompt"].append("x")
    assert len(groups[0][1]["prompt"]) == 1  # copies, not one shared row


def test_every_rollout_has_its_own_reproducible_seed():
    dataset = load_env(EnvironmentConfig(id="prl.envs.toy", args={"num_examples": 8})).get_dataset()

    def seeds(seed: int, step: int) -> list[int]:
        return [row[SEED_KEY] for group in rollout_groups(dataset, [3, 3], 4, seed, step) for row in group]

    assert seeds(0, 5) == seeds(0, 5)
    assert len(set(seeds(0, 5))) == 8  # also for the same example twice in a batch (epoch boundary)
    assert not set(seeds(0, 5)) & set(seeds(0, 6)) and not set(seeds(0, 5)) & set(seeds(1, 5))
    assert seeds(0, 5)[1] == derive_seed(0, 5, 0, 1)  # (seed, step, group position, rollout index)
    # Pinned: a change here silently changes what resumed runs sample.
    assert derive_seed(0, 5, 0, 1) == 6361671458874452847
    assert all(0 <= s < 2**63 for s in seeds(3, 7))  # vLLM's seed is a signed 64-bit integer


def two_env_config(tmp_path: Path, **eval_kw) -> Config:
    envs = [EnvironmentConfig(id="prl.envs.toy", args={"num_examples": 8}, ratio=3),
            EnvironmentConfig(id="prl.envs.reverse_text", name="rev")]
    return Config(run=RunConfig(name="r", output_dir=str(tmp_path), seed=3), model=ModelConfig(name="m"),
                  orchestrator=OrchestratorConfig(environments=envs, batch_size=16, rollouts_per_example=2,
                                                  eval=EvalConfig(**eval_kw)))


def test_several_environments_share_each_batch_by_ratio(tmp_path):
    cfg = two_env_config(tmp_path)
    envs = load_train_envs(cfg)
    assert [(e.name, e.count, len(e.dataset)) for e in envs] == [("toy", 6, 8), ("rev", 2, 160)]
    assert envs[0].seed == 3 and envs[1].seed == derive_seed(3, 1)  # the first keeps the run's seed
    parts = step_parts(envs, [{"e": 0}, {"e": 1}], 2, cfg.run.seed, step=4)
    assert [(p.name, len(p.groups), p.sampling) for p in parts] == [("toy", 6, {"e": 0}), ("rev", 2, {"e": 1})]
    assert parts[1].groups[0][0]["prompt"][-1]["content"] in {row["question"] for row in envs[1].dataset}
    # Each environment walks its own data order; group positions run on across environments.
    toy_groups = rollout_groups(envs[0].dataset, example_indices(3, 4, 6, 8), 2, 3, 4)
    assert parts[0].groups == toy_groups  # = the one-environment batch of old
    assert [g[0]["example_id"] for g in parts[1].groups] == example_indices(derive_seed(3, 1), 4, 2, 160)
    assert parts[1].groups[1][1][SEED_KEY] == derive_seed(3, 4, 7, 1)
    seeds = [row[SEED_KEY] for p in parts for g in p.groups for row in g]
    assert len(set(seeds)) == 16
    again = step_parts(load_train_envs(cfg), [{}, {}], 2, cfg.run.seed, step=4)
    assert [p.groups for p in again] == [p.groups for p in parts]  # a pure function of seed and step


def test_eval_groups_are_the_held_out_rows_with_their_own_seeds(tmp_path):
    cfg = two_env_config(tmp_path, num_examples=5, rollouts_per_example=2, sampling=EvalSamplingConfig(temperature=0.0))
    envs = load_train_envs(cfg)
    parts = eval_parts(cfg, {e.name: e.env for e in envs})
    assert [p.name for p in parts] == ["toy", "rev"] and parts[0].env is envs[0].env  # reused, not reloaded
    held_out = {row["question"] for row in envs[1].env.get_eval_dataset()}
    assert all(g[0]["prompt"][-1]["content"] in held_out for g in parts[1].groups)
    assert [len(p.groups) for p in parts] == [5, 5] and all(len(g) == 2 for p in parts for g in p.groups)
    assert parts[0].sampling["temperature"] == 0.0 and parts[0].sampling["max_tokens"] == 256  # the rest: training's
    seeds = {row[SEED_KEY] for p in parts for g in p.groups for row in g}
    assert len(seeds) == 20
    training = {row[SEED_KEY] for step in range(50) for p in step_parts(envs, [{}, {}], 2, 3, step) for g in p.groups for row in g}
    assert not seeds & training
    assert eval_parts(cfg)[1].groups == parts[1].groups  # the same rows and seeds whenever it runs
    other = two_env_config(tmp_path, environments=[EnvironmentConfig(id="prl.envs.toy", name="t2")])
    assert [(p.name, len(p.groups)) for p in eval_parts(other)] == [("t2", 64)]


def test_eval_record_and_metrics(tmp_path):
    cfg = two_env_config(tmp_path, interval=2)
    result = {"reward_mean": 0.25, "reward_std": 0.1, "rollouts": 4, "seconds": 1.0,
              "environments": {"toy": {"reward_mean": 0.5, "rollouts": 2.0}, "rev": {"reward_mean": 0.0, "rollouts": 2.0}}}
    record = make_record(cfg, result, 4, weights_label(tmp_path, cfg, 4), "online")
    path = write_record(tmp_path, record)
    assert path == tmp_path / "evals" / "step_4.json"
    saved = json.loads(path.read_text())
    assert saved["policy_version"] == 4 and saved["weights"] == str(tmp_path / "weights" / "step_4")
    assert weights_label(tmp_path, cfg, 0) == "m"  # version 0 is model.name
    assert eval_metrics(saved) == {"eval/reward_mean": 0.25, "eval/policy_version": 4.0, "eval/toy/reward_mean": 0.5,
                                   "eval/toy/rollouts": 2.0, "eval/rev/reward_mean": 0.0, "eval/rev/rollouts": 2.0}
    # Every rollout of an environment errored: no mean, written as null (JSON has no NaN).
    nan = float("nan")
    errored = make_record(cfg, {**result, "reward_mean": nan, "environments": {"toy": {"reward_mean": nan}}}, 5, "w", "online")
    assert '"reward_mean": null' in write_record(tmp_path, errored).read_text()
    assert json.loads((tmp_path / "evals/step_5.json").read_text())["environments"] == {"toy": {"reward_mean": None}}
    (tmp_path / "evals/step_5.json").unlink()
    online = OnlineEval(cfg, tmp_path, [])
    assert [v for v in range(7) if online.due(v)] == [0, 2, 6]  # 4 has its file already
    assert online.remaining(newest_loaded=2, first_step=0) == [6, 8, 10, 12, 14, 16, 18, 20]  # the final one too
    # Relaunched at step 12: versions before it come back only if their weights are still there.
    mark(tmp_path / "weights" / "step_8")
    assert online.remaining(newest_loaded=2, first_step=12) == [8, 12, 14, 16, 18, 20]


def test_client_sends_a_per_turn_seed(monkeypatch):
    import verifiers as vf
    from openai import AsyncOpenAI

    sent = []

    async def parent_get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        sent.append(sampling_args)

    monkeypatch.setattr(vf.OpenAIChatCompletionsClient, "get_response", parent_get_response)
    client = RolloutClient(AsyncOpenAI(base_url="http://localhost:1/v1", api_key="x"))
    args = {"temperature": 1.0}
    state = {"input": {SEED_KEY: 42}, "trajectory": []}
    asyncio.run(client.get_response([], "m", args, state=state))
    state["trajectory"].append({})
    asyncio.run(client.get_response([], "m", args, state=state))
    asyncio.run(client.get_response([], "m", args, state={"input": {}, "trajectory": []}))
    assert [a.get("seed") for a in sent] == [derive_seed(42, 0), derive_seed(42, 1), None]
    assert args == {"temperature": 1.0}  # the group's shared sampling args stay untouched


def test_inference_urls():
    urls = inference_urls({"PRL_INFERENCE_URLS": "http://a:8000/v1, http://b:8000/v1/"})
    assert urls == ["http://a:8000/v1", "http://b:8000/v1"]
    assert server_url("http://a:8000/v1") == "http://a:8000"
    with pytest.raises(RuntimeError, match="PRL_INFERENCE_URLS"):
        inference_urls({})


# --- run directory --------------------------------------------------------------------------------


def config(tmp_path: Path, **orch) -> Config:
    return Config(
        run=RunConfig(name="r", output_dir=str(tmp_path)),
        model=ModelConfig(name="m"),
        orchestrator=OrchestratorConfig(
            environment=EnvironmentConfig(id="prl.envs.toy"), batch_size=16, rollouts_per_example=4, **orch
        ),
    )


def mark(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "COMPLETE").touch()


def test_resume_step_is_newest_complete_checkpoint(tmp_path):
    assert resume_step(tmp_path) == 0
    mark(tmp_path / "checkpoints" / "step_4")
    mark(tmp_path / "checkpoints" / "step_8")
    (tmp_path / "checkpoints" / "step_12").mkdir()  # being written: does not exist yet
    assert resume_step(tmp_path) == 8


def test_batch_n_uses_exactly_version_n_minus_async_level():
    assert [policy_version(n, 2) for n in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [policy_version(n, 0) for n in range(3)] == [0, 1, 2]


class FakeServers:
    def __init__(self):
        self.loaded: list[str] = []

    async def update_weights(self, path: Path) -> None:
        self.loaded.append(path.name)


def run_schedule(run_dir: Path, steps: range, async_level: int) -> tuple[list[int], list[str]]:
    """ensure_policy for each step, as the loop calls it; (versions, weight dirs loaded)."""
    servers, versions, version = FakeServers(), [], 0

    async def main():
        nonlocal version
        for step in steps:
            version, _ = await ensure_policy(run_dir, servers, step, async_level, steps.start, version, lambda: None)
            versions.append(version)

    asyncio.run(main())
    return versions, servers.loaded


def test_policy_schedule_ignores_newer_weights(tmp_path):
    for v in range(1, 6):  # a fast trainer: every version already there
        mark(tmp_path / "weights" / f"step_{v}")
    versions, loaded = run_schedule(tmp_path, range(6), async_level=2)
    assert versions == [0, 0, 0, 1, 2, 3] and loaded == ["step_1", "step_2", "step_3"]


def test_resumed_schedule_loads_the_checkpoints_window(tmp_path):
    for v in (2, 3, 4):  # resumed from checkpoint 4 with async_level 2: (4 - 3, 4] kept
        mark(tmp_path / "weights" / f"step_{v}")
    versions, loaded = run_schedule(tmp_path, range(4, 7), async_level=2)
    assert versions == [2, 3, 4] and loaded == ["step_2", "step_3", "step_4"]


def test_lost_version_is_replaced_by_the_next_one(tmp_path):
    # Resumed from checkpoint 4 whose window is gone (prl resume --step to an older checkpoint): only
    # version 4 comes (the trainer re-writes it); waiting for 2 and 3 would never end.
    assert stand_in_version(tmp_path, 2, first_step=4) == 4
    mark(tmp_path / "weights" / "step_3")
    assert stand_in_version(tmp_path, 2, first_step=4) == 3
    assert stand_in_version(tmp_path, 3, first_step=4) == 3
    assert stand_in_version(tmp_path, 5, first_step=4) == 5  # this launch's trainer will write it
    mark(tmp_path / "weights" / "step_4")
    versions, loaded = run_schedule(tmp_path, range(4, 7), async_level=2)
    assert versions == [3, 3, 4] and loaded == ["step_3", "step_4"]


def test_wait_for_weights_returns_once_complete(tmp_path):
    polls = []

    async def trainer():
        await asyncio.sleep(0.2)
        mark(tmp_path / "weights" / "step_2")  # a newer version does not end the wait
        await asyncio.sleep(0.2)
        mark(tmp_path / "weights" / "step_1")

    async def main():
        task = asyncio.create_task(trainer())
        await wait_for_weights(tmp_path, 1, on_poll=lambda: polls.append(1), poll_s=0.05)
        await task

    asyncio.run(main())
    assert len(polls) >= 6  # checkpoints are recorded while waiting


def test_prune_weights_keeps_every_checkpoints_window(tmp_path):
    def versions() -> list[int]:
        return sorted(int(p.name.removeprefix("step_")) for p in (tmp_path / "weights").iterdir())

    for v in range(1, 11):
        mark(tmp_path / "weights" / f"step_{v}")
    prune_weights(tmp_path, newest=10, keep=2)
    assert versions() == [9, 10]  # no checkpoint yet

    for v in range(1, 9):
        mark(tmp_path / "weights" / f"step_{v}")
    (tmp_path / "checkpoints" / "step_6" / "trainer").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_6" / "COMPLETE").touch()
    (tmp_path / "checkpoints" / "step_8" / "trainer").mkdir(parents=True)  # being written: no window
    prune_weights(tmp_path, newest=10, keep=2)
    # Batches 6 and 7 of a run resumed from checkpoint 6 need versions 5 and 6 (async_level 1).
    assert versions() == [5, 6, 9, 10]

    (tmp_path / "checkpoints" / "step_8" / "COMPLETE").touch()
    mark(tmp_path / "weights" / "step_11")
    prune_weights(tmp_path, newest=11, keep=2)  # `prl resume --step 6` stays exact while 6 exists
    assert versions() == [5, 6, 10, 11]
    mark(tmp_path / "weights" / "step_8")
    prune_weights(tmp_path, newest=11, keep=2)
    assert versions() == [5, 6, 8, 10, 11]
    shutil.rmtree(tmp_path / "checkpoints" / "step_6")  # keep_last dropped checkpoint 6: its window goes
    prune_weights(tmp_path, newest=11, keep=2)
    assert versions() == [8, 10, 11]


def test_orchestrator_json_in_complete_checkpoints(tmp_path):
    cfg = config(tmp_path)
    mark(tmp_path / "checkpoints" / "step_3")
    (tmp_path / "checkpoints" / "step_5").mkdir()
    record_checkpoints(tmp_path, lambda step: progress_at(cfg, step, num_examples=[10]))
    saved = json.loads((tmp_path / "checkpoints" / "step_3" / "orchestrator.json").read_text())
    assert saved["step"] == 3 and saved["samples_seen"] == 48 and saved["data_position"] == [12] and saved["epoch"] == [1]
    assert not (tmp_path / "checkpoints" / "step_5" / "orchestrator.json").exists()


def test_final_checkpoint_is_prepared_but_not_complete(tmp_path):
    record_final(tmp_path, progress_at(config(tmp_path), 20, num_examples=[10]))
    assert json.loads((tmp_path / "checkpoints" / "step_20" / "orchestrator.json").read_text())["step"] == 20
    assert resume_step(tmp_path) == 0  # no COMPLETE marker: not a checkpoint for anyone


def test_resume_warns_when_data_order_changed(tmp_path):
    mark(tmp_path / "checkpoints" / "step_3")
    record_checkpoints(tmp_path, lambda step: progress_at(config(tmp_path), step, num_examples=[10]))
    messages = []
    sink = logger.add(messages.append, level="WARNING")
    try:
        check_resume(tmp_path, 3, progress_at(config(tmp_path), 3, num_examples=[10]))
        assert not messages
        check_resume(tmp_path, 3, progress_at(config(tmp_path, sampling=SamplingConfig()), 3, num_examples=[11]))
        assert len(messages) == 1 and "data order changed" in messages[0]
    finally:
        logger.remove(sink)
