"""The `orchestrator` section: rollouts, sampling, training environments, online evals, batches."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from prl.config.common import _check, _one_of, _positive
from prl.config.slurm import ComponentSlurm, _check_batch_options
from prl.config.validate import check_sampling

PLACEMENTS = ("own_node", "trainer_node")


@dataclass(kw_only=True)
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature for rollouts (> 0); the trainer's log-probabilities use the same one."""
    top_p: float = 1.0
    """Nucleus sampling: must be 1 (the trainer computes full-softmax log-probabilities; see
    docs/architecture.md, "Sampling"). Sent with every request, over the environment's own top_p."""
    max_tokens: int = 256
    """Completion length limit per turn."""
    extra_body: dict[str, Any] = field(default_factory=dict)
    """vLLM request fields sent with every rollout request, over the environment's own; e.g.
    `{ignore_eos: true}`: every completion is exactly max_tokens long (benchmarks/rl_bench.py)."""

    def __post_init__(self) -> None:
        _check(self.temperature > 0, "orchestrator.sampling.temperature",
               f"must be > 0, got {self.temperature}: the trainer divides the logits by it (greedy decoding "
               "samples from no distribution whose log-probabilities it could compute)")
        check_sampling({"top_p": self.top_p}, "orchestrator.sampling", self.temperature)
        check_sampling(self.extra_body, "orchestrator.sampling.extra_body", self.temperature)
        _positive(self.max_tokens, "orchestrator.sampling.max_tokens")


_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)
_ENV_LABEL = re.compile(r"[A-Za-z0-9_.-]+", re.ASCII)


OVERLONG_MODES = ("keep", "mask", "penalty")


@dataclass(kw_only=True)
class OverlongConfig:
    """What becomes of an environment's over-long completions (docs/environments.md, "Over-long completions")."""

    mode: str = "keep"
    """keep: trained as they are; mask: truncated rollouts (a turn stopped at sampling.max_tokens) are left
    out of the loss, still in their group's baseline; penalty: DAPO's soft overlong punishment, a turn
    longer than max_tokens - buffer tokens loses (length - (max_tokens - buffer)) / buffer x penalty
    of its reward, up to `penalty` at the limit, before advantages."""
    buffer: int = 0
    """penalty: the tokens before orchestrator.sampling.max_tokens over which the penalty grows (> 0, < max_tokens)."""
    penalty: float = 1.0
    """penalty: what a completion at the length limit loses from its reward (> 0)."""

    def check(self, path: str) -> None:
        _one_of(self.mode, OVERLONG_MODES, f"{path}.overlong.mode")
        _check(self.mode != "penalty" or self.buffer > 0, f"{path}.overlong.buffer",
               f"mode penalty needs a buffer of tokens > 0, got {self.buffer}")
        _check(math.isfinite(self.penalty) and self.penalty > 0, f"{path}.overlong.penalty",
               f"must be a finite number > 0, got {self.penalty}")


