"""The prl run config: one typed tree of dataclasses, loaded from YAML + dotted overrides.

    from prl.config import load_config
    cfg = load_config("configs/toy.yaml", ["trainer.nodes=2"])

OmegaConf merges the YAML files and `key=value` overrides into the schema and stops there:
below `load_config` everything sees plain dataclasses. Per-field checks live in `__post_init__`
and name the field path; cross-section checks live in `Config.__post_init__`.

This module must not import torch or vllm: the login-node commands import it.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from prl.validate import (
    ConfigError, check_env_name, check_finite, check_name, check_override, check_sampling, check_sbatch_option,
    check_shape, check_slurm_time, split_import_path,
)

DTYPES = ("bfloat16", "float16", "float32")
PLACEMENTS = ("own_node", "trainer_node")
MODES = ("train", "probe")
WANDB_MODES = ("offline", "online", "disabled")
WEIGHT_TRANSFERS = ("filesystem", "broadcast")


def _check(ok: bool, path: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{path}: {message}")


def _positive(value: int | float, path: str) -> None:
    _check(value > 0, path, f"must be > 0, got {value}")


def _one_of(value: str, allowed: tuple[str, ...], path: str) -> None:
    _check(value in allowed, path, f"must be one of {', '.join(allowed)}; got {value!r}")


def _single_line(value: str | None, path: str) -> None:
    _check(value is None or "\n" not in value, path, "must be a single line (no newline)")


@dataclass(kw_only=True)
class WandbConfig:
    mode: str = "offline"
    """offline (default: files under the run dir, `wandb sync` later), online, or disabled."""
    project: str = "prl"
    """W&B project name."""
    entity: str | None = None
    """W&B entity (team or user) the run belongs to; None: the API key's default entity."""
    group: str | None = None
    """W&B group, to show related runs together (a sweep, an ablation)."""
    tags: list[str] = field(default_factory=list)
    """W&B tags of the run."""
    completions_per_step: int = 8
    """Rollouts per step logged as the W&B table `completions` (prompt, completion, reward,
    advantage; spread over the step's groups, from RUN/rollouts/step_N.completions.jsonl); 0: none."""

    def __post_init__(self) -> None:
        _one_of(self.mode, WANDB_MODES, "run.wandb.mode")
        _check(self.completions_per_step >= 0, "run.wandb.completions_per_step", "must be >= 0")
        for key in ("project", "entity", "group"):
            _single_line(getattr(self, key), f"run.wandb.{key}")


@dataclass(kw_only=True)
class RunConfig:
    name: str
    """Run name; the run directory is `output_dir/name`."""
    output_dir: str
    """Parent directory on the shared filesystem (often Lustre)."""
    mode: str = "train"
    """train: the RL programs; probe: every component only prints its wiring (cluster check)."""
    seed: int = 0
    """Seed for data order, sampling and init of everything random."""
    max_steps: int = 20
    """Number of trainer steps (policy updates)."""
    async_level: int = 1
    """Rollouts for step n come from exactly policy version max(0, n - async_level) (0: on-policy)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Metrics logging."""

    def __post_init__(self) -> None:
        check_name(self.name, "run.name")
        _check(bool(self.output_dir) and "\0" not in self.output_dir, "run.output_dir", "must be a non-empty path")
        for key in ("name", "output_dir"):
            _single_line(getattr(self, key), f"run.{key}")
            # Both end up in #SBATCH --output, where '"' and '\\' cannot be passed and '%' is a pattern.
            _check(not set('"%\\') & set(getattr(self, key)), f"run.{key}", "must not contain '\"', '\\' or '%'")
        _one_of(self.mode, MODES, "run.mode")
        _positive(self.max_steps, "run.max_steps")
        _check(self.async_level >= 0, "run.async_level", f"must be >= 0, got {self.async_level}")

    @property
    def run_dir(self) -> Path:
        """Absolute run directory (the only state of a run)."""
        return Path(os.path.abspath(os.path.expanduser(self.output_dir))) / self.name


