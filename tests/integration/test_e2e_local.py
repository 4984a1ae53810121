"""The whole RL loop on this machine (`prl submit --local`): real vLLM (CPU build), real verifiers
environments, real torch.distributed trainer, on the tiny offline model; an SFT job (the trainer
alone, tests/conftest.py's sft_run) whose weights an RL run starts from. The same SFT job preempted on
the Slurm test cluster: tests/cluster/test_sft_cluster.py.

    pytest tests/integration/test_e2e_local.py
"""

import itertools
import json
import math
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import NO_WANDB, SFT_STEPS, TOY, metrics, prl, tiny_model_dir

from prl.envs.toy import target_fraction
from prl.run.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def prl_local(tmp_path, *overrides, config=TOY):
    args = [sys.executable, "-m", "prl.control.cli", "submit", str(config), "--local", f"run.output_dir={tmp_path}",
            f"model.name={tiny_model_dir()}", f"inference.port={free_port()}", NO_WANDB, *overrides]
    return subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout=600):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def assert_clean_logs(run: Path):
    for log in run.glob("logs/attempt_*/*/*"):
        if log.suffix not in (".log", ".out"):
            continue
        text = log.read_text()
        if (log.parent.parent / "preempted").exists():
            # torchrun reports the ranks' deliberate exit 42 after a requested checkpoint this way
            text = re.sub(r"Traceback \(most recent call last\):.*?ChildFailedError", "", text, flags=re.S)
        assert "Traceback" not in text, f"traceback in {log}"


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory) -> Path:
    """The embedded default, weights by file: 20 steps on the toy task with online evals of versions
    0, 10 and 20 (32 held-out prompts, 2 rollouts each: pass@1 and pass@2 of a target share >= 0.4);
    also the reference of the broadcast test."""
    base = tmp_path_factory.mktemp("toy")
    rc, out = finish(prl_local(base, "orchestrator.eval.interval=10", *TOY_EVAL))
    assert rc == 0, out
    return base / "toy"


TOY_EVAL = ["orchestrator.eval.num_examples=32", "orchestrator.eval.rollouts_per_example=2",
            "orchestrator.eval.pass_k=[1,2]", "orchestrator.eval.pass_threshold=0.4"]


def brute_force_pass_at_k(completions: Path, k: int, threshold: float) -> tuple[float, float]:
    """pass@k and avg@k counted over every k-subset of each example's rollouts in an eval's completions file."""
    by_example: dict[int, list[float]] = {}
    for line in completions.read_text().splitlines():
        c = json.loads(line)
        by_example.setdefault(c["example_id"], []).append(0.0 if c["error"] else c["reward"])
    subsets = [list(itertools.combinations(r, k)) for r in by_example.values()]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return (mean([mean([any(x >= threshold for x in s) for s in subs]) for subs in subsets]),
            mean([mean([mean(s) for s in subs]) for subs in subsets]))


