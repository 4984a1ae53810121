"""The `run` and `model` sections: what the run is called, where it lives, how long it is; the policy model."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from prl.config.common import _check, _one_of, _positive, _single_line
from prl.config.validate import check_name, check_printable

DTYPES = ("bfloat16", "float16", "float32")
MODES = ("train", "probe")
WANDB_MODES = ("offline", "online", "disabled")
DEFAULT_OUTPUT_DIR = "outputs"
"""run.output_dir when a config sets none; also where `prl runs` looks without an argument."""


def absolute_output_dir(output_dir: str = DEFAULT_OUTPUT_DIR) -> Path:
    """`run.output_dir` as `prl submit` resolves it: `~` expanded, a relative path taken from the
    current directory."""
    return Path(os.path.abspath(os.path.expanduser(output_dir)))


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
            check_printable(getattr(self, key), f"run.wandb.{key}")
        for i, tag in enumerate(self.tags):
            check_printable(tag, f"run.wandb.tags[{i}]")


@dataclass(kw_only=True)
class RunConfig:
    name: str
    """Run name; the run directory is `output_dir/name`."""
    output_dir: str = DEFAULT_OUTPUT_DIR
    """Parent directory on the shared filesystem (often Lustre); relative: to the directory `prl submit`
    runs in. `prl runs` without an argument lists the default one."""
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
    group_readable: bool = False
    """The run directory's mode: 0700, only its owner gets in (its secret, logs, weights); true: 0750,
    the owner's group may read it too (a team sharing runs)."""
    compile_cache: bool = True
    """Under SLURM: what torch.compile, Triton and C++ extensions build is kept in RUN/cache (0700), for
    every later attempt and job of the run, on any of its nodes; false: in each job's node-local
    /tmp/prl-JOB (or a fresh private name beside it where another user made that one first), which
    the run's next job removes. Local mode: inductor's and Triton's caches in
    ~/.cache/prl/inductor and ~/.cache/prl/triton (prl.run.node.LOCAL_CACHES), C++ extensions in
    torch's default under HOME."""
    compile_cache_dir: str | None = None
    """Under SLURM with run.compile_cache: where the compile caches are kept instead of RUN/cache. A directory
    of this user's on a filesystem every node mounts (e.g. ~/.cache/prl/compile) is shared by all the runs
    that name it: a new run of a model an earlier run compiled starts from that code (Inductor, Triton and
    vLLM key what they keep by content). Made 0700 with its parents at the first launch, and refused there
    if it is a link, another user's or writable by others."""

    def __post_init__(self) -> None:
        check_name(self.name, "run.name")
        if self.compile_cache_dir is not None:
            key = "run.compile_cache_dir"
            _check(bool(self.compile_cache_dir.strip()) and "\0" not in self.compile_cache_dir, key, "must be a non-empty path")
            _single_line(self.compile_cache_dir, key)
            check_printable(self.compile_cache_dir, key)
            _check(self.compile_cache, key, "set, but run.compile_cache is false: the caches would be in the job's scratch")
        _check(bool(self.output_dir) and "\0" not in self.output_dir, "run.output_dir", "must be a non-empty path")
        for key in ("name", "output_dir"):
            _single_line(getattr(self, key), f"run.{key}")
            check_printable(getattr(self, key), f"run.{key}")  # others see both (squeue, scontrol show job)
            # Both end up in #SBATCH --output, where '"' and '\\' cannot be passed and '%' is a pattern.
            _check(not set('"%\\') & set(getattr(self, key)), f"run.{key}", "must not contain '\"', '\\' or '%'")
        _one_of(self.mode, MODES, "run.mode")
        _positive(self.max_steps, "run.max_steps")
        _check(self.async_level >= 0, "run.async_level", f"must be >= 0, got {self.async_level}")

    @property
    def run_dir(self) -> Path:
        """Absolute run directory (the only state of a run)."""
        return absolute_output_dir(self.output_dir) / self.name


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
