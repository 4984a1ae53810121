"""Evals: one policy version's rewards on the eval environments' held-out splits -> RUN/evals/step_V.json.

Two callers, one code path: the orchestrator's online evals (`orchestrator.eval.interval`, see
`OnlineEval`) and `jobs/eval.py`, which `prl eval` runs on saved weights. Each eval environment
contributes the first `eval.num_examples` rows of its `eval_dataset` (verifiers' held-out split; an
environment without one falls back to its training data, with verifiers' warning), each row
`eval.rollouts_per_example` times.

Seeds: rollout r of row i of eval environment e is sampled with a seed derived from (run.seed, EVAL,
e, i, r), the same for every version: versions are compared on the same prompts under the same
sampling noise, and no eval request shares a seed with a training request. Per-request seeds also
keep the training batches what they would be without evals (vLLM samples a seeded request from its
own generator, whatever it is batched with), so exact resume holds with evals on.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from loguru import logger

from prl.config import Config, ConfigError
from prl.envs.common import EnvArgError
from prl.orchestrator.client import Servers, api_key, route_tokenizer
from prl.orchestrator.dataset import EnvGroups, derive_seed, load_env, require_tool_parser, rollout_groups
from prl.orchestrator.passk import k_metrics
from prl.orchestrator.records import error_text, plain
from prl.orchestrator.outcomes import outcome_metrics
from prl.orchestrator.rollouts import run_parts, sampling_args
from prl.run.files import write_atomic
from prl.run.rundir import RunDir, is_complete

EVAL = 0x6576616C
"""Mixed into eval seeds ("eval" in ASCII): a stream of its own."""


def eval_parts(cfg: Config, loaded: dict[str, Any] | None = None, served: bool = False) -> list[EnvGroups]:
    """The eval environments' groups with their sampling args. `loaded`: training environments
    already loaded, by name, reused for an eval entry that is the same as a training entry (the evals
    on the training environments, or an eval entry written as one of them: a v1 entry's worker, its tool
    servers included, is not started twice); `served`: the launch runs the envserver
    (prl.orchestrator.dataset.load_env)."""
    orch, ev = cfg.orchestrator, cfg.orchestrator.eval
    paths = [f"orchestrator.eval.environments[{i}]" for i in range(len(ev.environments))] or orch.environment_paths
    overrides = {k: v for k, v in vars(ev.sampling).items() if v is not None}
    training = {env_cfg.label: env_cfg for env_cfg in orch.train_environments}
    parts = []
    for i, (env_cfg, path) in enumerate(zip(orch.eval_environments, paths)):
        env = (loaded or {}).get(env_cfg.label) if env_cfg.loads_as(training.get(env_cfg.label)) else None
        env = env if env is not None else load_env(env_cfg, path, cfg, served)
        try:
            dataset = env.get_eval_dataset(n=ev.num_examples)
        except EnvArgError as e:  # a held-out split is built when first asked for
            raise ConfigError(f"{path}.args.{e.arg}: {e.message}") from None
        if len(dataset) == 0:
            raise ConfigError(f"{path}: {env_cfg.id} has no eval examples")
        seed = derive_seed(cfg.run.seed, EVAL, i)
        groups = rollout_groups(dataset, list(range(len(dataset))), ev.rollouts_per_example, seed, 0)
        sampling = sampling_args(orch.sampling, env, env_cfg.max_tokens) | overrides
        parts.append(EnvGroups(env_cfg.label, env, groups, sampling))
    return parts


async def evaluate(cfg: Config, parts: list[EnvGroups], servers: Servers, model: str) -> tuple[dict, list[dict]]:
    """Rewards of every part's rollouts: overall (over all rollouts) and per environment, with
    pass@k and avg@k for each k of orchestrator.eval.pass_k; and the rollouts (eval_completions)."""
    ev, start = cfg.orchestrator.eval, time.perf_counter()
    per_env = await run_parts(parts, servers, model, cfg.orchestrator.max_concurrent)
    overall = outcome_metrics([group for groups in per_env for group in groups])
    environments = {p.name: outcome_metrics(groups) | k_metrics(groups, ev.pass_k, ev.pass_threshold)
                    for p, groups in zip(parts, per_env)}
    result = {
        "reward_mean": overall["reward_mean"],
        "reward_std": overall["reward_std"],
        "rollouts": int(overall["rollouts"]),
        "environments": environments,
        "seconds": round(time.perf_counter() - start, 3),
    }
    return result, eval_completions(parts, per_env)


def eval_completions(parts: list[EnvGroups], per_env: list[list[list[dict]]]) -> list[dict]:
    """What the model wrote in an eval, a JSON-able dict per rollout (RUN/evals/step_V.completions.jsonl):
    environment, example, rollout (and seat, in an episode of several agents), text, reward; pass@k can be
    recounted from it."""
    return [{"environment": part.name, "example_id": output.get("example_id"), "group": g, "rollout": r,
             **({"seat": output["seat"]} if output.get("seat") is not None else {}),
             "prompt": plain(output.get("prompt")), "completion": plain(output.get("completion")),
             "answer": output.get("answer"), "reward": output.get("reward"),
             "truncated": bool(output.get("is_truncated")),
             "error": None if output.get("error") is None else error_text(output["error"])}
            for part, groups in zip(parts, per_env) for g, group in enumerate(groups) for r, output in enumerate(group)]


def make_record(cfg: Config, result: dict, version: int, weights: str, source: str) -> dict:
    """The step_V.json record: the result, which weights, when, by whom, with which eval settings."""
    ev = cfg.orchestrator.eval
    return {
        "step": version, "policy_version": version, "weights": weights, "source": source,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **result,
        "settings": {"num_examples": ev.num_examples, "rollouts_per_example": ev.rollouts_per_example,
                     "pass_k": list(ev.pass_k), "pass_threshold": ev.pass_threshold,
                     "sampling": {k: v for k, v in vars(ev.sampling).items() if v is not None}},
    }


def write_record(rd: RunDir, record: dict, completions: list[dict]) -> Path:
    """Written whole, the completions first (evals/step_V.completions.jsonl beside evals/step_V.json, whose
    presence says the eval is done); a mean over no scored rollout (every one errored) is null, as JSON has no NaN."""
    path = rd.eval_path(record["step"])
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(c, ensure_ascii=False, default=str) + "\n" for c in completions)
    write_atomic(eval_completions_path(path), text.encode("utf-8", errors="backslashreplace"), hidden=False)
    write_atomic(path, json.dumps(no_nan(record), indent=2, allow_nan=False) + "\n")
    return path


def eval_completions_path(record_path: Path) -> Path:
    """evals/step_V.json -> evals/step_V.completions.jsonl."""
    return record_path.with_name(f"{record_path.stem}.completions.jsonl")


def no_nan(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    return None if isinstance(value, float) and math.isnan(value) else value


def eval_metrics(record: dict) -> dict[str, float]:
    """The record as step metrics: eval/reward_mean, eval/policy_version, eval/NAME/KEY per environment."""
    metrics = {"eval/reward_mean": record["reward_mean"], "eval/policy_version": float(record["policy_version"])}
    for name, env_metrics in record["environments"].items():
        metrics |= {f"eval/{name}/{k}": v for k, v in env_metrics.items()}
    return metrics


def weights_label(rd: RunDir, cfg: Config, version: int) -> str:
    """What version `version` was loaded from: weights/step_V, or model.name for version 0."""
    return cfg.model.name if version == 0 else str(rd.weights_dir(version))


class OnlineEval:
    """The orchestrator's evals of every policy version V with V % eval.interval == 0 that the servers
    load (V = 0 included), and at the end of the run of the newer ones they never loaded (the final
    version among them). A version whose eval file exists is not evaluated again: after a relaunch,
    files of versions up to the resumed checkpoint are this run's (the rewind removes later ones)."""

    def __init__(self, cfg: Config, rd: RunDir, parts: list[EnvGroups]):
        self.cfg, self.rd, self.parts = cfg, rd, parts
        self.interval = cfg.orchestrator.eval.interval

    def due(self, version: int) -> bool:
        return version % self.interval == 0 and not self.rd.eval_path(version).exists()

    async def run(self, version: int, servers: Servers, model: str) -> dict[str, float]:
        """Evaluate the version the servers hold now; its metrics for the step's batch."""
        result, completions = await evaluate(self.cfg, self.parts, servers, model)
        record = make_record(self.cfg, result, version, weights_label(self.rd, self.cfg, version), "online")
        path = write_record(self.rd, record, completions)
        logger.info(f"eval of policy version {version}: reward {record['reward_mean']:.3f} over "
                    f"{record['rollouts']} rollouts in {record['seconds']:.1f}s -> {path}")
        return eval_metrics(record)

    def remaining(self, newest_loaded: int, first_step: int) -> list[int]:
        """Versions after `newest_loaded`, up to the final one, that are due; but not those older than
        this launch's first step whose weights are gone (only an earlier launch could have made them)."""
        due = []
        for v in range(newest_loaded + 1, self.cfg.run.max_steps + 1):
            if self.due(v) and (v >= first_step or is_complete(self.rd.weights_dir(v))):
                due.append(v)
            elif self.due(v):
                logger.warning(f"policy version {v} is not evaluated: its weights are gone")
        return due

    async def finish(self, newest_loaded: int, first_step: int, servers: Servers, model: str,
                     load: Callable[[int], Awaitable[None]]) -> None:
        """Evaluate the remaining versions; `load(v)` waits for version v and puts it on the servers."""
        for version in self.remaining(newest_loaded, first_step):
            await load(version)
            await self.run(version, servers, model)


async def evaluate_saved(cfg: Config, rd: RunDir, version: int, weights: str, url: str, load: bool = False) -> dict:
    """`prl eval`'s eval of saved weights that the server at `url` (http://host:port/v1) serves
    (`load`: once it has loaded them, as the training servers load a version)."""
    servers = Servers([url], api_key(cfg), max_connections=cfg.orchestrator.max_concurrent,
                      tokenizer=route_tokenizer(cfg), logprobs=False)  # scores only: nothing to train on
    try:
        if load:
            await servers.update_weights(Path(weights))
        parts = eval_parts(cfg)
        require_tool_parser(cfg, parts)
        model = await servers.model_name()
        result, completions = await evaluate(cfg, parts, servers, model)
    finally:
        await servers.close()
    record = make_record(cfg, result, version, weights, "prl eval")
    path = write_record(rd, record, completions)
    logger.info(f"eval of policy version {version}: reward {record['reward_mean']:.3f} over "
                f"{record['rollouts']} rollouts in {record['seconds']:.1f}s -> {path}")
    return record