def test_toy_run_learns(toy_run):
    """The reward must clearly rise, also on the held-out prompts of the online evals."""
    run = toy_run
    steps = metrics(run, 0)
    assert [m["step"] for m in steps] == list(range(20))
    rewards = [m["rollout/reward_mean"] for m in steps]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"\ntoy reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}; curve {[round(r, 3) for r in rewards]}")
    assert last > first + 0.08
    assert [m["env/toy/reward_mean"] for m in steps] == rewards  # the one environment's own metrics
    evals = {v: json.loads((run / f"evals/step_{v}.json").read_text()) for v in (0, 10, 20)}
    print(f"toy eval reward (32 held-out prompts x 2) at versions 0, 10, 20: {[round(e['reward_mean'], 3) for e in evals.values()]}")
    assert sorted(p.name for p in (run / "evals").glob("step_*.json")) == ["step_0.json", "step_10.json", "step_20.json"]
    assert all(e["rollouts"] == 64 and e["source"] == "online" for e in evals.values())
    assert evals[20]["reward_mean"] > evals[0]["reward_mean"] + 0.08
    # pass@k and avg@k (orchestrator.eval.pass_k) are the counts over every k-subset of the saved completions.
    for v, e in evals.items():
        toy = e["environments"]["toy"]
        print(f"toy eval version {v}: " + ", ".join(f"{key} {toy[key]:.3f}" for key in ("pass@1", "pass@2", "avg@2")))
        for k in (1, 2):
            brute = brute_force_pass_at_k(run / f"evals/step_{v}.completions.jsonl", k, 0.4)
            assert (toy[f"pass@{k}"], toy[f"avg@{k}"]) == pytest.approx(brute, abs=1e-12), (v, k)
        assert toy["pass@1"] <= toy["pass@2"] and toy["avg@2"] == pytest.approx(toy["reward_mean"])
    assert evals[20]["environments"]["toy"]["pass@2"] > evals[0]["environments"]["toy"]["pass@2"]
    # Versions 0 and 10 were evaluated beside the batches they generated (async_level 1: batches 0 and 11).
    logged = {m["step"]: m["eval/reward_mean"] for m in steps if "eval/reward_mean" in m}
    assert logged == {0: evals[0]["reward_mean"], 11: evals[10]["reward_mean"]}
    assert all(math.isfinite(m["train/loss"]) and math.isfinite(m["train/grad_norm"]) for m in steps)
    assert_startup_metrics(steps, 0)
    # From step 1 on, each step says how long the previous version took to be published (its background write).
    assert "perf/publish_s" not in steps[0] and all(m["perf/publish_s"] > 0 for m in steps[1:]), steps[1]
    assert (run / "weights/step_20/COMPLETE").exists() and (run / "checkpoints/step_20/COMPLETE").exists()
    # The local launch took the run over (prl.run.fence), its COMPLETE markers name it, and nothing of
    # the run is more than its owner's (the components create under prl submit's umask).
    writer = (run / "writer").read_text()
    assert writer.startswith("job=local restart=0 attempt=0 nonce=") and writer == (run / "logs/attempt_0/writer").read_text()
    assert {p.read_text() for p in [*run.glob("weights/step_*/COMPLETE"), *run.glob("checkpoints/step_*/COMPLETE")]} == {writer}
    assert not [p for p in [run, *run.rglob("*")] if not p.is_symlink() and p.lstat().st_mode & 0o077]
    assert_clean_logs(run)


def assert_startup_metrics(steps: list[dict], first: int) -> None:
    """The first step of a launch, and it alone, says when each part was ready, in seconds since the
    launch: the servers before the first batch, the batch and the trainer before the first step."""
    startup = [{k: v for k, v in m.items() if k.startswith("startup/")} for m in steps]
    assert [m["step"] for m, s in zip(steps, startup) if s] == [first], startup
    s = startup[0]
    print(f"\nstartup of the launch at step {first}: {s}")
    assert 0 < s["startup/servers_ready_s"] <= s["startup/first_batch_s"] <= s["startup/first_step_s"], s
    assert 0 < s["startup/trainer_ready_s"] <= s["startup/first_step_s"], s


def interrupt_after(tmp_path, overrides: list[str], steps: int) -> tuple[Path, int]:
    """A local run SIGTERMed (Ctrl-C) once `steps` steps are done: it exits 130 and its last checkpoint
    is the step it had reached. (run directory, steps done)"""
    proc = prl_local(tmp_path, *overrides)
    run = tmp_path / "toy"
    deadline = time.monotonic() + 300
    while len(metrics(run, 0)) < steps:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "timeout"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    rc, out = finish(proc)
    assert rc == 130, out
    done = len(metrics(run, 0))
    ckpts = sorted(int(p.parent.name[5:]) for p in run.glob("checkpoints/step_*/COMPLETE"))
    assert ckpts and ckpts[-1] == done, (ckpts, done)
    return run, done


def test_continuous_mode_by_broadcast_interrupted_and_resumed(tmp_path):
    """orchestrator.continuous with inference.weight_transfer=broadcast through the lifecycle: every
    version the trainer exports reaches the servers by broadcast while requests run; SIGTERM mid-run
    checkpoints step k (the groups in flight are cancelled) and --resume goes on from step k to the
    end; every batch keeps the staleness bound."""
    overrides = ["run.max_steps=6", "trainer.checkpoint.interval=0", "orchestrator.continuous=true",
                 "inference.weight_transfer=broadcast", "orchestrator.batch_size=32"]
    run, done = interrupt_after(tmp_path, overrides, 2)
    assert done < 6
    rc, out = finish(prl_local(tmp_path, *overrides, "--resume"))
    assert rc == 0, out
    assert [m["step"] for m in metrics(run, 1)] == list(range(done, 6))
    assert_startup_metrics(metrics(run, 1), done)  # the resumed launch's own, in continuous mode
    for attempt in (0, 1):
        log = (run / f"logs/attempt_{attempt}/orchestrator/rank_0.log").read_text()
        assert "continuous: requests in flight across batches" in log
        loads = re.findall(r"policy version (\d+) by (\w+), requests kept running", log)
        # The resumed trainer's first version is done + 1, and the last batch (5) needs version 4 at
        # most: stopped at step 4 or later, the resumed attempt has no version to receive by broadcast.
        assert any(how == "broadcast" for _, how in loads) or (attempt == 1 and done + 1 > 4), loads
        for version, how in loads:
            # Version `done` is exported as the trainer stops: the orchestrator may find the broadcast
            # gone and take the file. The resumed trainer exports the versions after it; those before
            # it are files by then.
            if int(version) != done:
                assert how == ("file" if attempt and int(version) < done else "broadcast"), loads
        for m in metrics(run, attempt):
            assert m["step"] - 1 <= m["rollout/policy_version"] <= m["step"], m
            assert 0.0 <= m["rollout/mixed_version_frac"] <= 1.0 and m["rollout/stale_groups"] >= 0
    assert (run / "weights/step_6/COMPLETE").exists()
    assert_clean_logs(run)


