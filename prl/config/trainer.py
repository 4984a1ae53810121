"""The `trainer` section: the FSDP2 trainer, its loss and checkpoints; keys that moved within it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from prl.config.common import _check, _one_of, _positive
from prl.config.slurm import ComponentSlurm, _check_batch_options
from prl.config.validate import ConfigError, split_import_path


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
BEHAVIOUR_LOGPROBS = ("inference", "recompute")
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
    ratio_mask_low: float | None = None
    """clip and dppo: a token whose importance ratio pi_theta/pi_inference is below this gets no policy
    gradient, whatever its advantage's sign (IcePop's band, e.g. 0.5; unset: no lower bound)."""
    ratio_mask_high: float | None = None
    """clip and dppo: a token whose importance ratio is above this gets no policy gradient (e.g. 5;
    unset: no upper bound). For a sampler whose numerics or expert routing differ (docs/moe.md)."""
    custom: str | None = None
    """custom: import path of the loss function, `package.module:function` (signature in prl.trainer.loss)."""
    custom_args: dict[str, Any] = field(default_factory=dict)
    """custom: keyword arguments passed to the function on every call."""
    teacher_kl_coef: float = 0.0
    """On-policy distillation (the `teacher` section): each loss token's advantage gets
    -teacher_kl_coef * (behaviour logprob - teacher logprob), the k1 estimate of the reverse KL
    KL(student || teacher) at that token, before the loss (any type) sees it (docs/distillation.md).
    Must be > 0 with a teacher, 0 without."""
    reward_weight: float = 1.0
    """Weight of the environment's (reward) advantage in each token's advantage; 0 with a teacher:
    pure distillation, the rewards only reported."""

    def __post_init__(self) -> None:
        _one_of(self.type, LOSS_TYPES, "trainer.loss.type")
        for key in ("clip_low", "clip_high", "dppo_mask_low", "dppo_mask_high", "kl_tau", "teacher_kl_coef",
                    "reward_weight"):
            _check(getattr(self, key) >= 0, f"trainer.loss.{key}", f"must be >= 0, got {getattr(self, key)}")
        custom = self.type == "custom"
        _check(custom or self.custom is None, "trainer.loss.custom", "is only used with trainer.loss.type=custom")
        _check(custom or not self.custom_args, "trainer.loss.custom_args", "is only used with trainer.loss.type=custom")
        _check(not custom or self.custom is not None, "trainer.loss.custom", "must be set when trainer.loss.type=custom")
        _check(not custom or self.kl_tau == 0, "trainer.loss.kl_tau",
               "is not applied to a custom loss (pass it in trainer.loss.custom_args)")
        self._check_ratio_band(custom)
        if custom:
            split_import_path(self.custom, "trainer.loss.custom")
        for key in self.custom_args:
            _check(key.isidentifier(), f"trainer.loss.custom_args.{key}", "is not a keyword argument name")

    def _check_ratio_band(self, custom: bool) -> None:
        low, high = self.ratio_mask_low, self.ratio_mask_high
        for key, value, edge in (("ratio_mask_low", low, "in (0, 1)"), ("ratio_mask_high", high, "> 1 and finite")):
            if value is None:
                continue
            _check(not custom, f"trainer.loss.{key}", "is not applied to a custom loss (pass it in trainer.loss.custom_args)")
            inside = 0 < value < 1 if key == "ratio_mask_low" else 1 < value < math.inf
            _check(inside, f"trainer.loss.{key}", f"must be {edge} (a ratio of 1: the sampler's own probability), got {value}")

    @property
    def ratio_band(self) -> tuple[float, float] | None:
        """(low, high) of the importance ratios that keep their policy gradient; None: no band."""
        if self.ratio_mask_low is None and self.ratio_mask_high is None:
            return None
        return (self.ratio_mask_low or 0.0, self.ratio_mask_high if self.ratio_mask_high is not None else math.inf)



ATTENTION_KERNELS = ("auto", "fa4", "torch")
"""trainer.attention: how packed micro-batches run attention on a GPU."""

EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
"""transformers 5's experts implementations that need no extra kernels package."""

