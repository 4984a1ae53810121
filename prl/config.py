"""The prl run config: one typed tree of dataclasses, loaded from YAML + dotted overrides.

    from prl.config import load_config
    cfg = load_config("configs/toy.yaml", ["trainer.nodes=2"])

OmegaConf merges the YAML files and `key=value` overrides into the schema and stops there:
below `load_config` everything sees plain dataclasses. Per-field checks live in `__post_init__`
and name the field path; cross-section checks live in `Config.__post_init__`.

This module must not import torch or vllm: the login-node commands import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

DTYPES = ("bfloat16", "float16", "float32")
PLACEMENTS = ("own_node", "trainer_node")
MODES = ("train", "probe")
WANDB_MODES = ("offline", "online", "disabled")


class ConfigError(ValueError):
    """A config that cannot run; the message names the key path."""


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

    def __post_init__(self) -> None:
        _one_of(self.mode, WANDB_MODES, "run.wandb.mode")


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
        _check(bool(self.name) and "/" not in self.name, "run.name", "must be a non-empty name without '/'")
        _check(bool(self.output_dir), "run.output_dir", "must be a non-empty path")
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
    """Node features (--constraint), applied to every component."""
    exclusive: bool = True
    """Whole nodes per component; keeps components on distinct nodes."""
    extra_sbatch: list[str] = field(default_factory=list)
    """Extra `#SBATCH` options, e.g. `--mail-type=END`, applied to every component."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run in the batch script before any component (module load, venv activation)."""
    signal_lead_s: int = 300
    """Seconds before the time limit at which SLURM sends USR1 (the trainer checkpoints)."""
    max_requeues: int = 3
    """How often the job may requeue itself after a time-limit warning (preemptions are not counted)."""
    hetjob: bool = True
    """One heterogeneous job (one component per het group); false: one allocation split by node."""
    job_name: str | None = None
    """Job name; default: run.name."""

    def __post_init__(self) -> None:
        for name in ("partition", "account", "qos", "time", "constraint", "job_name"):
            _single_line(getattr(self, name), f"slurm.{name}")
            _check('"' not in (getattr(self, name) or ""), f"slurm.{name}", "must not contain '\"'")
        for i, line in enumerate(self.extra_sbatch):
            _single_line(line, f"slurm.extra_sbatch[{i}]")
            _check(line.startswith("-"), f"slurm.extra_sbatch[{i}]", f"must be an sbatch option starting with '-', got {line!r}")
        for i, line in enumerate(self.setup):
            _single_line(line, f"slurm.setup[{i}]")
        _check(self.signal_lead_s >= 0, "slurm.signal_lead_s", "must be >= 0")
        _check(self.max_requeues >= 0, "slurm.max_requeues", "must be >= 0")


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
    extra_args: list[str] = field(default_factory=list)
    """Extra vLLM server arguments, passed as given."""
    api_key_env: str | None = None
    """Name of an environment variable holding the server API key (the key itself is never written)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for inference processes."""

    def __post_init__(self) -> None:
        _positive(self.nodes, "inference.nodes")
        _check(self.gpus_per_node >= 0, "inference.gpus_per_node", "must be >= 0")
        _positive(self.tensor_parallel, "inference.tensor_parallel")
        _positive(self.data_parallel, "inference.data_parallel")
        _check(0 < self.port < 65536, "inference.port", f"must be a TCP port, got {self.port}")
        _check(0 < self.gpu_memory_utilization <= 1, "inference.gpu_memory_utilization", "must be in (0, 1]")
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
    """Sequences per micro-batch (one forward/backward)."""
    clip_low: float = 0.2
    """Importance ratios below 1 - clip_low are clipped (token level)."""
    clip_high: float = 0.28
    """Importance ratios above 1 + clip_high are clipped (token level)."""
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

    def __post_init__(self) -> None:
        _positive(self.nodes, "trainer.nodes")
        _check(self.gpus_per_node >= 0, "trainer.gpus_per_node", "must be >= 0")
        _positive(self.lr, "trainer.lr")
        _positive(self.micro_batch_size, "trainer.micro_batch_size")
        _check(self.max_grad_norm > 0, "trainer.max_grad_norm", "must be > 0")
        _check(self.keep_logits_gib >= 0, "trainer.keep_logits_gib", "must be >= 0")
        _check(self.clip_low >= 0 and self.clip_high >= 0, "trainer.clip_low", "clip bounds must be >= 0")

    @property
    def world_size(self) -> int:
        """Number of trainer ranks."""
        return self.nodes * max(self.gpus_per_node, 1)