# --- environments and evals (issue 11: several environments, online evals) -------------------------
@dataclass(kw_only=True)
class EnvironmentConfig:
    id: str
    """Environment module with `load_environment(**args)` (e.g. prl.envs.reverse_text)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for `load_environment`."""
    name: str | None = None
    """Its name in metrics (`env/<name>/reward_mean`, `eval/<name>/...`); None: the module's last part."""
    ratio: float = 1.0
    """Training environments: relative share of each step's examples (orchestrator.environments)."""
    api: str = "classic"
    """Which verifiers API `id` is written for: "classic" (a module with `load_environment`, verifiers 0.3,
    run in the orchestrator) or "v1" (an installed verifiers v1 taskset package, run in an environment
    worker under `python`; docs/environments.md)."""
    python: str = ".venv-v1/bin/python"
    """api v1: the Python of the environment worker, with verifiers>=0.4 and the package installed
    (tools/setup.sh makes .venv-v1); relative paths are from prl's home."""
    harness: str = "prl_chat"
    """api v1: the verifiers harness id each episode's agent runs (prl_chat: in the worker, nothing installed)."""
    env: str | None = None
    """api v1: the verifiers Env that plays the taskset (an installed module exporting one, e.g. prl_toy_duo:
    two seats); None: the taskset package's own Env if it exports one, else one `agent` seat. An episode
    of several seats gives a sample per seat's trace, each seat's advantage taken over its own traces."""
    renderer: dict[str, Any] = field(default_factory=dict)
    """api v1: the `renderers` config the worker renders conversations to token ids with, e.g. {name: qwen3,
    enable_thinking: false}; checked at submit. Empty: renderers picks one from the model's name, and for a
    model it does not know its default renderer, which cannot carry a conversation on to a later turn."""
    max_tokens: int | None = None
    """This environment's completion length limit per turn, in training and in its evals (where
    orchestrator.eval.sampling.max_tokens, if set, still wins); None: orchestrator.sampling.max_tokens. For
    runs whose environments need different lengths (a tool call beside short answers): each turn of every
    environment otherwise takes the longest's budget."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """Training environments: over-long completions kept, masked out of the loss, or penalised (DAPO)."""
    server_workers: int = 0
    """api v1: 0 runs the episodes in the environment worker, the orchestrator's child; N >= 1 runs them in
    verifiers v1's environment server (`verifiers.v1.serve`), a component of the run of its own (`envserver`,
    on the orchestrator's node, reached through a unix socket in its private scratch) with N worker processes
    (1: the server's own process), for environments whose episodes need CPU: harnesses, sandboxes, scoring."""

    @property
    def label(self) -> str:
        return self.name or self.id.rpartition(".")[2]

    def loads_as(self, other: EnvironmentConfig | None) -> bool:
        """Whether `other` loads the environment this entry loads: every field but the share of the steps
        (ratio) and the over-long rule, which act on the batch (an eval entry written as a training one)."""
        return other is not None and replace(other, ratio=self.ratio, overlong=self.overlong) == self

    def check(self, path: str) -> None:
        """Per-field checks; `path` names the entry (orchestrator.environment, ...environments[1])."""
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens > 0),
               f"{path}.max_tokens", f"must be a whole number > 0, got {self.max_tokens!r}")
        _check(bool(_MODULE.fullmatch(self.id)), f"{path}.id",
               f"must be a Python module name such as prl.envs.toy, got {self.id!r}")
        for key in self.args:
            _check(key.isidentifier(), f"{path}.args.{key}", "is not a keyword argument name")
        _check(self.name is None or bool(_ENV_LABEL.fullmatch(self.name)), f"{path}.name",
               f"must be letters, digits, '_', '.' or '-' (it becomes a metric name), got {self.name!r}")
        _check(math.isfinite(self.ratio) and self.ratio > 0, f"{path}.ratio",
               f"must be a finite number > 0, got {self.ratio}")
        _check(self.api in ("classic", "v1"), f"{path}.api", f"must be classic or v1, got {self.api!r}")
        _check(not self.renderer or self.api == "v1", f"{path}.renderer", "is read by v1 environments only (api: v1)")
        _check(self.env is None or self.api == "v1", f"{path}.env", "is read by v1 environments only (api: v1)")
        _check(self.env is None or bool(_MODULE.fullmatch(self.env)), f"{path}.env",
               f"must be a Python module name such as prl_toy_duo, got {self.env!r}")
        _check(not self.renderer or isinstance(self.renderer.get("name"), str), f"{path}.renderer.name",
               "must name a renderer (qwen3, llama-3, ...: renderers' RendererConfig)")
        _check(self.server_workers >= 0, f"{path}.server_workers", f"must be >= 0, got {self.server_workers}")
        _check(not self.server_workers or self.api == "v1", f"{path}.server_workers",
               "is read by v1 environments only (api: v1): a classic environment runs in the orchestrator")
        self.overlong.check(path)


def _check_environments(envs: list[EnvironmentConfig], paths: list[str]) -> None:
    """Each entry's fields, and names that tell the entries apart in metrics."""
    seen: dict[str, str] = {}
    for env, path in zip(envs, paths):
        env.check(path)
        _check(env.label not in seen, f"{path}.name", f"{env.label!r} is already the name of {seen.get(env.label)}; "
               "give each environment its own name")
        seen[env.label] = path


def split_examples(per_step: int, ratios: list[float]) -> list[int]:
    """Examples per environment in every step: `per_step` split by `ratios` with the largest-remainder
    rule (each gets the floor of its quota, the examples left over go to the largest fractional
    parts, ties to the earlier entry). The same split every step, so a batch mixes all environments."""
    quotas = [per_step * r / sum(ratios) for r in ratios]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(ratios)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: per_step - sum(counts)]:
        counts[i] += 1
    return counts


@dataclass(kw_only=True)
class EvalSamplingConfig:
    temperature: float | None = None
    """Eval sampling temperature; None: orchestrator.sampling.temperature."""
    top_p: float | None = None
    """Eval nucleus sampling; None: orchestrator.sampling.top_p."""
    max_tokens: int | None = None
    """Eval completion length limit per turn; None: orchestrator.sampling.max_tokens."""

    def __post_init__(self) -> None:
        p = "orchestrator.eval.sampling"
        _check(self.temperature is None or self.temperature >= 0, f"{p}.temperature", "must be >= 0")
        _check(self.top_p is None or 0 < self.top_p <= 1, f"{p}.top_p", "must be in (0, 1]")
        _check(self.max_tokens is None or self.max_tokens > 0, f"{p}.max_tokens", "must be > 0")


