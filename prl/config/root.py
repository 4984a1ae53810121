"""The root of the config tree (`Config`) and the checks that span sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from prl.config.common import _check, _single_line
from prl.config.inference import InferenceConfig
from prl.config.orchestrator import OrchestratorConfig
from prl.config.run import ModelConfig, RunConfig
from prl.config.sft import SftConfig
from prl.config.slurm import BATCH_KEYS, INHERITED, ComponentSlurm, SlurmConfig
from prl.config.teacher import TeacherConfig
from prl.config.trainer import TrainerConfig
from prl.config.validate import ConfigError, check_env_name, check_finite
from prl.config.watchdog import WatchdogConfig


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
    orchestrator: OrchestratorConfig | None = None
    """Rollouts, rewards, advantages, batches (an RL run's; an SFT job has none)."""
    sft: SftConfig | None = None
    """Set for a supervised fine-tuning job: the trainer alone, on chat data (prl.trainer.sft); the
    inference and orchestrator sections then play no part."""
    teacher: TeacherConfig | None = None
    """On-policy distillation: the teacher model whose logprobs of the student's samples the loss
    pulls towards (docs/distillation.md); None: none."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Deadlines for startup and progress: no silent hangs."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for every component."""

    def __post_init__(self) -> None:
        check_finite(self, "")
        # The inference layout's derived keys, resolved where every process builds its config (a
        # section's own __post_init__ cannot: OmegaConf makes the schema's defaults from an instance).
        self.inference = self.inference.resolved()
        if self.sft is None:
            _check(self.orchestrator is not None, "orchestrator",
                   "missing required section (or `sft:` for a supervised fine-tuning job)")
        else:
            _check(self.orchestrator is None, "orchestrator",
                   "an SFT job (sft is set) has no orchestrator: drop the section, or drop sft for an RL run")
            _check(not self.slurm.one_node, "slurm.one_node", "an SFT job runs the trainer alone on its own nodes")
        self._check_env_names()
        _check_component_slurm(self)
        _check_one_node(self)
        _check_unauthenticated(self)
        _check_micro_batch_tokens(self)
        self._check_continuous()
        self._check_routing_replay()
        _check_teacher(self)
        per_step, path = ((self.sft.batch_size, "sft.batch_size") if self.sft is not None
                          else (self.orchestrator.batch_size, "orchestrator.batch_size"))
        _check(per_step % self.trainer.world_size == 0, path,
               f"{per_step} samples cannot be split evenly over {self.trainer.world_size} trainer ranks")

    @property
    def het_groups(self) -> bool:
        """A heterogeneous job, a het group per component (slurm.hetjob); an SFT job is one allocation."""
        return self.slurm.hetjob and self.sft is None

    @property
    def components(self) -> tuple[str, ...]:
        """The programs a launch of this run starts (prl.run.protocol.COMPONENTS' names)."""
        if self.sft is not None:
            return ("trainer",)
        served = ("envserver",) if self.orchestrator.served_environments else ()
        return ("inference", "trainer", "orchestrator", *served)

    def section(self, name: str):
        """Component `name`'s config section (its `env`, `slurm`): the envserver runs beside the
        orchestrator, in its environment and with its batch options."""
        return self.orchestrator if name == "envserver" else getattr(self, name)

    def _check_continuous(self) -> None:
        if self.orchestrator is None or not self.orchestrator.continuous:
            return
        _check(self.trainer.behaviour_logprobs == "inference", "orchestrator.continuous",
               "needs trainer.behaviour_logprobs=inference: a sample may hold tokens of several policy "
               "versions, which no single past version's forward can recompute")
        _check(self.run.async_level >= 1, "orchestrator.continuous",
               "needs run.async_level >= 1: at 0 every group still running when a version loads is stale")

    def _check_routing_replay(self) -> None:
        """trainer.routing_replay needs vLLM to return the routed experts: its GPU build (the CPU build has no
        capture, docs/moe.md), through prl's token route (Chat Completions and v1 environments' route drop them)."""
        if self.orchestrator is None or not self.trainer.routing_replay:
            return
        key, orch = "trainer.routing_replay", self.orchestrator
        _check(self.inference.gpus_per_node > 0, key, "needs GPU inference: vLLM's CPU build cannot return the "
               "experts it routed to (inference.gpus_per_node is 0)")
        _check(orch.rollout_route == "tokens", key, "needs orchestrator.rollout_route=tokens: Chat Completions "
               "answers carry no routed experts to replay")
        v1 = [e.label for e in orch.train_environments if e.api == "v1"]
        _check(not v1, key, f"not with verifiers v1 environments ({', '.join(v1)}): their rollouts come back "
               "without the routed experts")

    def env_sections(self) -> dict[str, dict[str, Any]]:
        """The four `env` sections by their paths (prl.config.envref.SECTIONS)."""
        return {"env": self.env, "inference.env": self.inference.env, "trainer.env": self.trainer.env,
                "orchestrator.env": self.orchestrator.env if self.orchestrator is not None else {}}

    def _check_env_names(self) -> None:
        for path, env in self.env_sections().items():
            for key, value in env.items():
                check_env_name(key, f"{path}.{key}")
                _single_line(str(value), f"{path}.{key}")


def without_teacher(cfg: Config) -> Config:
    """`cfg` with no teacher, and the loss keys that need one at their defaults: what a server that is
    not the distillation's reads (the teacher's own, prl.inference.teacher; `prl eval`'s, jobs/eval.py)."""
    loss = dataclasses.replace(cfg.trainer.loss, teacher_kl_coef=0.0, reward_weight=1.0)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, loss=loss), teacher=None)


