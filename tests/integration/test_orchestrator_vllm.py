"""The orchestrator against a real vLLM server (CPU build) on the tiny model.

    pytest -m vllm tests/integration/test_orchestrator_vllm.py      # ~1.5 minutes on 2 cores, most of it server start

The server is the session's one CPU server (conftest.cpu_server), serving the tiny model's own
weights at the start of every test (conftest.vllm_server).

`python jobs/orchestrator.py RUN/config.yaml` runs as the batch script runs it. The batch files must
pass the trainer's own checks, and their logprobs must be the tiny model's logprobs of exactly those
tokens (recomputed with transformers in float32): that alignment is what the trainer's importance
ratio relies on. A stand-in trainer publishes weight directories to drive /update_weights and resume.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from inference_helpers import API_KEY

from prl.run.batch import Batch, read_batch, read_data_order, write_data_order
from prl.run.rundir import RunDir

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
BATCH, GROUP, MAX_TOKENS, WORLD = 16, 4, 12, 2


def toy(target_chars: str = "aeiou") -> str:
    return f"  environment: {{id: prl.envs.toy, args: {{num_examples: 40, target_chars: '{target_chars}'}}}}\n"


TOY = toy()
TWO_ENVS = ("  environments: [{id: prl.envs.toy, args: {num_examples: 40}, ratio: 3},\n"
            "                 {id: prl.envs.reverse_text, name: rev}]\n")


def write_config(path: Path, tiny_model: Path, run_name: str, max_steps: int, async_level: int,
                 environments: str = TOY, extra: str = "") -> Path:
    path.write_text(
        f"run: {{name: {run_name}, output_dir: '{path.parent}', max_steps: {max_steps}, async_level: {async_level}}}\n"
        f"model: {{name: '{tiny_model}', dtype: float32, max_model_len: 512}}\n"
        # (prl.inference.server turns chunked prefill off on CPU: it kills the engine under seeded requests.)
        "inference: {gpus_per_node: 0, enforce_eager: true, api_key_env: PRL_TEST_API_KEY,\n"
        "            env: {VLLM_CPU_KVCACHE_SPACE: '1'}}\n"
        f"trainer: {{nodes: {WORLD}, gpus_per_node: 0, micro_batch_size: 3}}\n"
        "orchestrator:\n" + environments + extra +
        f"  batch_size: {BATCH}\n  rollouts_per_example: {GROUP}\n  max_concurrent: 8\n"
        f"  sampling: {{max_tokens: {MAX_TOKENS}}}\n"
    )
    return path


@pytest.fixture
def server(vllm_server):
    return vllm_server


def run_orchestrator(config: Path, server, log_dir: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PRL_INFERENCE_URLS": f"{server.url}/v1", "PRL_LOG_DIR": str(log_dir),
           "PRL_TEST_API_KEY": API_KEY}
    env.pop("PRL_RUN_DIR", None)
    argv = [sys.executable, str(REPO / "jobs" / "orchestrator.py"), str(config)]
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def samples_of(mb: dict) -> list[tuple[torch.Tensor, ...]]:
    """(input_ids, loss_mask, logprobs, advantages) per packed sample, split where positions restart."""
    starts = (mb["position_ids"][0] == 0).nonzero()[:, 0].tolist() + [mb["input_ids"].shape[1]]
    keys = ("input_ids", "loss_mask", "behaviour_logprobs", "advantages")
    return [tuple(mb[k][0, a:b] for k in keys) for a, b in zip(starts, starts[1:])]


def prompts_of(batch: Batch) -> list[tuple[int, ...]]:
    """The prompt token sequences of a batch's samples, sorted (layout-independent)."""
    real = [mb for rank in batch.micro_batches for mb in rank if mb["num_samples"]]
    return sorted(tuple(ids[~mask].tolist()) for mb in real for ids, mask, _, _ in samples_of(mb))