SHORT = ["run.max_steps=2", "orchestrator.batch_size=16", "orchestrator.rollouts_per_example=4",
         "orchestrator.sampling.max_tokens=32", "orchestrator.eval.interval=2", "orchestrator.eval.num_examples=8"]


ENVS = ("reverse_text", "hendrycks_math")
OVERLONG = {"reverse_text": "{mode: penalty, buffer: 8, penalty: 0.5}", "hendrycks_math": "{mode: mask}"}


@pytest.fixture(scope="module")
def two_envs_run(tmp_path_factory, sft_run) -> Path:
    """Two steps of reverse_text and hendrycks_math side by side (half of each step's examples from
    each), with online evals of versions 0 and 2 (8 held-out examples of each), from the SFT job's
    last weights (model.name=RUN/weights/step_12); up to 2 prompts of refill per environment and step,
    reverse_text's over-long completions penalised, hendrycks_math's masked."""
    base = tmp_path_factory.mktemp("two_envs")
    envs = ",".join(f"{{id: prl.envs.{name}, overlong: {OVERLONG[name]}}}" for name in ENVS)
    rc, out = finish(prl_local(base, "orchestrator.environment=null", f"orchestrator.environments=[{envs}]", *SHORT,
                               "orchestrator.refill_max_prompts=2",
                               f"model.name={sft_run / f'weights/step_{SFT_STEPS}'}"))
    assert rc == 0, out
    return base / "toy"


def test_sft_learns_the_answers_and_writes_weights_an_rl_config_can_name(sft_run):
    steps = metrics(sft_run, 0)
    assert [m["step"] for m in steps] == list(range(SFT_STEPS))
    loss = [m["train/loss"] for m in steps]
    print(f"\nSFT loss per step: {[round(x, 3) for x in loss]}")
    assert sum(loss[-3:]) / 3 < 0.6 * sum(loss[:3]) / 3
    assert all(m["train/loss_tokens"] > 0 and m["sft/truncated"] == 0 for m in steps)
    assert steps[-1]["sft/epoch"] == SFT_STEPS * 32 / 256
    assert sorted(p.parent.name for p in sft_run.glob("checkpoints/step_*/COMPLETE")) == ["step_12", "step_8"]  # keep_last 2
    weights = sft_run / f"weights/step_{SFT_STEPS}"
    assert (weights / "COMPLETE").exists() and (weights / "tokenizer.json").exists()
    assert sorted(p.name for p in (sft_run / "logs/attempt_0").iterdir() if p.is_dir()) == ["trainer"]
    status = prl("status", str(sft_run))
    assert status.returncode == 0 and "loss:" in status.stdout and f"step {SFT_STEPS}/{SFT_STEPS}" in status.stdout, status.stdout
    shown = prl("watch", str(sft_run), "--once")  # one pane: the trainer's
    assert "trainer" in shown.stdout and "inference" not in shown.stdout and "orchestrator" not in shown.stdout
    refused = prl("eval", str(sft_run), "--local")  # no orchestrator.eval: it says so instead of failing later
    assert refused.returncode == 2 and "is an SFT job" in refused.stderr, refused.stderr


