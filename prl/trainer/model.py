"""The policy: a Hugging Face causal LM that returns per-token logprobs, sharded with FSDP2.

    model = build_model(cfg.model, cfg.trainer, device)   # loaded, checkpointed, compiled, sharded
    logprobs, entropy = model(input_ids, position_ids)     # [1, T] each; position 0 is 0
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers
from loguru import logger
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from prl.config import LoraConfig, ModelConfig, TrainerConfig
from prl.run.lora import is_adapter
from prl.trainer import expert_parallel
from prl.trainer.attention import VARLEN, attn_implementation
from prl.trainer.flat import FlatParams, chosen as flat_chosen
from prl.trainer.loss import chunked_logprobs
from prl.trainer.replay import install, set_replay, unrecorded
from prl.trainer.routing import Tally, experts_of
from prl.trainer.samples import sample_bounds


class PolicyModel(nn.Module):
    """Wraps the causal LM so the root FSDP unit spans embeddings, final norm and LM head.

    The chunked logprobs need the LM-head weight and the final hidden states, not the logits the
    HF forward returns; calling the inner HF model from this module's forward keeps every root
    parameter inside a forward FSDP has unsharded.
    """

    def __init__(self, causal_lm: nn.Module, temperature: float = 1.0, chunk_size: int = 1024,
                 compiled_loss: bool = False, keep_logits_bytes: float = 0):
        super().__init__()
        self.causal_lm = causal_lm
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.compiled_loss = compiled_loss
        self.keep_logits_bytes = keep_logits_bytes
        self.accumulate_unsharded = False  # set by parallelize
        self.flat: FlatParams | None = None
        """With trainer.flat_params: the flat master weights, gradients and moments (prl.trainer.flat)."""
        self.compute_dtype = torch.float32  # the forward's (parallelize: the mixed-precision policy's)
        self.routing = Tally.of(causal_lm)
        """An MoE's routing over the step's training forwards (prl.trainer.routing); None: dense."""
        self.routers: list[nn.Module] | None = None
        """With trainer.routing_replay: the routers that replay the batch's experts (prl.trainer.replay)."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                max_len: int | None = None,
                routed_experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`cu_seqlens`/`max_len`: the samples' bounds (data.sample_bounds), computed from
        position_ids when not given; the training step passes them from the host copy. `routed_experts`:
        the experts to replay (the micro-batch's, prl.trainer.replay), with trainer.routing_replay."""
        if self.routers is not None:  # set for this forward and its recompute in the backward
            recorded = routed_experts if routed_experts is not None else unrecorded(self.routers, input_ids)
            set_replay(self.routers, recorded)
        # use_cache=False matters beyond memory: transformers only detects packed sequences
        # (restarting position_ids) when there is no KV cache.
        varlen = {}
        if self.causal_lm.config._attn_implementation == VARLEN:
            if cu_seqlens is None:
                cu_seqlens, max_len = sample_bounds(position_ids)
            varlen = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_len,
                      "max_length_k": max_len}
        # The router logits only where they are tallied: a training forward of an MoE.
        routed = {"output_router_logits": True} if self.routing is not None and torch.is_grad_enabled() else {}
        out = self.causal_lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **varlen, **routed)
        if routed:
            self.routing.add(self.causal_lm, out.router_logits)
        hidden = out.last_hidden_state
        weight = self.causal_lm.get_output_embeddings().weight
        # Token t is predicted from position t-1; position 0 has no prediction (and is never a loss token).
        keep_logits = (hidden.shape[1] - 1) * weight.shape[0] * hidden.element_size() <= self.keep_logits_bytes
        logprobs, entropy = chunked_logprobs(
            hidden[0, :-1], weight, input_ids[0, 1:], self.temperature, self.chunk_size, self.compiled_loss, keep_logits
        )
        # Fresh [1, T] tensors, not views: FSDP hooks the outputs for the backward, and a view
        # invites an in-place op that would silently bypass that hook.
        zero = logprobs.new_zeros(1, 1)
        return torch.cat([zero, logprobs[None]], dim=1), torch.cat([zero, entropy[None]], dim=1)