def test_two_batches_without_weight_updates(server, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    config = write_config(tmp_path / "config.yaml", tiny_model, "run", max_steps=2, async_level=2)
    start = time.monotonic()
    run_orchestrator(config, server, tmp_path / "logs")
    elapsed = time.monotonic() - start
    rollouts = tmp_path / "run" / "rollouts"
    assert sorted(p.name for p in rollouts.iterdir()) == [
        "step_0.completions.jsonl", "step_0.pt", "step_1.completions.jsonl", "step_1.pt"]
    assert (tmp_path / "logs" / "orchestrator" / "rank_0.log").read_text().count("batch ") >= 2
    # The trainer's checkpoints are the trainer's alone: the data order travels in the batches.
    assert not (tmp_path / "run" / "checkpoints" / "step_2").exists()

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for step in (0, 1):
        batch = read_batch(RunDir(tmp_path / "run"), step, WORLD, async_level=2)  # the trainer's own contract checks
        assert batch.metrics["samples"] == BATCH and batch.metrics["policy_version"] == 0.0
        assert 0.0 < batch.metrics["reward_mean"] < 1.0 and batch.metrics["rollout_tokens_per_s"] > 0
        assert batch.data_order["step"] == step + 1 and batch.data_order["samples_seen"] == (step + 1) * BATCH
        samples = [s for rank in batch.micro_batches for mb in rank for s in samples_of(mb) if mb["num_samples"]]
        assert len(samples) == BATCH
        for rank in batch.micro_batches:
            assert all(mb["num_samples"] <= 3 for mb in rank)
        for ids, mask, logprobs, _ in samples:
            n = int(mask.sum())
            assert 1 <= n <= MAX_TOKENS
            assert mask[-n:].all() and not mask[:-n].any()  # prompt first, then the completion
            with torch.no_grad():
                logits = model(ids[None]).logits[0].float()
            expected = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
            torch.testing.assert_close(logprobs[1:][mask[1:]], expected[mask[1:]], atol=2e-3, rtol=0)
        check_completions(rollouts / f"step_{step}.completions.jsonl", batch.metrics, samples)
    print(f"orchestrator: 2 batches of {BATCH} rollouts in {elapsed:.1f}s (process start included)")


def test_recompute_mode_asks_the_servers_for_no_logprobs(server, tiny_model, tmp_path):
    """trainer.behaviour_logprobs=recompute: the token route asks vLLM for the tokens alone; the batch
    says which version generated it and carries 0.0 where vLLM's logprobs would be."""
    config = write_config(tmp_path / "config.yaml", tiny_model, "run", max_steps=1, async_level=1)
    text = config.read_text().replace("micro_batch_size: 3}", "micro_batch_size: 3, behaviour_logprobs: recompute}")
    config.write_text(text)
    run_orchestrator(config, server, tmp_path / "logs")
    batch = read_batch(RunDir(tmp_path / "run"), 0, WORLD, async_level=1)
    assert batch.policy_version == 0 and batch.metrics["samples"] == BATCH
    samples = [s for rank in batch.micro_batches for mb in rank for s in samples_of(mb) if mb["num_samples"]]
    assert len(samples) == BATCH and all(int(mask.sum()) >= 1 for _, mask, _, _ in samples)
    assert all(not logprobs.any() for _, _, logprobs, _ in samples)


def check_completions(path: Path, metrics: dict, samples: list) -> None:
    """The step's record of what the model wrote agrees with its batch."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == BATCH and [(r["group"], r["rollout"]) for r in records[:2]] == [(0, 0), (0, 1)]
    assert sum(r["reward"] for r in records) / BATCH == pytest.approx(metrics["reward_mean"])
    assert sum(r["trained"] for r in records) == len(samples) == metrics["samples"]
    assert sorted(r["advantage"] for r in records if r["trained"]) == pytest.approx(
        sorted(float(adv[mask][0]) for _, mask, _, adv in samples))
    for r in records:
        assert r["prompt"] == [{"role": "user", "content": f"Write some text. ({r['example_id']})"}]
        assert [set(m) for m in r["completion"]] == [{"role", "content"}] and r["completion"][0]["role"] == "assistant"
        assert r["error"] is None and r["metrics"]["target_char_fraction"] == r["reward"]


def stand_in_trainer(run_dir: Path, tiny_model: Path, steps: range, stop: threading.Event) -> None:
    """Publishes weights/step_{n+1} (the initial weights again) once batch n exists, like the trainer."""
    for n in steps:
        while not (run_dir / "rollouts" / f"step_{n}.pt").exists():
            if stop.wait(0.1):
                return
        tmp = run_dir / "weights" / f".step_{n + 1}.tmp"
        shutil.copytree(tiny_model, tmp)
        (tmp / "COMPLETE").touch()
        tmp.rename(run_dir / "weights" / f"step_{n + 1}")


def test_weight_updates_and_resume(server, tiny_model, tmp_path):
    config = write_config(tmp_path / "config.yaml", tiny_model, "run", max_steps=3, async_level=0)
    run_dir = tmp_path / "run"
    (run_dir / "weights").mkdir(parents=True)
    stop = threading.Event()
    trainer = threading.Thread(target=stand_in_trainer, args=(run_dir, tiny_model, range(3), stop))
    trainer.start()
    try:
        run_orchestrator(config, server, tmp_path / "logs")
    finally:
        stop.set()
        trainer.join()
    batches = [read_batch(RunDir(run_dir), n, WORLD, async_level=0) for n in range(3)]
    versions = [batch.metrics["policy_version"] for batch in batches]
    assert versions == [0.0, 1.0, 2.0]  # async_level 0: batch n from version n, loaded via /update_weights

    # Resume from a checkpoint at step 1 as a relaunch would (prl.run.rundir rewinds rollouts >= 1 first).
    first = read_batch(RunDir(run_dir), 1)
    first_completions = (run_dir / "rollouts" / "step_1.completions.jsonl").read_bytes()
    batch_0_written = (run_dir / "rollouts" / "step_0.pt").stat().st_mtime_ns
    (run_dir / "checkpoints" / "step_1").mkdir(parents=True)
    write_data_order(run_dir / "checkpoints" / "step_1", batches[0].data_order)  # as the trainer keeps it
    (run_dir / "checkpoints" / "step_1" / "COMPLETE").touch()
    for n in (1, 2):
        (run_dir / "rollouts" / f"step_{n}.pt").unlink()
        (run_dir / "rollouts" / f"step_{n}.completions.jsonl").unlink()
    run_orchestrator(config, server, tmp_path / "logs2")
    assert (run_dir / "rollouts" / "step_0.pt").stat().st_mtime_ns == batch_0_written  # consumed: left alone
    again = read_batch(RunDir(run_dir), 1)
    assert prompts_of(again) == prompts_of(first)  # batch 1 regenerated from the same prompts
    assert again.metrics["policy_version"] == 1.0 and again.data_order == first.data_order
    assert (run_dir / "rollouts" / "step_1.completions.jsonl").read_bytes() == first_completions
    for mb_first, mb_again in zip(sum(first.micro_batches, []), sum(again.micro_batches, [])):
        for key in ("input_ids", "position_ids", "loss_mask", "advantages", "behaviour_logprobs"):
            assert torch.equal(mb_first[key], mb_again[key]), key  # and to the same tokens: exact resume
    assert read_data_order(RunDir(run_dir), 1) == batches[0].data_order  # read, not written, by the orchestrator
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_1").iterdir()) == ["COMPLETE", "data_order.json"]
    log = (tmp_path / "logs2" / "orchestrator" / "rank_0.log").read_text()
    assert "batches 1..2" in log and "data order changed" not in log


def test_multi_turn_rollouts_continue_from_token_ids(server, tiny_model):
    """guess_letter (up to 3 turns) with the random tiny model, whose answers are arbitrary bytes:
    every rollout is kept as one sequence (Chat Completions dropped 84-91 % of them: text that does
    not re-tokenize to the sampled ids), the environment's replies sit unmasked between the turns,
    and every sampled token's logprob is the model's."""
    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prl.config import EnvironmentConfig, SamplingConfig
    from prl.orchestrator.client import Servers
    from prl.orchestrator.dataset import EnvGroups, example_indices, load_env, rollout_groups
    from prl.orchestrator.rollouts import generate_step, sampling_args

    env = load_env(EnvironmentConfig(id="prl.envs.guess_letter", args={"max_turns": 3}))
    groups = rollout_groups(env.get_dataset(), example_indices(0, 0, 4, 256), GROUP, 0, 0)

    async def rollouts():
        servers = Servers([f"{server.url}/v1"], API_KEY, tokenizer=str(tiny_model))
        try:
            sampling = sampling_args(SamplingConfig(max_tokens=MAX_TOKENS), env)
            parts = [EnvGroups("guess_letter", env, groups, sampling)]
            return await generate_step(parts, servers, await servers.model_name(), 16)
        finally:
            await servers.close()

    result = asyncio.run(rollouts())
    assert result.metrics["dropped_frac"] == 0.0 and result.metrics["error_frac"] == 0.0
    assert len(result.samples) == 4 * GROUP and result.metrics["metric/num_turns"] > 1.5
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for sample in result.samples:
        ids, mask = torch.tensor(sample.input_ids), torch.tensor(sample.loss_mask)
        turns = int((mask[1:] & ~mask[:-1]).sum())  # masked runs: one per model turn
        text = tokenizer.decode(sample.input_ids)
        assert text.count("<|im_start|>assistant\n") == turns and text.count("Guess again.") >= turns - 1
        with torch.no_grad():
            logits = model(ids[None]).logits[0].float()
        expected = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
        logprobs = torch.tensor(sample.logprobs)
        torch.testing.assert_close(logprobs[1:][mask[1:]], expected[mask[1:]], atol=2e-3, rtol=0)


def test_the_token_client_generates_and_names_an_overlong_prompt(server, tiny_model):
    """TokenClient (prl.orchestrator.tokens) over its own HTTP client (prl.orchestrator.http_client):
    the sampled ids and logprobs as /prl/generate gives them, with the key; a prompt past
    model.max_model_len (512) is verifiers' OverlongPromptError (the rollout ends as truncated, not
    as an error)."""
    import asyncio

    import httpx
    import verifiers as vf
    from openai import AsyncOpenAI

    from prl.orchestrator.tokens import TokenClient

    sampling = {"temperature": 1.0, "max_tokens": 6, "seed": 11, "ignore_eos": True}
    expected = httpx.post(f"{server.url}/prl/generate", json={"token_ids": [5, 6, 7], "sampling_params": sampling},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120).json()

    async def main():
        client = TokenClient(AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY), str(tiny_model))
        args = {"temperature": 1.0, "max_tokens": 6, "seed": 11, "extra_body": {"ignore_eos": True}}
        try:
            response = await client.from_native_response(await client.generate([5, 6, 7], str(tiny_model), args))
            with pytest.raises(vf.OverlongPromptError):
                await client.generate([5] * 600, str(tiny_model), args)
            return response
        finally:
            await client.close()

    response = asyncio.run(main())
    tokens = response.message.tokens
    assert tokens.completion_ids == expected["token_ids"] and tokens.prompt_ids == [5, 6, 7]
    assert tokens.completion_logprobs == expected["logprobs"]


def test_a_step_of_equal_rewards_is_an_empty_batch(server, tiny_model, tmp_path):
    """Reward 0 everywhere (a target character the model never writes): every group is uniform and
    filtered; the orchestrator writes a batch with only padding and says why, and goes on."""
    config = write_config(tmp_path / "config.yaml", tiny_model, "run", 1, 1, toy("\u2603"))
    run_orchestrator(config, server, tmp_path / "logs")
    batch = read_batch(RunDir(tmp_path / "run"), 0, WORLD, async_level=1)
    assert [[mb["num_samples"] for mb in rank] for rank in batch.micro_batches] == [[0]] * WORLD
    m = batch.metrics
    assert (m["samples"], m["reward_mean"], m["zero_advantage_group_frac"], m["errored"]) == (0, 0.0, 1.0, 0)
    assert m["zero_advantage_samples"] == BATCH and m["zero_advantage_loss_tokens"] >= BATCH
    records = [json.loads(line) for line in (tmp_path / "run/rollouts/step_0.completions.jsonl").read_text().splitlines()]
    assert [r["dropped"] for r in records] == ["zero_advantage"] * BATCH
    log = (tmp_path / "logs/orchestrator/rank_0.log").read_text()
    assert "batch 0: nothing to train on: every group with usable rollouts has equal rewards" in log


def run_with_stand_in(config: Path, server, tiny_model: Path, steps: int, log_dir: Path,
                      publish=stand_in_trainer) -> Path:
    """The orchestrator run to its end beside `publish` (a stand-in trainer) for `steps` batches."""
    run_dir = config.parent / "run"
    (run_dir / "weights").mkdir(parents=True)
    stop = threading.Event()
    trainer = threading.Thread(target=publish, args=(run_dir, tiny_model, range(steps), stop))
    trainer.start()
    try:
        run_orchestrator(config, server, log_dir)
    finally:
        stop.set()
        trainer.join()
    return run_dir


def test_two_environments_and_online_evals(server, tiny_model, tmp_path):
    """Each step mixes both environments 3:1; evals of versions 0 (beside batch 0) and 3 (the final one,
    after the last batch) on the held-out splits; the batches are the ones a run without evals makes."""
    evals = "  eval: {interval: 3, num_examples: 3, rollouts_per_example: 2, sampling: {temperature: 0.5}}\n"
    runs = {}
    for name, extra in (("with_evals", evals), ("without", "")):
        (tmp_path / name).mkdir()
        config = write_config(tmp_path / name / "config.yaml", tiny_model, "run", 3, 0, TWO_ENVS, extra)
        runs[name] = run_with_stand_in(config, server, tiny_model, 3, tmp_path / name / "logs")
    run_dir = runs["with_evals"]
    batches = [read_batch(RunDir(run_dir), n, WORLD, async_level=0) for n in range(3)]
    for batch in batches:
        m = batch.metrics
        assert (m["env/toy/rollouts"], m["env/rev/rollouts"], m["rollouts"]) == (12.0, 4.0, 16.0)
        assert 0.0 <= m["env/rev/reward_mean"] <= 1.0
        assert m["reward_mean"] == pytest.approx((12 * m["env/toy/reward_mean"] + 4 * m["env/rev/reward_mean"]) / 16)
    assert batches[0].metrics["eval/policy_version"] == 0.0 and "eval/reward_mean" not in batches[1].metrics
    assert sorted(p.name for p in (run_dir / "evals").iterdir()) == [
        "step_0.completions.jsonl", "step_0.json", "step_3.completions.jsonl", "step_3.json"]  # pass@k reads them
    for version in (0, 3):
        record = json.loads((run_dir / "evals" / f"step_{version}.json").read_text())
        assert record["policy_version"] == version and record["source"] == "online"
        assert record["rollouts"] == 12 and set(record["environments"]) == {"toy", "rev"}
        assert record["environments"]["rev"]["rollouts"] == 6.0 and 0.0 <= record["reward_mean"] <= 1.0
        assert record["settings"]["sampling"] == {"temperature": 0.5}
    assert json.loads((run_dir / "evals" / "step_3.json").read_text())["weights"] == str(run_dir / "weights" / "step_3")
    # The same weights at versions 0 and 3 (the stand-in trainer republishes them), the same eval seeds:
    # the same eval. And the evals' requests changed no training batch.
    assert json.loads((run_dir / "evals" / "step_0.json").read_text())["environments"] == \
        json.loads((run_dir / "evals" / "step_3.json").read_text())["environments"]
    for n in range(3):
        without = read_batch(RunDir(runs["without"]), n)
        for mb_a, mb_b in zip(sum(batches[n].micro_batches, []), sum(without.micro_batches, [])):
            for key in ("input_ids", "loss_mask", "advantages", "behaviour_logprobs"):
                assert torch.equal(mb_a[key], mb_b[key]), (n, key)


def scaled_version(tiny_model: Path, version: int, out: Path) -> Path:
    """The tiny model with its final norm scaled by 1 + version / 2: every version samples from a
    distribution of its own (logits scaled), so a logprob tells which version drew its token."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model, out)
    tensors = load_file(out / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * (1 + version / 2)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def versioned_trainer(run_dir: Path, tiny_model: Path, steps: range, stop: threading.Event) -> None:
    """Publishes weights/step_{n+1} (scaled_version n + 1) once batch n exists, like the trainer."""
    for n in steps:
        while not (run_dir / "rollouts" / f"step_{n}.pt").exists():
            if stop.wait(0.05):
                return
        tmp = scaled_version(tiny_model, n + 1, run_dir / "weights" / f".step_{n + 1}.tmp")
        (tmp / "COMPLETE").touch()
        tmp.rename(run_dir / "weights" / f"step_{n + 1}")


def versions_of_tokens(models: dict, ids: torch.Tensor, mask: torch.Tensor, logprobs: torch.Tensor) -> list[int]:
    """The versions that drew a sample's tokens, one per token, older to newer: each token's vLLM
    logprob must be the logprob of a version's own forward over the whole sequence; a token several
    versions give alike (a near-certain one) gets the oldest version not older than the token before.
    -1: no version (of `models`, version -> model) gives that token's logprob."""
    got = logprobs[1:][mask[1:]]
    close = {}
    for version, model in models.items():
        with torch.no_grad():
            logits = model(ids[None]).logits[0].float()
        expected = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0][mask[1:]]
        close[version] = ((expected - got).abs() < 2e-3).tolist()
    versions, current = [], min(models)
    for i in range(len(got)):
        current = next((v for v in sorted(models) if v >= current and close[v][i]), -1)
        versions.append(current)
        if current == -1:
            break
    return versions