@dataclass(kw_only=True)
class EvalConfig:
    interval: int = 0
    """Online eval of every policy version that is a multiple of this, including 0 (the base model) and
    the final one, on each eval environment's held-out split; 0: no online evals. `prl eval` uses
    the rest of this section for saved weights whatever the interval."""
    num_examples: int = -1
    """Examples per eval environment: the first this many of its eval split; -1: all of it."""
    rollouts_per_example: int = 1
    """Rollouts per eval example."""
    pass_k: list[int] = field(default_factory=list)
    """The k of pass@k and avg@k reported per eval environment (each 1 <= k <= rollouts_per_example),
    estimated without bias from the rollouts_per_example rollouts of each example (docs/evals.md)."""
    pass_threshold: float = 1.0
    """pass@k: a rollout passes when its reward is at least this (1.0: a correct answer of a 0/1 rubric)."""
    sampling: EvalSamplingConfig = field(default_factory=EvalSamplingConfig)
    """Eval sampling; unset keys take orchestrator.sampling's values."""
    environments: list[EnvironmentConfig] = field(default_factory=list)
    """Eval environments; empty: the training environments, as configured (their `eval_dataset`,
    verifiers' held-out split, else their training data)."""

    def __post_init__(self) -> None:
        _check(self.interval >= 0, "orchestrator.eval.interval", "must be >= 0")
        _check(self.num_examples == -1 or self.num_examples > 0, "orchestrator.eval.num_examples",
               f"must be -1 (all) or > 0, got {self.num_examples}")
        _positive(self.rollouts_per_example, "orchestrator.eval.rollouts_per_example")
        for k in self.pass_k:
            _check(1 <= k <= self.rollouts_per_example, "orchestrator.eval.pass_k",
                   f"k={k} must be between 1 and orchestrator.eval.rollouts_per_example={self.rollouts_per_example} "
                   "(pass@k is estimated from the rollouts of each example)")
        _check(math.isfinite(self.pass_threshold), "orchestrator.eval.pass_threshold", "must be a finite number")
        paths = [f"orchestrator.eval.environments[{i}]" for i in range(len(self.environments))]
        _check_environments(self.environments, paths)
        for env, path in zip(self.environments, paths):
            _check(env.ratio == 1.0, f"{path}.ratio", "only training environments have ratios")
            _check(env.overlong.mode == "keep", f"{path}.overlong.mode", "evals score what the model wrote; "
                   "only training environments mask or penalise over-long completions")
# --- end of environments and evals ----------------------------------------------------------------