def load_causal_lm(model_cfg: ModelConfig, device: torch.device, master_dtype: str = "float32",
                   attention: str = "auto") -> nn.Module:
    """The HF model with its master weights in `master_dtype` (trainer.master_dtype; FSDP's mixed
    precision casts them for compute)."""
    transformers.utils.logging.disable_progress_bar()  # one bar per rank is noise in the logs
    config = AutoConfig.from_pretrained(model_cfg.name, trust_remote_code=model_cfg.trust_remote_code)
    config.use_cache = False
    return AutoModelForCausalLM.from_pretrained(
        model_cfg.name,
        config=config,
        dtype=getattr(torch, master_dtype),
        attn_implementation=attn_implementation(device, attention),
        trust_remote_code=model_cfg.trust_remote_code,
    )


def use_experts_implementation(causal_lm: nn.Module, implementation: str | None) -> None:
    """An MoE's experts run by `implementation` (trainer.experts_implementation; None: as loaded,
    transformers' default grouped_mm); a dense model is left alone (it has no experts to switch)."""
    if implementation is not None and experts_of(causal_lm) is not None:
        causal_lm.set_experts_implementation(implementation)


def decoder_layers(causal_lm: nn.Module) -> nn.ModuleList:
    """The transformer blocks (Qwen2/Llama/Mistral layout: `model.layers`)."""
    return causal_lm.model.layers