@dataclass(kw_only=True)
class ModelConfig:
    name: str
    """HF model id or local directory (config + tokenizer + safetensors)."""
    dtype: str = "bfloat16"
    """Weights/compute dtype for inference and trainer mixed precision."""
    max_model_len: int = 2048
    """Longest prompt + completion, in tokens."""
    trust_remote_code: bool = False
    """Passed to transformers and vLLM."""

    def __post_init__(self) -> None:
        _check(bool(self.name), "model.name", "must be set")
        _one_of(self.dtype, DTYPES, "model.dtype")
        _positive(self.max_model_len, "model.max_model_len")


# Keys a component's `slurm` section may set; None there means the top-level `slurm` value.
INHERITED = ("partition", "account", "qos", "time", "constraint", "mem", "gpu_type", "gres", "exclusive",
             "extra_sbatch", "srun_args", "python")
BATCH_KEYS = INHERITED[:-2]
"""The #SBATCH options of one het group (the rest are srun-level)."""


def _check_batch_options(section: Any, path: str) -> None:
    """Checks shared by `slurm` and the components' `slurm` sections; `path` names the section."""
    for name in ("partition", "account", "qos", "time", "constraint", "mem", "gpu_type", "gres", "python"):
        _single_line(getattr(section, name), f"{path}.{name}")
        _check('"' not in (getattr(section, name) or ""), f"{path}.{name}", "must not contain '\"'")
    for key in ("extra_sbatch", "srun_args"):
        for i, line in enumerate(getattr(section, key) or []):
            _single_line(line, f"{path}.{key}[{i}]")
            _check(line.startswith("-"), f"{path}.{key}[{i}]", f"must be an option starting with '-', got {line!r}")
            check_sbatch_option(line, f"{path}.{key}[{i}]")
    if section.time:
        check_slurm_time(section.time, f"{path}.time")
    if section.mem:
        check_sbatch_option(f"--mem={section.mem}", f"{path}.mem")
    for i, line in enumerate(section.setup):
        _single_line(line, f"{path}.setup[{i}]")
    _check(section.python != "", f"{path}.python", "must be an interpreter path (leave it unset for the default)")


@dataclass(kw_only=True)
class SlurmConfig:
    partition: str | None = None
    """Partition (-p); None: the cluster default."""
    account: str | None = None
    """Account (-A)."""
    qos: str | None = None
    """Quality of service (--qos)."""
    time: str = "01:00:00"
    """Wall-clock limit per attempt (--time)."""
    constraint: str | None = None
    """Node features (--constraint)."""
    mem: str | None = None
    """Memory per node (--mem), e.g. 64G; "0": all of it; None: the partition's default."""
    gpu_type: str | None = None
    """GPU type, giving --gpus-per-node=TYPE:N (e.g. h100) where a cluster needs it."""
    gres: str | None = None
    """Other generic resources per node (--gres), e.g. nvme:1 (GPUs come from gpus_per_node)."""
    exclusive: bool = True
    """Whole nodes per component; keeps components on distinct nodes."""
    extra_sbatch: list[str] = field(default_factory=list)
    """Extra `#SBATCH` options of every het group, e.g. `--mail-type=END`."""
    srun_args: list[str] = field(default_factory=list)
    """Extra srun options of every component, e.g. `--container-image=/shared/prl.sqsh` (pyxis).
    Passed literally (quoted), so use absolute paths, not shell variables."""
    python: str | None = None
    """Interpreter on the compute nodes (with prl installed): runs the batch script's bookkeeping and
    the components; None: the interpreter that ran `prl submit`."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the batch script runs once, after its output goes to the attempt's job.log and
    before any component (module load, venv activation); a failing line ends the job with status 15.
    Lines for a component's own nodes go under `<component>.slurm.setup`."""
    signal_lead_s: int = 300
    """Seconds before the time limit at which SLURM sends USR1 (the trainer checkpoints)."""
    max_requeues: int = 3
    """How often the job may requeue itself after a time-limit warning (preemptions are not counted)."""
    hetjob: bool = True
    """One heterogeneous job (one component per het group); false: one allocation split by node."""
    job_name: str | None = None
    """Job name; default: run.name."""

    def __post_init__(self) -> None:
        _check_batch_options(self, "slurm")
        _single_line(self.job_name, "slurm.job_name")
        _check('"' not in (self.job_name or ""), "slurm.job_name", "must not contain '\"'")
        _check(self.signal_lead_s >= 0, "slurm.signal_lead_s", "must be >= 0")
        _check(self.max_requeues >= 0, "slurm.max_requeues", "must be >= 0")