def component_slurm(cfg: Config, name: str) -> ComponentSlurm:
    """`name`'s slurm section with every unset key taken from the top-level `slurm` section."""
    own = cfg.section(name).slurm
    return dataclasses.replace(own, **{k: getattr(cfg.slurm, k) for k in INHERITED if getattr(own, k) is None})


def _check_component_slurm(cfg: Config) -> None:
    """Per-component batch options the layout cannot express are refused, naming the key."""
    if cfg.orchestrator is None:
        return  # an SFT job: the trainer's allocation alone
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


def _check_unauthenticated(cfg: Config) -> None:
    """vLLM's multi-node data-parallel sockets authenticate nobody: only where the site says the
    job's network is its own (slurm.fabric_isolated)."""
    joined = cfg.sft is None and cfg.inference.multi_node == "data_parallel" and cfg.inference.nodes > 1
    _check(not joined or cfg.slurm.fabric_isolated, "slurm.fabric_isolated",
           f"inference.multi_node=data_parallel over {cfg.inference.nodes} nodes opens vLLM's data-parallel "
           "sockets, which take anyone who reaches them: set slurm.fabric_isolated=true only where nobody else "
           "reaches the job's nodes, else use inference.multi_node=servers")


def _check_one_node(cfg: Config) -> None:
    """The one-node layout is one allocation of one node that holds every component."""
    if not cfg.slurm.one_node:
        return
    why = "the one-node layout (slurm.one_node=true)"
    _check(not cfg.slurm.hetjob, "slurm.hetjob", f"must be false for {why}: one allocation, not het groups")
    _check(cfg.inference.nodes == 1, "inference.nodes", f"must be 1 for {why}")
    _check(cfg.trainer.nodes == 1, "trainer.nodes", f"must be 1 for {why}")
    _check(cfg.orchestrator.placement == "trainer_node", "orchestrator.placement",
           f"must be trainer_node for {why}")


def _check_teacher(cfg: Config) -> None:
    """A teacher is served, scored and trained on together, or not at all (no key read by nothing)."""
    loss = cfg.trainer.loss
    if cfg.teacher is None:
        _check(loss.teacher_kl_coef == 0, "trainer.loss.teacher_kl_coef", "needs a `teacher` section (its model)")
        _check(loss.reward_weight != 0, "trainer.loss.reward_weight",
               "0 leaves nothing to train on without a `teacher` section (pure distillation)")
        return
    _check(cfg.sft is None, "teacher", "an SFT job has no samples of its own to score: drop the section")
    _check(loss.teacher_kl_coef > 0, "trainer.loss.teacher_kl_coef",
           "must be > 0 with a `teacher` section (the reverse-KL term's weight)")
    taken = cfg.inference.ports
    _check(cfg.teacher.port not in taken, "teacher.port", f"{cfg.teacher.port} is a policy server's port ({taken})")
    _check(not cfg.orchestrator.filter_zero_advantage, "orchestrator.filter_zero_advantage",
           "must be false with a teacher: a group of equal rewards still carries the teacher's signal on every token")
    share = cfg.inference.gpu_memory_utilization + cfg.teacher.gpu_memory_utilization
    _check(cfg.inference.gpus_per_node == 0 or share <= 1, "teacher.gpu_memory_utilization",
           f"{cfg.teacher.gpu_memory_utilization} + inference.gpu_memory_utilization "
           f"{cfg.inference.gpu_memory_utilization} = {share:.2f} > 1 of the GPU they share")
    _check(cfg.inference.multi_node == "servers", "teacher.placement",
           "inference_nodes needs inference.multi_node=servers (a teacher server per node, each its own URL)")


def _check_micro_batch_tokens(cfg: Config) -> None:
    """A sample is never split over micro-batches: one of max_model_len tokens must fit in one."""
    budget, longest = cfg.trainer.micro_batch_tokens, cfg.model.max_model_len
    _check(budget is None or budget >= longest, "trainer.micro_batch_tokens",
           f"{budget} is less than model.max_model_len={longest}: a sample that long could not be trained")