def compile_layers(layers: torch.nn.ModuleList) -> None:
    """Each decoder block through torch.compile, for any length (packed micro-batches vary in length).

    Inductor's mix-order reduction (Triton: one kernel for reductions over rows and over columns, as
    a norm's backward has) is fused only where its strict mode's size checks pass (rows * hidden >=
    5 * 2**20, rows >= 2 * hidden, rows >= 4,096), and with dynamic lengths each check is a guard:
    every graph holds only on its side of three lengths. At 1.5B a micro-batch of 3,700 tokens
    compiled for 9 s after the prewarm's lengths (12,288, then halving), and in the loop one under
    4,096 tokens for 17 s (benchmarks/reports/compile-stall-fixes-warm-start_h200x2_2026-11-28.md). The
    non-strict mode skips those checks: one graph for every length there, and no length from 47 to
    12,288 tokens ran slower than in the strict mode.

    Dynamo's guards on the modules FSDP manages are kept (skip_fsdp_guards off): skipping them also
    gives their int attributes an FSDP guard source, which dynamic=True reads as symbols, not
    constants. The head width then ran through every block as a run-time number: the RoPE kernels
    divided each element's index by it in 64 bits, and moved about 70 MB in 0.19 ms (0.35 TB/s) where
    the SiLU kernel beside them moves 550 MB in 0.13 ms, on an H200
    (benchmarks/reports/trainer-graphs-kernels-7b_h200_2026-12-03.md). With the guards kept, RoPE's
    kernels take 18 ms of a 1.5B step instead of 71, and the step 54.3 -> 55.0-56.4 % MFU
    (benchmarks/reports/trainer-head-width-timeline-1.5b-7b_h200_2026-12-04.md)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config  # torch imports Inductor lazily

    if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):  # a torch without the fusion: no guards
        inductor_config.triton.mix_order_reduction_non_strict_mode = True
    dynamo_config.skip_fsdp_guards = False
    for layer in layers:
        layer.compile(dynamic=True)


def parallelize(
    model: PolicyModel, trainer_cfg: TrainerConfig, compute_dtype: torch.dtype, device: torch.device
) -> PolicyModel:
    """Activation checkpointing, then compile, then FSDP2 — in that order, and why:

    - checkpointing first, so compile traces the recomputation into the same graph as the block;
    - compile per block before sharding, so FSDP's all-gather/reduce-scatter hooks stay outside the
      compiled graphs (no graph breaks) and every block compiles to the same code;
    - FSDP2 last and outermost: one unit per decoder block (its all-gather overlaps the previous
      block's compute), then the root unit (embeddings, final norm, LM head).
    """
    layers = decoder_layers(model.causal_lm)
    if trainer_cfg.activation_checkpointing:
        model.causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in layers[checkpointed_blocks(len(layers), trainer_cfg.activation_checkpointing_fraction):]:
            layer.gradient_checkpointing = False  # transformers' GradientCheckpointingLayer reads it each call
    if trainer_cfg.compile:
        compile_layers(layers)
        if device.type == "cuda":
            # The LM head's softmax work fused: a chunk costs two bf16 [C, V] buffers instead of
            # several fp32 ones, so chunks can be 4x larger (fewer fp32 weight-gradient passes).
            model.compiled_loss, model.chunk_size = True, 4 * model.chunk_size

    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    flat, why = flat_chosen(trainer_cfg.flat_params, trainer_cfg.flat_params_blocker(), trained, compute_dtype, gpu_bytes)
    if flat:  # one rank, no FSDP (prl.trainer.flat); compute dtype as FSDP's policy below
        model.compute_dtype = compute_dtype if device.type == "cuda" else next(model.parameters()).dtype
        model.flat = FlatParams(model, model.compute_dtype)
        logger.info(f"one rank without FSDP ({why}): {len(model.flat.named)} parameters in flat "
                    f"tensors of {model.flat.master.numel():,} elements")
        return model
    if gpu_bytes is not None and trainer_cfg.world_size == 1:
        logger.info(f"FSDP on one rank ({why})")
    # Mixed precision only on GPU: bf16 compute, fp32 master weights and fp32 gradient reduction
    # (bf16 sums over many ranks lose bits). CPU runs stay fp32, which exact resume tests rely on.
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if device.type == "cuda" else None
    kwargs = {"mp_policy": mp} if mp is not None else {}
    if trainer_cfg.expert_parallel:
        # The experts spread over the same mesh as FSDP's shards, and left out of its units.
        kwargs["mesh"] = expert_parallel.mesh_of(device)
        kwargs["ignored_params"] = expert_parallel.shard_experts(model.causal_lm, kwargs["mesh"])
        experts, _ = experts_of(model.causal_lm)
        logger.info(f"expert parallel: {experts // dist.get_world_size()} of each layer's {experts} experts on each "
                    f"of {dist.get_world_size()} ranks, tokens by all-to-all")
    if trainer_cfg.offload:
        # Shards, gradients and (so) AdamW's state in host memory, pinned for asynchronous copies.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    model.compute_dtype = compute_dtype if mp is not None else next(model.parameters()).dtype
    # Resharding after the forward saves the bf16 copy of each block until its backward, at the cost
    # of a second all-gather (NCCL, a cast and copies) per micro-batch. Not worth it on one rank, nor
    # when gradients accumulate unsharded anyway (train_step): blocks then stay gathered from the
    # step's first forward to its last backward, one all-gather and one reduce-scatter per step.
    model.accumulate_unsharded = fits_unsharded(model, device, trainer_cfg.offload)
    reshard = dist.is_initialized() and dist.get_world_size() > 1 and not model.accumulate_unsharded
    for i, layer in enumerate(layers):
        # The last block's parameters are needed again right away by the backward: keep them gathered.
        fully_shard(layer, reshard_after_forward=reshard and i < len(layers) - 1, **kwargs)
    fully_shard(model, **kwargs)
    # The loss is already divided by the step's token count over all ranks: gradients must be
    # summed over ranks, not averaged (FSDP's default divides by the world size). A plain SUM
    # (no PREMUL_SUM op) is what gloo supports, and what NCCL can run zero-copy.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def checkpointed_blocks(blocks: int, fraction: float) -> int:
    """How many of `blocks` decoder blocks recompute (trainer.activation_checkpointing_fraction): the
    first ones. Which ones does not change the peak, reached as the forward ends with every kept
    block's activations held, but the last block's backward comes right after its forward, where a
    recompute would save nothing."""
    return max(1, min(blocks, round(fraction * blocks)))


UNSHARDED_FRACTION = 0.25
"""Accumulate micro-batches unsharded when that extra state takes at most this share of a GPU."""
OFFLOADED_FRACTION = 0.7
"""The same with trainer.offload, whose GPU holds no master weights or optimizer state: there the
alternative is each micro-batch's gradients copied to the host and added there."""


def fits_unsharded(model: nn.Module, device: torch.device, offload: bool = False) -> bool:
    """Whether unsharded gradient accumulation (fp32 gradients + bf16 weights of the whole model on
    every rank: 6 bytes per parameter) fits comfortably: yes for a 1.5B model on 80 GB (9 GB), no for
    7B (42 GB), which then reduce-scatters after every micro-batch instead; with `offload` (the
    trainer.offload key) yes for 7B on 80 GB and 14B on an H200. CPU: always (tests)."""
    if device.type != "cuda":
        return True
    # Experts already split (trainer.expert_parallel) are never gathered: only this rank's count.
    n_params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    share = OFFLOADED_FRACTION if offload else UNSHARDED_FRACTION
    return 6 * n_params <= share * torch.cuda.get_device_properties(device).total_memory


def add_adapters(causal_lm: nn.Module, lora: LoraConfig) -> None:
    """Low-rank adapters (peft's LoRA layers) on the `lora.target_modules` linear layers, in place;
    every other parameter frozen. B starts at zero: the adapted model is the base model until it trains.
    A's random start comes from torch's generator, seeded alike on every rank (seed_everything).

    Linear layers only, named in full: given bare names, peft 0.21 also wraps an MoE layer's fused
    experts (transformers 5's `experts.gate_up_proj` / `down_proj` tensors, a ParamWrapper) when
    `down_proj` is a target, and the servers can fold no such adapter (they refused every version).
    An MoE's experts and router therefore stay frozen (docs/moe.md)."""
    import peft

    targets = [name for name, module in causal_lm.named_modules()
               if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in lora.target_modules]
    if not targets:
        raise ValueError(f"trainer.lora.target_modules: no linear layer named {', '.join(lora.target_modules)} "
                         f"in {type(causal_lm).__name__}")
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=targets, bias="none")
    peft.inject_adapter_in_model(config, causal_lm)
    for name, param in causal_lm.named_parameters():
        param.requires_grad_(is_adapter(name))
        if is_adapter(name):
            param.data = param.data.float()  # fp32 master weights, whatever the base is stored in