@dataclass(kw_only=True)
class OrchestratorConfig:
    placement: str = "own_node"
    """own_node: its own node (het group 2); trainer_node: shares the first trainer node."""
    cpus: int = 2
    """CPUs for the orchestrator task."""
    environment: EnvironmentConfig | None = None
    """The verifiers environment to train on (or several: `environments`; exactly one of the two)."""
    environments: list[EnvironmentConfig] = field(default_factory=list)
    """Several training environments, each step's examples split among them by `ratio`."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Online evals during training, and what `prl eval` runs on saved weights."""
    batch_size: int = 64
    """Rollouts per step (all groups together): batch_size / rollouts_per_example examples, split by ratio.
    An api v1 environment whose episodes have several seats gives a rollout per seat's trace: its groups
    hold rollouts_per_example x seats (docs/environments.md)."""
    rollouts_per_example: int = 8
    """Group size for group-relative advantages (episodes per example)."""
    max_concurrent: int = 64
    """Requests in flight to the inference servers."""
    continuous: bool = False
    """Keep max_concurrent requests in flight across batches and load each policy version into the
    servers as soon as the trainer publishes it, while requests run: they pause, their KV cache is
    recomputed under the new weights, and they go on, so one sample may hold tokens of several
    versions, each with vLLM's logprob of the version that drew it. Groups of batch n start at
    version >= n - async_level as in the default mode; batch n takes the first to finish, and one
    that finishes too late for that bound is dropped as stale. Needs trainer.behaviour_logprobs
    inference and run.async_level >= 1. A batch then depends on timing: a resumed run goes on from
    its checkpoint but does not regenerate the interrupted run's batches (docs/architecture.md)."""
    normalize_advantage_std: bool = False
    """Divide group-relative advantages by the group's reward std (GRPO); off: reward - group mean."""
    filter_zero_advantage: bool = True
    """Leave groups whose rewards are all equal (advantages all zero) out of the batch, so they do not
    dilute the loss's token mean (prime-rl's buffer drops them too). Off: trained with advantage 0."""
    refill_max_prompts: int = 0
    """Dynamic sampling (DAPO): when groups of a step are left out (equal rewards, every rollout errored
    or dropped), draw up to this many more prompts per training environment and step, until the
    environment holds its share of trained groups again; 0: off, the batch shrinks instead. The extra
    prompts come from a stream of their own seeded by the step, so batch n stays a function of n."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters."""
    rollout_route: str = "tokens"
    """tokens: every turn continues from the earlier turns' token ids, through vLLM's token-in/
    token-out route (prl/orchestrator/tokens.py); chat: Chat Completions, each turn re-rendered from
    text (multi-turn rollouts whose text does not re-tokenize to the sampled ids are dropped)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for the orchestrator process."""
    slurm: ComponentSlurm = field(default_factory=ComponentSlurm)
    """Batch and launch options of the orchestrator (its batch keys need placement=own_node)."""

    def __post_init__(self) -> None:
        _check_batch_options(self.slurm, "orchestrator.slurm")
        _one_of(self.placement, PLACEMENTS, "orchestrator.placement")
        _one_of(self.rollout_route, ("tokens", "chat"), "orchestrator.rollout_route")
        _positive(self.cpus, "orchestrator.cpus")
        _positive(self.batch_size, "orchestrator.batch_size")
        _positive(self.rollouts_per_example, "orchestrator.rollouts_per_example")
        _check(
            self.batch_size % self.rollouts_per_example == 0,
            "orchestrator.batch_size",
            f"{self.batch_size} is not divisible by rollouts_per_example={self.rollouts_per_example}",
        )
        _positive(self.max_concurrent, "orchestrator.max_concurrent")
        _check(self.refill_max_prompts >= 0, "orchestrator.refill_max_prompts", f"must be >= 0, got {self.refill_max_prompts}")
        _check(not (self.continuous and self.refill_max_prompts), "orchestrator.refill_max_prompts",
               "continuous mode takes the first groups to finish; it does not refill (set 0)")
        self._check_training_environments()
        self._check_served()

    def _check_training_environments(self) -> None:
        _check(self.environment is None or not self.environments, "orchestrator.environments",
               "set orchestrator.environment (one) or orchestrator.environments (several), not both; "
               "override orchestrator.environment=null to replace a single one")
        _check(self.environment is not None or bool(self.environments), "orchestrator.environment",
               "missing required value (or orchestrator.environments: a list)")
        _check_environments(self.train_environments, self.environment_paths)
        for env, path in zip(self.train_environments, self.environment_paths):
            limit = "max_tokens" if env.max_tokens else "orchestrator.sampling.max_tokens"
            _check(env.overlong.buffer < self.max_tokens_of(env), f"{path}.overlong.buffer",
                   f"{env.overlong.buffer} must be below {limit}={self.max_tokens_of(env)}")
        for count, env, path in zip(self.examples_per_env, self.train_environments, self.environment_paths):
            _check(count > 0, f"{path}.ratio", f"a ratio of {env.ratio:g} gives {env.label} none of the "
                   f"{self.batch_size // self.rollouts_per_example} examples of a step; raise it or the batch size")

    def max_tokens_of(self, env: EnvironmentConfig) -> int:
        """The completion length limit per turn of `env`'s training rollouts: its own, else the run's."""
        return env.max_tokens or self.sampling.max_tokens

    @property
    def train_environments(self) -> list[EnvironmentConfig]:
        return [self.environment] if self.environment is not None else list(self.environments)

    @property
    def environment_paths(self) -> list[str]:
        """Config paths of train_environments, for messages."""
        if self.environment is not None:
            return ["orchestrator.environment"]
        return [f"orchestrator.environments[{i}]" for i in range(len(self.environments))]

    @property
    def examples_per_env(self) -> list[int]:
        """Examples of each training environment in every step (split_examples)."""
        per_step = self.batch_size // self.rollouts_per_example
        return split_examples(per_step, [env.ratio for env in self.train_environments])

    @property
    def eval_environments(self) -> list[EnvironmentConfig]:
        return list(self.eval.environments) or self.train_environments

    @property
    def served_environments(self) -> dict[str, EnvironmentConfig]:
        """The entries whose episodes run in the environment server (server_workers > 0), by config path:
        the training environments and the evals' own."""
        evals = [f"orchestrator.eval.environments[{i}]" for i in range(len(self.eval.environments))]
        paths = [*self.environment_paths, *evals]
        return {path: env for path, env in zip(paths, [*self.train_environments, *self.eval.environments])
                if env.server_workers}

    def _check_served(self) -> None:
        """One server component runs every served entry, in one Python."""
        served = self.served_environments
        if not served:
            return
        pythons = {env.python for env in served.values()}
        _check(len(pythons) <= 1, f"{list(served)[-1]}.python", "the environment server runs every "
               f"entry with server_workers in one Python; these name {sorted(pythons)}: give them the same `python`")