def test_continuous_mode_loads_versions_while_requests_run(server, tiny_model, tmp_path):
    """orchestrator.continuous with a stand-in trainer that publishes a different model per version:
    batches pass the trainer's checks and keep the staleness bound; versions load while requests
    run, and every token's logprob is the model's of the version that held the server when it was
    drawn, over the whole sequence (the kept requests' KV cache was recomputed): a sample's tokens
    go from older to newer versions, and some samples span an update.

    That some do must not depend on the machine's speed (CI's ran 320-token requests faster than the
    update reached them). So async_level 2 and one group at a time: when batch n is written, the
    groups of batches n + 1 and n + 2 (eight) are still to run, one after another, and the stand-in
    publishes version n + 1 at once; the follower loads it within a poll, while a group runs."""
    from transformers import AutoModelForCausalLM

    steps, async_level = 6, 2
    config = write_config(tmp_path / "config.yaml", tiny_model, "run", steps, async_level, extra="  continuous: true\n")
    text = config.read_text().replace(f"max_tokens: {MAX_TOKENS}}}", "max_tokens: 320, extra_body: {ignore_eos: true}}")
    config.write_text(text.replace("max_concurrent: 8", f"max_concurrent: {GROUP}"))
    run_dir = run_with_stand_in(config, server, tiny_model, steps, tmp_path / "logs", versioned_trainer)

    models = {v: AutoModelForCausalLM.from_pretrained(scaled_version(tiny_model, v, tmp_path / f"v{v}"),
                                                      dtype=torch.float32).eval() for v in range(steps)}
    mixed = 0
    for step in range(steps):
        batch = read_batch(RunDir(run_dir), step, WORLD, async_level)  # the trainer's own checks
        m = batch.metrics
        assert m["rollouts"] == BATCH and m["errored"] == 0
        assert batch.policy_version == m["policy_version"] >= step - async_level
        assert m["off_policy_steps"] <= async_level
        assert {"stale_groups", "mixed_version_frac", "weight_update_s", "generation_s"} <= set(m)
        for rank in batch.micro_batches:
            for mb in rank:
                for ids, mask, logprobs, _ in (samples_of(mb) if mb["num_samples"] else []):
                    # Its group started at version policy_version or later; batch `step` was written
                    # before version step + 1 existed.
                    candidates = {v: models[v] for v in range(batch.policy_version, step + 1)}
                    versions = versions_of_tokens(candidates, ids, mask, logprobs)
                    assert -1 not in versions, versions
                    mixed += versions[0] != versions[-1]
    assert mixed > 0, "no sample spans a weight update"
    log = (tmp_path / "logs" / "orchestrator" / "rank_0.log").read_text()
    assert "continuous: requests in flight across batches" in log and "requests kept running" in log
    print(f"continuous: {mixed} of {steps * BATCH} samples hold tokens of two or more versions")