@dataclass(kw_only=True)
class ComponentSlurm:
    """One component's batch and launch options (`inference.slurm`, `trainer.slurm`,
    `orchestrator.slurm`): what its het group asks of SLURM and how its tasks start. A key left
    unset (None) takes the top-level `slurm` value; "" unsets a string there (e.g. partition: the
    cluster default). Checked by the owning section, which knows the key path."""

    partition: str | None = None
    """Partition of this component's het group, e.g. a CPU partition for the orchestrator."""
    account: str | None = None
    """Account (-A)."""
    qos: str | None = None
    """Quality of service (--qos)."""
    time: str | None = None
    """Wall-clock limit (--time)."""
    constraint: str | None = None
    """Node features (--constraint)."""
    mem: str | None = None
    """Memory per node (--mem)."""
    gpu_type: str | None = None
    """GPU type for --gpus-per-node=TYPE:N."""
    gres: str | None = None
    """Other generic resources per node (--gres)."""
    exclusive: bool | None = None
    """Whole nodes (--exclusive)."""
    extra_sbatch: list[str] | None = None
    """Extra #SBATCH options of this het group (replace the top-level list)."""
    srun_args: list[str] | None = None
    """Extra srun options of this component, e.g. its container (replace the top-level list)."""
    python: str | None = None
    """Interpreter of this component's program, e.g. the one inside its container."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run on each of this component's nodes, in the shell that then execs its program
    (module load, conda activate); not inherited. A failing line ends the task with status 15."""


@dataclass(kw_only=True)
class InferenceConfig:
    nodes: int = 1
    """Nodes of the inference group (one server per node)."""
    gpus_per_node: int = 1
    """GPUs per inference node; 0 for CPU-only vLLM."""
    cpus_per_node: int | None = None
    """CPUs per inference node (--cpus-per-task); None: SLURM's default."""
    tensor_parallel: int = 1
    """Tensor-parallel size of one replica."""
    data_parallel: int = 1
    """Number of replicas in total; tensor_parallel x data_parallel = nodes x gpus_per_node."""
    port: int = 8000
    """HTTP port of each server."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory vLLM may take."""
    enforce_eager: bool = False
    """Disable CUDA graphs (faster start, slower decode)."""
    weight_transfer: str = "filesystem"
    """How servers get each policy version: "filesystem" (they load the trainer's file) or "broadcast"
    (trainer rank 0 sends it to every worker, NCCL on GPUs, gloo otherwise; the file stays the fallback).
    Broadcast holds up to async_level + 2 versions in the trainer's host memory."""
    extra_args: list[str] = field(default_factory=list)
    """Extra vLLM server arguments, passed as given."""
    api_key_env: str | None = None
    """Name of an environment variable holding the server API key (the key itself is never written)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for inference processes."""
    slurm: ComponentSlurm = field(default_factory=ComponentSlurm)
    """Batch and launch options of the inference group (unset keys: the top-level `slurm` values)."""

    def __post_init__(self) -> None:
        _check_batch_options(self.slurm, "inference.slurm")
        _positive(self.nodes, "inference.nodes")
        _check(self.gpus_per_node >= 0, "inference.gpus_per_node", "must be >= 0")
        _positive(self.tensor_parallel, "inference.tensor_parallel")
        _positive(self.data_parallel, "inference.data_parallel")
        _check(0 < self.port < 65536, "inference.port", f"must be a TCP port, got {self.port}")
        _check(0 < self.gpu_memory_utilization <= 1, "inference.gpu_memory_utilization", "must be in (0, 1]")
        _one_of(self.weight_transfer, WEIGHT_TRANSFERS, "inference.weight_transfer")
        if self.api_key_env is not None:
            check_env_name(self.api_key_env, "inference.api_key_env")
        devices = self.nodes * max(self.gpus_per_node, 1)
        _check(
            self.tensor_parallel * self.data_parallel == devices,
            "inference.tensor_parallel",
            f"tensor_parallel x data_parallel = {self.tensor_parallel} x {self.data_parallel} "
            f"must equal nodes x gpus_per_node = {devices}",
        )
        _check(
            self.data_parallel % self.nodes == 0,
            "inference.data_parallel",
            f"{self.data_parallel} replicas cannot be split evenly over {self.nodes} nodes",
        )