@dataclass(kw_only=True)
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature for rollouts."""
    top_p: float = 1.0
    """Nucleus sampling."""
    max_tokens: int = 256
    """Completion length limit per turn."""

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, "orchestrator.sampling.temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, "orchestrator.sampling.top_p", "must be in (0, 1]")
        _positive(self.max_tokens, "orchestrator.sampling.max_tokens")


@dataclass(kw_only=True)
class EnvironmentConfig:
    id: str
    """Environment module with `load_environment(**args)` (e.g. prl.envs.reverse_text)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for `load_environment`."""

    def __post_init__(self) -> None:
        _check(bool(self.id), "orchestrator.environment.id", "must be set")


@dataclass(kw_only=True)
class OrchestratorConfig:
    placement: str = "own_node"
    """own_node: its own node (het group 2); trainer_node: shares the first trainer node."""
    cpus: int = 2
    """CPUs for the orchestrator task."""
    environment: EnvironmentConfig
    """The verifiers environment to train on."""
    batch_size: int = 64
    """Rollouts per step (all groups together)."""
    rollouts_per_example: int = 8
    """Group size for group-relative advantages."""
    max_concurrent: int = 64
    """Requests in flight to the inference servers."""
    normalize_advantage_std: bool = False
    """Divide group-relative advantages by the group's reward std (GRPO); off: reward - group mean."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for the orchestrator process."""

    def __post_init__(self) -> None:
        _one_of(self.placement, PLACEMENTS, "orchestrator.placement")
        _positive(self.cpus, "orchestrator.cpus")
        _positive(self.batch_size, "orchestrator.batch_size")
        _positive(self.rollouts_per_example, "orchestrator.rollouts_per_example")
        _check(
            self.batch_size % self.rollouts_per_example == 0,
            "orchestrator.batch_size",
            f"{self.batch_size} is not divisible by rollouts_per_example={self.rollouts_per_example}",
        )
        _positive(self.max_concurrent, "orchestrator.max_concurrent")


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
        self._check_env_names()
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
                _check(key.isidentifier(), f"{path}.{key}", "is not a valid environment variable name")
                _single_line(str(value), f"{path}.{key}")


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> list[Any]:
    """The YAML at `path` preceded by the files its `defaults:` list names (relative to it)."""
    if path in seen:
        raise ConfigError(f"{path}: defaults form a cycle")
    try:
        node = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, OmegaConfBaseException, ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read config: {str(e).splitlines()[0]}") from None
    if not OmegaConf.is_dict(node):
        raise ConfigError(f"{path}: top level must be a mapping")
    bases = node.pop("defaults", [])
    layers: list[Any] = []
    for base in bases:
        layers += _read_yaml((path.parent / str(base)).resolve(), (*seen, path))
    return [*layers, node]


def _one_line(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    if "issing mandatory value" in msg:
        msg = "missing required value"
    return f"{key}: {msg}" if key else msg


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    """YAML (with its defaults) + `key=value` overrides (later wins) -> validated Config."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
    try:
        merged = OmegaConf.merge(
            OmegaConf.structured(Config), *_read_yaml(Path(path).resolve()), OmegaConf.from_dotlist(list(overrides))
        )
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e)) from None


def to_yaml(cfg: Config) -> str:
    """The config as YAML that `load_config` reads back to an equal Config."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
