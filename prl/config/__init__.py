"""The prl run config: one typed tree of dataclasses, loaded from YAML + dotted overrides.

    from prl.config import load_config
    cfg = load_config("configs/toy.yaml", ["trainer.nodes=2"])

OmegaConf merges the YAML files and `key=value` overrides into the schema and stops there:
below `load_config` everything sees plain dataclasses. Per-field checks live in `__post_init__`
and name the field path; cross-section checks live in `Config.__post_init__`. Import from `prl.config`.

One module per section, and what they share:

    root.py           `Config`, the root of the tree, and the checks that span sections
    run.py            the `run` and `model` sections
    slurm.py          the `slurm` section and the components' own, and how they combine
    inference.py      the `inference` section: the vLLM servers
    trainer.py        the `trainer` section: the trainer, its loss and checkpoints
    orchestrator.py   the `orchestrator` section: rollouts, sampling, environments, evals
    sft.py            the `sft` section: a supervised fine-tuning job instead of an RL run
    teacher.py        the `teacher` section: on-policy distillation's teacher model
    watchdog.py       the `watchdog` section: startup and progress deadlines
    load.py           `load_config`/`to_yaml`: YAML + overrides -> a checked Config, and back
    envref.py         secrets through the job's environment: `${oc.env:NAME}` stays a reference, resolved at run time
    common.py         per-field check helpers every section uses
    validate.py       checks on raw and typed values that every section shares

This package must not import torch or vllm: the login-node commands import it.
"""

from prl.config.inference import InferenceConfig
from prl.config.load import load_config, to_yaml
from prl.config.orchestrator import (
    PLACEMENTS, EnvironmentConfig, EvalConfig, EvalSamplingConfig, OrchestratorConfig, OverlongConfig, SamplingConfig,
    split_examples,
)
from prl.config.root import Config, component_slurm, without_teacher
from prl.config.run import DTYPES, MODES, WANDB_MODES, ModelConfig, RunConfig, WandbConfig
from prl.config.sft import SftConfig
from prl.config.teacher import TeacherConfig
from prl.config.slurm import BATCH_KEYS, INHERITED, ComponentSlurm, SlurmConfig
from prl.config.trainer import LOSS_TYPES, MOVED, CheckpointConfig, LoraConfig, LossConfig, TrainerConfig
from prl.config.validate import ConfigError
from prl.config.watchdog import WatchdogConfig

__all__ = [
    "BATCH_KEYS", "DTYPES", "INHERITED", "LOSS_TYPES", "MODES", "MOVED", "PLACEMENTS", "WANDB_MODES",
    "CheckpointConfig", "ComponentSlurm", "Config", "ConfigError", "EnvironmentConfig", "EvalConfig",
    "EvalSamplingConfig", "InferenceConfig", "LoraConfig", "LossConfig", "ModelConfig", "OrchestratorConfig",
    "OverlongConfig", "RunConfig",
    "SamplingConfig", "SftConfig", "SlurmConfig", "TeacherConfig", "TrainerConfig", "WandbConfig", "WatchdogConfig",
    "component_slurm", "load_config", "split_examples", "to_yaml", "without_teacher",
]