@dataclass(kw_only=True)
class CheckpointConfig:
    interval: int = 10
    """Save a full checkpoint (torch DCP) every this many steps; 0 disables periodic saves."""
    keep_last: int = 2
    """Complete checkpoints to keep; older ones are deleted."""

    def __post_init__(self) -> None:
        _check(self.interval >= 0, "trainer.checkpoint.interval", "must be >= 0")
        _positive(self.keep_last, "trainer.checkpoint.keep_last")


# ---- The loss and the micro-batch token budget (docs/architecture.md, "The loss", "Micro-batches") ----
LOSS_TYPES = ("clip", "dppo", "custom")
MOVED = {"trainer.clip_low": "trainer.loss.clip_low", "trainer.clip_high": "trainer.loss.clip_high"}
"""Keys that moved, still read at their old place: every RUN/config.yaml written before has them."""


@dataclass(kw_only=True)
class LossConfig:
    type: str = "clip"
    """clip: PPO-style clipped importance ratio per token (prl's default); dppo: tokens whose probability
    left the trust region get no policy gradient at all (prime-rl's default loss); custom: `custom`."""
    clip_low: float = 0.2
    """clip: importance ratios below 1 - clip_low are clipped (token level)."""
    clip_high: float = 0.28
    """clip: importance ratios above 1 + clip_high are clipped (token level)."""
    dppo_mask_low: float = 0.2
    """dppo: a token with negative advantage whose probability fell by more than this (trainer minus
    inference probability) is masked out of the policy gradient."""
    dppo_mask_high: float = 0.2
    """dppo: a token with positive advantage whose probability rose by more than this is masked out."""
    kl_tau: float = 0.0
    """clip and dppo: adds kl_tau * (log pi_theta/pi_inference)^2 per loss token (prime-rl: 1e-3)."""
    custom: str | None = None
    """custom: import path of the loss function, `package.module:function` (signature in prl.trainer.loss)."""
    custom_args: dict[str, Any] = field(default_factory=dict)
    """custom: keyword arguments passed to the function on every call."""

    def __post_init__(self) -> None:
        _one_of(self.type, LOSS_TYPES, "trainer.loss.type")
        for key in ("clip_low", "clip_high", "dppo_mask_low", "dppo_mask_high", "kl_tau"):
            _check(getattr(self, key) >= 0, f"trainer.loss.{key}", f"must be >= 0, got {getattr(self, key)}")
        custom = self.type == "custom"
        _check(custom or self.custom is None, "trainer.loss.custom", "is only used with trainer.loss.type=custom")
        _check(custom or not self.custom_args, "trainer.loss.custom_args", "is only used with trainer.loss.type=custom")
        _check(not custom or self.custom is not None, "trainer.loss.custom", "must be set when trainer.loss.type=custom")
        _check(not custom or self.kl_tau == 0, "trainer.loss.kl_tau",
               "is not applied to a custom loss (pass it in trainer.loss.custom_args)")
        if custom:
            split_import_path(self.custom, "trainer.loss.custom")
        for key in self.custom_args:
            _check(key.isidentifier(), f"trainer.loss.custom_args.{key}", "is not a keyword argument name")