def test_reverse_text_and_hendrycks_math_run_with_online_evals(two_envs_run, sft_run):
    run = two_envs_run
    # The RL run started from the SFT weights: vLLM served them, and its rollouts answer in vowels
    # (the base model's share is about 0.27: test_toy_run_learns's first steps).
    served = (run / "logs/attempt_0/inference/rank_0.log").read_text()
    assert f"--model {sft_run / f'weights/step_{SFT_STEPS}'}" in served
    texts = [c.get("content") or "" for line in (run / "rollouts/step_0.completions.jsonl").read_text().splitlines()
             for c in json.loads(line)["completion"]]
    vowels = sum(target_fraction(t, "aeiou") * len(t) for t in texts) / max(1, sum(map(len, texts)))
    print(f"\nRL from the SFT weights: vowel share of step 0's completions {vowels:.3f}")
    assert vowels > 0.6
    steps = metrics(run, 0)
    assert [m["step"] for m in steps] == [0, 1]
    assert all(0.0 <= m["rollout/reward_mean"] <= 1.0 for m in steps)
    for version in (0, 2):
        record = json.loads((run / f"evals/step_{version}.json").read_text())
        assert record["rollouts"] == 16 and sorted(record["environments"]) == sorted(ENVS)
        assert all(e["rollouts"] == 8 for e in record["environments"].values()), record
    assert steps[0]["eval/policy_version"] == 0.0
    for name in ENVS:
        assert f"eval/{name}/reward_mean" in steps[0] and f"env/{name}/reward_mean" in steps[0], steps[0]
    # Dynamic sampling: the tiny model solves no math problem, so every hendrycks_math group has equal
    # rewards and is left out; it draws its bound of 2 more prompts each step, to no avail. Over-long:
    # the rules of each environment, and its truncation rate.
    for m in steps:
        print(f"step {m['step']}: " + ", ".join(f"{k} {m[k]:.3f}" for k in sorted(m) if k.startswith("env/") and
                                                 k.rsplit("/", 1)[1] in ("prompts_drawn", "refill_prompts", "truncated_frac",
                                                                          "overlong_masked", "overlong_penalty_mean")))
        assert m["env/hendrycks_math/refill_prompts"] == 2.0 and m["env/hendrycks_math/prompts_drawn"] == 4.0, m
        assert 0 <= m["env/reverse_text/refill_prompts"] <= 2 and m["rollout/groups_trained"] <= 4
        assert m["rollout/prompts_drawn"] == 4 + m["rollout/refill_prompts"]
        assert m["rollout/rollouts"] == 4 * (4 + m["rollout/refill_prompts"] - m["rollout/refill_surplus"])
        math_rollouts = 4 * 4
        assert m["env/hendrycks_math/overlong_masked"] == round(m["env/hendrycks_math/truncated_frac"] * math_rollouts)
        assert m["env/reverse_text/overlong_masked"] == 0 and m["env/hendrycks_math/overlong_penalty_mean"] == 0
    status = prl("status", str(run))
    assert re.search(r"^truncated:   hendrycks_math \d+%, reverse_text \d+% of step 1's rollouts", status.stdout, re.M), status.stdout


def test_a_fork_of_the_toy_run_starts_from_its_checkpoint_with_a_config_of_its_own(tmp_path, toy_run):
    """`prl submit --from RUN:20`: a new run directory whose trainer resumes the toy run's checkpoint 20
    (weights, optimizer, data position) under its own settings (another lr), trains steps 20 and 21
    and records where it came from. Its config adds a teacher (on-policy distillation,
    docs/distillation.md): the toy run's own weights/step_20, served beside the policy by the inference
    component. Both batches come from version 20 (the fork's first, and async_level 1), the teacher's
    very weights: on CPU its logprobs of every completion token are the sampler's, bit for bit, so the
    KL is exactly 0, and any misalignment of the two (a token off) would show."""
    teacher, port = toy_run / "weights/step_20", free_port()
    rc, out = finish(prl_local(tmp_path, "run.name=fork", "run.max_steps=22", "trainer.lr=1e-3",
                               "orchestrator.eval.interval=0", f"teacher.model={teacher}", f"teacher.port={port}",
                               "trainer.loss.teacher_kl_coef=1.0", "orchestrator.filter_zero_advantage=false",
                               "--from", f"{toy_run}:20"))
    assert rc == 0, out
    run = tmp_path / "fork"
    steps = metrics(run, 0)
    assert [m["step"] for m in steps] == [20, 21]
    assert "resumed from checkpoint step 20" in (run / "logs/attempt_0/trainer/rank_0.log").read_text()
    assert (run / "weights/step_22/COMPLETE").exists() and not (run / "weights/step_20").is_symlink()
    assert json.loads((run / "fork.json").read_text())["from"] == str(toy_run)
    assert f"forked from: {toy_run} at step 20" in prl("status", str(run)).stdout
    assert (toy_run / "checkpoints/step_20/COMPLETE").exists() and not (toy_run / "weights/step_21").exists()
    # Distillation: the teacher's server ran the toy run's weights; its logprobs of every completion
    # token reached the batch, and the trainer's loss logged their KL: 0, the student being the teacher.
    served = (run / "logs/attempt_0/inference/rank_teacher_0.log").read_text()
    assert f"--model {teacher} " in served and "teacher node 0" in served
    for m in steps:
        print(f"step {m['step']}: reward {m['rollout/reward_mean']:.3f}, teacher_kl {m['train/teacher_kl']!r}, "
              f"teacher_s {m['rollout/teacher_s']:.2f}, policy v{m['rollout/policy_version']:.0f}")
        assert m["train/teacher_kl"] == 0.0 and m["rollout/policy_version"] == 20
        assert m["rollout/teacher_tokens"] == m["train/loss_tokens"] > 0
    batch = torch.load(run / "rollouts/step_21.pt", weights_only=True)
    for mb in batch["micro_batches"][0]:
        mask, teacher_lp = mb["loss_mask"], mb["teacher_logprobs"]
        assert teacher_lp.shape == mb["input_ids"].shape and (teacher_lp[~mask] == 0).all()
        assert torch.equal(teacher_lp[mask], mb["behaviour_logprobs"][mask]) and (teacher_lp[mask] < 0).all()
    with socket.socket() as probe:  # the teacher's server ended with the run
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    assert_clean_logs(run)