MASTER_DTYPES = ("float32", "bfloat16")
"""trainer.master_dtype: what the optimizer updates (bfloat16 with stochastic rounding)."""

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Qwen2/Llama/Mistral decoder block."""


@dataclass(kw_only=True)
class LoraConfig:
    rank: int = 0
    """Rank of the low-rank adapters (LoRA, through peft); 0: no adapters, every weight trains."""
    alpha: float = 16.0
    """Scale of the adapters' update: W + alpha / rank * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (0: the training forward is the served one)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Names of the linear layers that get adapters (the last part of the module name)."""

    def __post_init__(self) -> None:
        _check(self.rank >= 0, "trainer.lora.rank", f"must be >= 0 (0: no adapters), got {self.rank}")
        _positive(self.alpha, "trainer.lora.alpha")
        _check(0 <= self.dropout < 1, "trainer.lora.dropout", f"must be in [0, 1), got {self.dropout}")
        _check(bool(self.target_modules), "trainer.lora.target_modules", "must name at least one layer")
        for name in self.target_modules:
            _check(isinstance(name, str) and name.isidentifier(), "trainer.lora.target_modules",
                   f"{name!r} is not a module name")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank



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
    batch_poll_s: float = 0.1
    """How often the ranks look for their next batch (and agree on a stop request): a batch waits
    batch_poll_s / 2 on average before a waiting trainer takes it, on the path from one policy version
    to the batch it generates (docs/performance.md). Each look is a stat per rank and an all-reduce of
    two numbers; raise it where the filesystem's metadata server is slow."""
    micro_batch_size: int = 8
    """Sequences per micro-batch (one forward/backward); not used when micro_batch_tokens is set."""
    micro_batch_tokens: int | None = None
    """Tokens per micro-batch, samples packed first-fit longest first: memory bounded whatever the
    lengths (at least model.max_model_len); None: micro-batches of micro_batch_size samples."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss."""
    behaviour_logprobs: str = "inference"
    """Where the loss's behaviour logprobs (the importance ratio's denominator) come from. inference:
    vLLM's, returned with each sampled token. recompute: the trainer's own forward pass under the
    weights of the policy version that generated the batch (the trainer keeps async_level past
    versions of its parameter shards, in the compute dtype, in memory and in checkpoints); vLLM is
    asked for no logprobs on the token route (offline on one GPU that is 1.5x its speed with them;
    in the loop on one shared GPU the extra forward took that time instead: docs/performance.md),
    and the ratio no longer corrects for vLLM's numerics."""
    behaviour_on_host: bool = False
    """With behaviour_logprobs recompute on GPU: hold the kept versions, and the trainer's own weights
    while a past version is loaded, in pinned host memory instead of GPU memory: 2 x async_level bytes
    per parameter / trainer GPUs less GPU memory all the time, 4 more during the extra forward, for
    12 bytes per parameter of host-device copies per step (1.5B, async 2, one H100: trainer peak
    52.4 -> 46.6 GiB, train time +5 %; docs/performance.md). No effect on CPU."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    activation_checkpointing_fraction: float = 1.0
    """With activation_checkpointing: the share of the decoder blocks that recompute, the first
    round(fraction x blocks) (at least one); the others keep their activations for the backward. Each
    block kept skips a recompute (a third of its forward and backward) for its activations' memory:
    the least memory at 1.0, the fastest step that fits below it. 7B, bf16 master weights, one H200:
    45.3 % MFU at 79.3 GiB with 1.0, 50.2 % at 104.5 GiB with 0.5, 57.4 % at 129.6 GiB unchecked."""
    offload: bool = False
    """Keep the master weights, their gradients and AdamW's state in host memory (FSDP2's
    CPUOffloadPolicy, pinned) and run the optimizer step on the CPU; the GPU holds the gathered
    compute-dtype weights, the step's unsharded gradients and the activations. Host memory: 16 bytes a
    parameter per node (8 with master_dtype bfloat16), for a model that does not fit the GPUs
    otherwise (docs/gpu.md). A CPU trainer takes the same path (its state is on the host already)."""
    offload_optimizer: bool = False
    """Keep AdamW's two moments in page-locked host memory and stream them through the GPU for each
    step's update, a chunk at a time, the copies in and out overlapping the update (prl.trainer.optim):
    the weights and gradients stay on the GPU, 8 bytes a parameter (4 with master_dtype bfloat16) move
    to the host and back each step. With master_dtype bfloat16 the GPU holds 4 bytes a parameter
    instead of 8: a 14B full fine-tune on one H200 (docs/gpu.md). Not with trainer.offload, which
    keeps this state on the host already, nor with trainer.lora. A CPU trainer takes the same path."""
    master_dtype: str = "float32"
    """dtype of the weights the optimizer updates, their gradients and AdamW's moments. float32: mixed
    precision as usual (16 bytes a parameter with AdamW); bfloat16: 8 bytes a parameter, the weights and
    moments rounded stochastically after each update (prl.trainer.optim), since an update at lr 1e-6 is
    far below bf16's resolution and rounding to nearest would drop it. 7B on one H200: 79.5 instead of
    136.1 GiB, 1.08x the tokens/s, the same losses to 4 digits (docs/gpu.md). Full fine-tuning only:
    LoRA adapters stay float32."""
    flat_params: bool | None = None
    """One trainer rank without FSDP2 (prl.trainer.flat): the fp32 master weights, their gradients and
    AdamW's moments each one flat tensor, so that the optimizer step, the gradient norm and the cast of
    the weights for compute are one kernel each over the whole model, and no parameter is copied into
    and out of FSDP's buffers (docs/gpu.md, "One GPU without FSDP"). The same numerics and checkpoints
    as without it: a run may resume with it or without, on any number of ranks. Needs one trainer rank
    and master_dtype float32; not with trainer.lora, offload, offload_optimizer or expert_parallel.
    None: on for a GPU trainer where it can run and its state (18 bytes a parameter) fits in 80 % of the
    GPU, else FSDP; off on CPU. At 1.5B on one H200, 2 micro-batches a step: 53.0-53.5 % MFU, against
    48.0-49.5 % with FSDP. true: refused where it cannot run."""
    compile: bool = False
    """torch.compile the decoder layers."""
    attention: str = "auto"
    """The attention kernel of packed micro-batches on a GPU: `fa4` FlashAttention 4 (the flash-attn-4
    package; Hopper and Blackwell GPUs only), which stops the trainer, saying why, where it cannot run;
    `torch` PyTorch's own varlen flash kernel (FA2's generation, no package); `auto` FA4 where it can
    run, else flash_attention_2 where the flash-attn package is installed, else torch's kernel. On one
    H200 the 1.5B step ran at 54.3 % MFU with FA4 and 51.8-52.4 % with torch's kernel, each alone in
    its process: docs/gpu.md, "Attention kernel". CPU runs use SDPA whatever this says."""
    prewarm: bool | None = None
    """Before the first batch arrives, run synthetic micro-batches of the largest size a step takes, then
    smaller ones down to 32 tokens (each about half the one before) and, with several ranks, the
    one-token filler of a rank short of micro-batches, through the forward and backward
    (prl.trainer.prewarm): compile and first allocations happen while the servers generate, not in the
    first step. Changes no weight, gradient, optimizer state or RNG.
    None: on for GPU trainers, off on CPU (no kernels to build there unless `compile`)."""
    deterministic: bool | None = None
    """torch.use_deterministic_algorithms: a step repeated gives the same weights bit for bit (what exact
    resume needs). None: on for CPU, off for GPU. Measured on one H200 (bf16, 0.5B, docs/performance.md):
    default kernels differ run to run (weights in 88 % of elements after 4 steps), deterministic ones
    do not. Cost at 1.5B on one H100 (compiled, 8 micro-batches of 8 samples up to 2048 tokens): 5-8 %
    of the step's speed."""
    keep_logits_gib: float = 4.0
    """Keep a micro-batch's LM-head logits (compute dtype, tokens x vocab) from the forward for the
    backward when they take at most this many GiB, instead of recomputing them: one LM-head GEMM
    less per micro-batch. 0: always recompute (least memory)."""
    router_aux_loss_coef: float = 0.0
    """Mixture-of-experts models: add the model's own load-balancing loss (its transformers
    `load_balancing_loss_func`) times this to the loss; 0: not added (its value is still reported,
    train/router_aux_loss). Qwen3-MoE's pretraining used 0.001. A dense model refuses a nonzero value."""
    experts_implementation: str | None = None
    """Mixture-of-experts models: how transformers runs a layer's experts in the trainer (its
    `experts_implementation`): eager (a loop over the experts that got tokens), batched_mm (each
    token's top-k experts' weights gathered, one batched matmul: memory grows as tokens x top_k x an
    expert's weights, meant for decoding), grouped_mm (tokens sorted by expert,
    one torch._grouped_mm per projection). None: grouped_mm, transformers' own default; all three
    train to the same losses, and which is fastest is benchmarks/trainer_bench.py's question (its
    +experts_* variants). No effect on a dense model; vLLM's experts are its own."""
    expert_parallel: bool = False
    """Mixture-of-experts models: each trainer rank keeps experts / ranks of every layer's experts and sends
    each token to the ranks that hold its top-k experts by all-to-all (prl.trainer.expert_parallel), instead
    of FSDP all-gathering every expert of a layer before its forward and reduce-scattering their gradients.
    Same losses either way; which is faster is benchmarks/trainer_bench.py's +ep variant's
    question (docs/moe.md). Needs more than one trainer rank and experts divisible by the ranks; not with
    trainer.lora (frozen experts) or trainer.offload (the experts would stay on the GPU)."""
    routing_replay: bool = False
    """Mixture-of-experts models: the trainer's MoE layers send each token to the experts vLLM sent it to
    when sampling (routing replay, prl.trainer.replay), so a router near-tie that the two engines break
    differently no longer changes the token's logprob. vLLM returns them (--enable-return-routed-experts,
    set for the run's servers) on GPUs only, through the token route; train/routing_replayed says what
    share of the tokens had them (docs/moe.md, "Routing replay")."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full fine-tuning (off unless trainer.lora.rank > 0)."""
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
        _positive(self.batch_poll_s, "trainer.batch_poll_s")
        _check(self.max_grad_norm > 0, "trainer.max_grad_norm", "must be > 0")
        _check(self.keep_logits_gib >= 0, "trainer.keep_logits_gib", "must be >= 0")
        _check(0 < self.activation_checkpointing_fraction <= 1, "trainer.activation_checkpointing_fraction",
               f"must be in (0, 1], got {self.activation_checkpointing_fraction}")
        _check(self.activation_checkpointing or self.activation_checkpointing_fraction == 1,
               "trainer.activation_checkpointing_fraction", "takes effect with trainer.activation_checkpointing: true")
        _check(self.router_aux_loss_coef >= 0 and math.isfinite(self.router_aux_loss_coef),
               "trainer.router_aux_loss_coef", f"must be a finite number >= 0, got {self.router_aux_loss_coef}")
        _one_of(self.behaviour_logprobs, BEHAVIOUR_LOGPROBS, "trainer.behaviour_logprobs")
        _one_of(self.master_dtype, MASTER_DTYPES, "trainer.master_dtype")
        _one_of(self.attention, ATTENTION_KERNELS, "trainer.attention")
        _check(self.master_dtype == "float32" or not self.lora.enabled, "trainer.master_dtype",
               "bfloat16 is for full fine-tuning; LoRA adapters stay float32 (trainer.lora.rank > 0 here)")
        if self.offload_optimizer:
            _check(not self.offload, "trainer.offload_optimizer",
                   "not with trainer.offload, which keeps AdamW's state on the host already")
            _check(not self.lora.enabled, "trainer.offload_optimizer",
                   "the adapters' optimizer state is small: not with trainer.lora (trainer.lora.rank > 0 here)")
        if self.experts_implementation is not None:
            _one_of(self.experts_implementation, EXPERTS_IMPLEMENTATIONS, "trainer.experts_implementation")
        if self.expert_parallel:
            _check(self.world_size > 1, "trainer.expert_parallel",
                   "spreads experts over the trainer's ranks: needs more than one (trainer.nodes x gpus_per_node)")
            _check(not self.lora.enabled, "trainer.expert_parallel",
                   "not with trainer.lora: the adapters leave the experts frozen")
            _check(not self.offload, "trainer.expert_parallel",
                   "not with trainer.offload: the experts would stay on the GPU")
        if self.flat_params:
            _check((blocker := self.flat_params_blocker()) is None, "trainer.flat_params", blocker or "")
        _check(not self.behaviour_on_host or self.behaviour_logprobs == "recompute", "trainer.behaviour_on_host",
               "holds the versions trainer.behaviour_logprobs=recompute keeps; it is inference here")
        if self.micro_batch_tokens is not None:
            _positive(self.micro_batch_tokens, "trainer.micro_batch_tokens")

    def flat_params_blocker(self) -> str | None:
        """Why flat_params cannot be on here (one rank, fp32 master weights, none of the options that need
        FSDP's layout), None when it can."""
        if self.world_size != 1:
            return f"is for one trainer rank; this run has {self.world_size} (trainer.nodes x gpus_per_node): FSDP shards over several"
        if self.master_dtype != "float32":
            return "needs trainer.master_dtype float32"
        for other, on in (("lora", self.lora.enabled), ("offload", self.offload),
                          ("offload_optimizer", self.offload_optimizer), ("expert_parallel", self.expert_parallel)):
            if on:
                return f"not with trainer.{other}"
        return None

    @property
    def world_size(self) -> int:
        """Number of trainer ranks."""
        return self.nodes * max(self.gpus_per_node, 1)