def _check_micro_batch_tokens(cfg: Config) -> None:
    """A sample is never split over micro-batches: one of max_model_len tokens must fit in one."""
    budget, longest = cfg.trainer.micro_batch_tokens, cfg.model.max_model_len
    _check(budget is None or budget >= longest, "trainer.micro_batch_tokens",
           f"{budget} is less than model.max_model_len={longest}: a sample that long could not be trained")


def _move_keys(node: dict, where: str = "") -> None:
    """Old keys (MOVED) of one YAML file or override to their new place, in place (after check_shape:
    the sections on the way are mappings)."""
    for old, new in MOVED.items():
        section, key = old.split(".")
        if not (isinstance(node.get(section), dict) and key in node[section]):
            continue
        value = node[section].pop(key)
        parent = node
        for part in new.split(".")[:-1]:
            parent = parent.setdefault(part, {})
        if new.split(".")[-1] in parent:
            raise ConfigError(f"{old}: moved to {new}, which is set too{where}")
        parent[new.split(".")[-1]] = value


@dataclass(kw_only=True)
class TrainerConfig:
    nodes: int = 1
    """Nodes of the trainer group; torchrun runs once per node."""
    gpus_per_node: int = 1
    """GPUs (ranks) per trainer node; 0 for CPU (one gloo rank per node)."""
    cpus_per_node: int | None = None
    """CPUs per trainer node (--cpus-per-task); None: SLURM's default."""
    lr: float = 1e-6
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    micro_batch_size: int = 8
    """Sequences per micro-batch (one forward/backward); not used when micro_batch_tokens is set."""
    micro_batch_tokens: int | None = None
    """Tokens per micro-batch, samples packed first-fit longest first: memory bounded whatever the
    lengths (at least model.max_model_len); None: micro-batches of micro_batch_size samples."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    compile: bool = False
    """torch.compile the decoder layers."""
    keep_logits_gib: float = 4.0
    """Keep a micro-batch's LM-head logits (compute dtype, tokens x vocab) from the forward for the
    backward when they take at most this many GiB, instead of recomputing them: one LM-head GEMM
    less per micro-batch. 0: always recompute (least memory)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Full-state checkpoints for resume."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for trainer processes."""
    slurm: ComponentSlurm = field(default_factory=ComponentSlurm)
    """Batch and launch options of the trainer group (unset keys: the top-level `slurm` values)."""

    def __post_init__(self) -> None:
        _check_batch_options(self.slurm, "trainer.slurm")
        _positive(self.nodes, "trainer.nodes")
        _check(self.gpus_per_node >= 0, "trainer.gpus_per_node", "must be >= 0")
        _positive(self.lr, "trainer.lr")
        _positive(self.micro_batch_size, "trainer.micro_batch_size")
        _check(self.max_grad_norm > 0, "trainer.max_grad_norm", "must be > 0")
        _check(self.keep_logits_gib >= 0, "trainer.keep_logits_gib", "must be >= 0")
        if self.micro_batch_tokens is not None:
            _positive(self.micro_batch_tokens, "trainer.micro_batch_tokens")

    @property
    def world_size(self) -> int:
        """Number of trainer ranks."""
        return self.nodes * max(self.gpus_per_node, 1)


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

    @property
    def label(self) -> str:
        return self.name or self.id.rpartition(".")[2]

    def check(self, path: str) -> None:
        """Per-field checks; `path` names the entry (orchestrator.environment, ...environments[1])."""
        _check(bool(_MODULE.fullmatch(self.id)), f"{path}.id",
               f"must be a Python module name such as prl.envs.toy, got {self.id!r}")
        for key in self.args:
            _check(key.isidentifier(), f"{path}.args.{key}", "is not a keyword argument name")
        _check(self.name is None or bool(_ENV_LABEL.fullmatch(self.name)), f"{path}.name",
               f"must be letters, digits, '_', '.' or '-' (it becomes a metric name), got {self.name!r}")
        _check(math.isfinite(self.ratio) and self.ratio > 0, f"{path}.ratio",
               f"must be a finite number > 0, got {self.ratio}")


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
        paths = [f"orchestrator.eval.environments[{i}]" for i in range(len(self.environments))]
        _check_environments(self.environments, paths)
        for env, path in zip(self.environments, paths):
            _check(env.ratio == 1.0, f"{path}.ratio", "only training environments have ratios")
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
    """Rollouts per step (all groups together)."""
    rollouts_per_example: int = 8
    """Group size for group-relative advantages."""
    max_concurrent: int = 64
    """Requests in flight to the inference servers."""
    normalize_advantage_std: bool = False
    """Divide group-relative advantages by the group's reward std (GRPO); off: reward - group mean."""
    filter_zero_advantage: bool = True
    """Leave groups whose rewards are all equal (advantages all zero) out of the batch, so they do not
    dilute the loss's token mean (prime-rl's buffer drops them too). Off: trained with advantage 0."""
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
        self._check_training_environments()

    def _check_training_environments(self) -> None:
        _check(self.environment is None or not self.environments, "orchestrator.environments",
               "set orchestrator.environment (one) or orchestrator.environments (several), not both; "
               "override orchestrator.environment=null to replace a single one")
        _check(self.environment is not None or bool(self.environments), "orchestrator.environment",
               "missing required value (or orchestrator.environments: a list)")
        _check_environments(self.train_environments, self.environment_paths)
        for count, env, path in zip(self.examples_per_env, self.train_environments, self.environment_paths):
            _check(count > 0, f"{path}.ratio", f"a ratio of {env.ratio:g} gives {env.label} none of the "
                   f"{self.batch_size // self.rollouts_per_example} examples of a step; raise it or the batch size")

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