def build_model(model_cfg: ModelConfig, trainer_cfg: TrainerConfig, temperature: float, device: torch.device) -> PolicyModel:
    """Load the HF model on CPU (with adapters: trainer.lora), move it to `device` and shard it over
    the default process group."""
    causal_lm = load_causal_lm(model_cfg, device, trainer_cfg.master_dtype, trainer_cfg.attention)
    use_experts_implementation(causal_lm, trainer_cfg.experts_implementation)
    if trainer_cfg.lora.enabled:
        if device.type == "cuda":
            # A frozen base needs no fp32 master copy: stored in model.dtype it takes half the memory
            # and FSDP gathers it as is. (CPU stays fp32 throughout, as exact resume tests need.)
            causal_lm = causal_lm.to(getattr(torch, model_cfg.dtype))
        add_adapters(causal_lm, trainer_cfg.lora)
    # With trainer.offload the weights stay on the host: FSDP moves one block at a time through the GPU
    # while it shards (the whole fp32 model at 14B would not fit an 80 GB card first).
    causal_lm = causal_lm if trainer_cfg.offload else causal_lm.to(device)
    model = PolicyModel(causal_lm, temperature=temperature, keep_logits_bytes=trainer_cfg.keep_logits_gib * 2**30)
    if trainer_cfg.routing_replay:  # before compile and sharding, which must see the routers' final classes
        model.routers = install(causal_lm)
    if trainer_cfg.router_aux_loss_coef and model.routing is None:
        raise ValueError(f"trainer.router_aux_loss_coef: {model_cfg.name} has no experts to balance; set it to 0")
    model.train()
    return parallelize(model, trainer_cfg, getattr(torch, model_cfg.dtype), device)