def test_prl_eval_local_rescores_saved_weights_as_the_online_eval_did(two_envs_run):
    """`prl eval --local` serves weights/step_2 with a vLLM of its own: same seeds, same rows, so on
    CPU the same rewards as the online eval of version 2 (which ran on the training servers)."""
    online = json.loads((two_envs_run / "evals/step_2.json").read_text())
    r = prl("eval", str(two_envs_run), "--steps", "2", "--local", cwd=two_envs_run, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads((two_envs_run / "evals/step_2.json").read_text())
    assert record["source"] == "prl eval" and record["weights"] == str(two_envs_run / "weights/step_2")
    assert record["environments"] == online["environments"]
    assert (two_envs_run / "evals/logs/step_2/server.out").is_file()
    status = prl("status", str(two_envs_run))
    assert f"step 2 reward {record['reward_mean']:.3f}" in status.stdout


def test_a_lora_run_moves_adapter_versions_by_broadcast_and_prl_eval_serves_them(tmp_path):
    """trainer.lora with weights by broadcast: every version the servers load after version 0 is an
    adapter (megabytes) folded into the base by each worker; the files beside them are peft's
    adapter files, which `prl eval --local` serves the same way (base, then the version loaded)."""
    rc, out = finish(prl_local(tmp_path, "run.max_steps=4", "trainer.lora.rank=8", "trainer.lr=1e-4",
                               "inference.weight_transfer=broadcast", "orchestrator.eval.interval=0"))
    assert rc == 0, out
    run = tmp_path / "toy"
    log = (run / "logs/attempt_0/orchestrator/rank_0.log").read_text()
    assert re.findall(r"servers now at policy version (\d+) by (\w+)", log) == [("1", "broadcast"), ("2", "broadcast")], log
    trainer_log = (run / "logs/attempt_0/trainer/rank_0.log").read_text()
    sizes = [float(mib) for mib in re.findall(r"version \d+ broadcast: ([\d.]+) MiB", trainer_log)]
    assert sizes and max(sizes) < 0.5, sizes  # the adapters alone (0.1 MiB): the tiny model is 1.6 MiB
    assert sorted(p.name for p in (run / "weights/step_4").iterdir()) == ["COMPLETE", "adapter_config.json",
                                                                           "adapter_model.safetensors"]
    r = prl("eval", str(run), "--steps", "4", "--local", cwd=run, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads((run / "evals/step_4.json").read_text())
    assert record["weights"] == str(run / "weights/step_4") and record["rollouts"] > 0
    served = (run / "evals/logs/step_4/inference/rank_0.log").read_text()
    assert f"vllm serve --model {tiny_model_dir()} " in served  # the base, then the version into it
    assert f"weights updated from {run / 'weights/step_4'}" in served, served[-2000:]
    assert_clean_logs(run)


def test_malformed_environment_args_fail_clearly(tmp_path):
    rc, out = finish(prl_local(tmp_path, "orchestrator.environment.args.target_chars=7"))
    assert rc == 13, out  # the orchestrator's exit status
    log = next((tmp_path / "toy/logs/attempt_0/orchestrator").glob("*")).read_text()
    assert "orchestrator.environment.args.target_chars" in log
    assert "orchestrator failed" in out