@dataclass(kw_only=True)
class WatchdogConfig:
    stall_minutes: float = 30.0
    """A component that makes no progress (trainer: no step; orchestrator: no batch) for
    max(stall_minutes, stall_factor x its median step time) dumps every thread's stack to its
    rank log and ends the attempt with exit status 16 (`stalled` names it). 0 disables."""
    stall_factor: float = 5.0
    """See stall_minutes: multiples of the median step time, so slow steps are not taken for hangs."""
    ready_timeout_s: float = 1800.0
    """Deadline for startup: vLLM answering /health; the trainer's rendezvous, model load and resume
    (also the torch process group's timeout). The trainer's first batch may take this plus the stall
    window (the servers start, then one batch is generated)."""
    requeue: bool = False
    """Requeue the job after a stall (from the newest complete checkpoint) instead of ending it."""
    max_requeues: int = 1
    """Stall requeues allowed per run (counted apart from slurm.max_requeues)."""

    def __post_init__(self) -> None:
        _check(self.stall_minutes >= 0, "watchdog.stall_minutes", "must be >= 0")
        _check(self.stall_factor >= 1, "watchdog.stall_factor", "must be >= 1")
        _positive(self.ready_timeout_s, "watchdog.ready_timeout_s")
        _check(self.max_requeues >= 0, "watchdog.max_requeues", "must be >= 0")


@dataclass(kw_only=True)
class Config:
    run: RunConfig
    """Name, place and length of the run."""
    model: ModelConfig
    """The policy model."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """Batch-system options."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """vLLM servers."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """FSDP2 trainer."""
    orchestrator: OrchestratorConfig
    """Rollouts, rewards, advantages, batches."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Deadlines for startup and progress: no silent hangs."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for every component."""

    def __post_init__(self) -> None:
        check_finite(self, "")
        self._check_env_names()
        _check_component_slurm(self)
        _check_micro_batch_tokens(self)
        _check(
            self.orchestrator.batch_size % self.trainer.world_size == 0,
            "orchestrator.batch_size",
            f"{self.orchestrator.batch_size} rollouts cannot be split evenly over "
            f"{self.trainer.world_size} trainer ranks",
        )

    def _check_env_names(self) -> None:
        sections = {"env": self.env, "inference.env": self.inference.env}
        sections |= {"trainer.env": self.trainer.env, "orchestrator.env": self.orchestrator.env}
        for path, env in sections.items():
            for key, value in env.items():
                check_env_name(key, f"{path}.{key}")
                _single_line(str(value), f"{path}.{key}")


def component_slurm(cfg: Config, name: str) -> ComponentSlurm:
    """`name`'s slurm section with every unset key taken from the top-level `slurm` section."""
    own = getattr(cfg, name).slurm
    return dataclasses.replace(own, **{k: getattr(cfg.slurm, k) for k in INHERITED if getattr(own, k) is None})


def _check_component_slurm(cfg: Config) -> None:
    """Per-component batch options the layout cannot express are refused, naming the key."""
    shared = cfg.orchestrator.placement == "trainer_node"
    for key in BATCH_KEYS:
        _check(not shared or getattr(cfg.orchestrator.slurm, key) is None, f"orchestrator.slurm.{key}",
               "the orchestrator shares the first trainer node (orchestrator.placement=trainer_node) and has "
               "no allocation of its own; set orchestrator.placement=own_node to give it one")
    if cfg.slurm.hetjob:
        return
    names = [n for n in ("inference", "trainer", "orchestrator") if n != "orchestrator" or not shared]
    for key in BATCH_KEYS:
        values = {n: getattr(component_slurm(cfg, n), key) for n in names}
        if len({repr(v) for v in values.values()}) > 1:
            who = next(n for n in names if getattr(getattr(cfg, n).slurm, key) is not None)
            raise ConfigError(
                f"{who}.slurm.{key}: the homogeneous layout (slurm.hetjob=false) is one allocation with one "
                f"{key} for every node; got {values}. Set slurm.{key}, or use slurm.hetjob=true")


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> list[Any]:
    """The YAML at `path` preceded by the files its `defaults:` list names (relative to it), each
    checked for the schema's shape."""
    if path in seen:
        raise ConfigError(f"{path}: defaults form a cycle")
    node = _load_mapping(path)
    bases = node.pop("defaults", [])
    if not (isinstance(bases, list) and all(isinstance(b, str) and b for b in bases)):
        raise ConfigError(f"{path}: defaults: must be a list of config file names, got {bases!r}")
    try:
        check_shape(node, Config, "")
    except ConfigError as e:
        raise ConfigError(f"{e} (in {path})") from None
    _move_keys(node, f" (in {path})")
    layers: list[Any] = []
    for base in bases:
        layers += _read_yaml((path.parent / base).resolve(), (*seen, path))
    return [*layers, node]


def _load_mapping(path: Path) -> dict:
    """One YAML file as a plain dict; ConfigError naming the file for anything else."""
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a config file")
    try:
        text = path.read_text(encoding="utf-8")
        # OmegaConf's loader reads `1e-6` as a float (PyYAML: a string), but it takes a file holding
        # one plain word for a mapping {word: None}; safe_load tells what the top level really is.
        if not isinstance(yaml.safe_load(text), (dict, type(None))):
            raise ConfigError(f"{path}: top level must be a mapping (key: value lines)")
        node = OmegaConf.load(io.StringIO(text))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, OmegaConfBaseException, UnicodeError, ValueError, yaml.YAMLError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{path}: cannot read config: {str(e).splitlines()[0]}") from None
    return OmegaConf.to_container(node) if OmegaConf.is_dict(node) else {}


def _override_layer(item: str) -> dict:
    """One `key=value` override as a nested dict, checked for the schema's shape."""
    check_override(item)
    try:
        layer = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
    except (OmegaConfBaseException, ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"override {item!r}: {str(e).splitlines()[0]}") from None
    check_shape(layer, Config, "")
    _move_keys(layer)
    return layer


def _one_line(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    if "issing mandatory value" in msg:
        msg = "missing required value"
    return f"{key}: {msg}" if key else msg


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    """YAML (with its defaults) + `key=value` overrides (later wins) -> validated Config."""
    layers = _read_yaml(Path(path).resolve()) + [_override_layer(item) for item in overrides]
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), *layers))
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e)) from None
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as e:
        # Not expected after check_shape; still one line rather than a traceback.
        raise ConfigError(f"config: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def to_yaml(cfg: Config) -> str:
    """The config as YAML that `load_config` reads back to an equal Config."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
