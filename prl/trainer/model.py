"""The policy: a Hugging Face causal LM that returns per-token logprobs, sharded with FSDP2.

    model = build_model(cfg.model, cfg.trainer, device)   # loaded, checkpointed, compiled, sharded
    logprobs, entropy = model(input_ids, position_ids)     # [1, T] each; position 0 is 0
"""

from __future__ import annotations

import importlib.util
import inspect

import torch
import torch.distributed as dist
import transformers
from loguru import logger
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

from prl.config import LoraConfig, ModelConfig, TrainerConfig
from prl.run.lora import is_adapter
from prl.trainer import expert_parallel
from prl.trainer.loss import chunked_logprobs
from prl.trainer.replay import install, set_replay, unrecorded
from prl.trainer.routing import Tally, experts_of
from prl.trainer.samples import sample_bounds


VARLEN = "prl_varlen"
"""Attention over packed samples through PyTorch's own flash varlen kernel (CUDA, no flash_attn package)."""


def _torch_varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _gqa_flag(fn) -> bool:
    return "enable_gqa" in inspect.signature(fn).parameters


def _native_gqa(fn, device: torch.device) -> bool:
    """Whether `fn` takes fewer K/V heads than query heads, checked by running it. torch >= 2.13 says
    so (`enable_gqa`); torch 2.11's varlen_attn has no flag, yet passes K/V to the flash kernel,
    which groups heads itself. Tried once on a tiny input, forward and backward, against the
    expanded heads; any error or mismatch means expand (the slower, always-correct path)."""
    extra = {"enable_gqa": True} if _gqa_flag(fn) else {}
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(96, h, 64, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for h in (4, 2, 2))
        cu = torch.tensor([0, 40, 96], dtype=torch.int32, device=device)
        grouped = fn(q, k, v, cu, cu, 56, 56, window_size=(-1, 0), **extra)
        expanded = fn(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), cu, cu, 56, 56, window_size=(-1, 0))
        upstream = torch.randn(grouped.shape, device=device, dtype=grouped.dtype, generator=gen)
        got = (grouped, *torch.autograd.grad(grouped, (q, k, v), upstream))
        want = (expanded, *torch.autograd.grad(expanded, (q, k, v), upstream))
        return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
                   for a, b in zip(got, want))
    except (RuntimeError, ValueError, TypeError):
        return False


_VARLEN = {}
"""The kernel and whether it takes grouped K/V heads, looked up once: no import or inspect per
layer call (and none inside a torch.compile'd decoder block, where they would break the graph)."""


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: causal attention inside each sample of a packed [1, T] row.

    Without it (and without flash_attn) SDPA gets a dense [T, T] block-causal mask: O(T^2) work and
    memory over the whole packed row instead of over each sample, and no flash kernel.
    """
    cu_seqlens, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [1, H, T, D] -> [T, H, D]
    varlen_attn, gqa = _VARLEN["fn"], _VARLEN["gqa"]
    if not gqa:  # one K/V head per query head
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scaling, window_size=(-1, 0),
                      **_VARLEN["extra"])
    return out[None], None  # [1, T, H, D], like transformers' own attention functions


def register_varlen(fn, device: torch.device, gqa: bool | None = None) -> str:
    """Register `fn` (torch's varlen_attn signature) as the VARLEN attention of transformers; `gqa`:
    whether it takes grouped K/V heads (None: _native_gqa finds out)."""
    gqa = _native_gqa(fn, device) if gqa is None else gqa
    _VARLEN.update(fn=fn, gqa=gqa, extra={"enable_gqa": True} if gqa and _gqa_flag(fn) else {})
    AttentionInterface.register(VARLEN, varlen_attention)
    return VARLEN


FA4_NOT_INSTALLED = "the flash-attn-4 package is not installed"


def _fa4_api_missing() -> str | None:
    """What prl::fa4_varlen calls that this flash-attn-4 lacks (its varlen function's return_lse, its
    backward's keywords), or why flash_attn.cute does not import; None: nothing. Checked because the
    backward is a private function of the package, which its betas may change (4.0.0b19 and
    4.0.0b36 have it alike; b36 is the one measured)."""
    try:
        from flash_attn.cute import interface
    except Exception as e:  # noqa: BLE001  (a CUDA library the DSL needs, a version mismatch)
        return f"flash_attn.cute does not import: {type(e).__name__}: {e}".splitlines()[0]
    wanted = {"flash_attn_varlen_func": ("cu_seqlens_q", "max_seqlen_q", "softmax_scale", "causal", "return_lse"),
              "_flash_attn_bwd": ("softmax_scale", "causal", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                  "max_seqlen_k")}
    for name, keywords in wanted.items():
        fn = getattr(interface, name, None)
        missing = [k for k in keywords if k not in inspect.signature(fn).parameters] if callable(fn) else ["itself"]
        if missing:
            return f"this flash-attn-4's flash_attn.cute.interface.{name} lacks {', '.join(missing)}"
    return None


def _fa4_ready(device: torch.device) -> str | None:
    """Why FlashAttention 4 (the flash-attn-4 package, `flash_attn.cute`) cannot run here; None: it can.
    FA4 has kernels for Hopper and Blackwell (compute capability 9.x and 10.x) only."""
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return FA4_NOT_INSTALLED
    major = torch.cuda.get_device_capability(device)[0]
    if major not in (9, 10):
        return f"FA4 has kernels for compute capability 9.x and 10.x, this GPU is {major}.x"
    return _fa4_api_missing()


_FA4_OPS = []


def _fa4_op():
    """prl::fa4_varlen, registered once: FlashAttention 4's causal varlen forward (the package's public
    flash_attn_varlen_func) and backward (its _flash_attn_bwd, which that function's own backward calls)
    as torch custom ops with fake shapes. torch.compile then traces a decoder block through them as one
    opaque kernel each: one graph a block. A graph break around the call (its first form) split each
    block in two, and gained 1.3 MFU points at 1.5B where the kernel alone is 0.56x torch's, none at 7B
    (benchmarks/reports/trainer-kernels-fa4-logprobs_h200_2026-12-03.md)."""
    if _FA4_OPS:
        return _FA4_OPS[0]
    from flash_attn.cute.interface import _flash_attn_bwd, flash_attn_varlen_func

    @torch.library.custom_op("prl::fa4_varlen", mutates_args=())
    def fa4_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                              max_seqlen_q=max_len, max_seqlen_k=max_len, softmax_scale=scale,
                                              causal=True, return_lse=True)
        return out, lse

    @fa4_fwd.register_fake
    def _(q, k, v, cu_seqlens, max_len, scale):  # out [T, H, D] like q; lse [H, T] fp32
        return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)

    @torch.library.custom_op("prl::fa4_varlen_backward", mutates_args=())
    def fa4_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, scale, True, cu_seqlens_q=cu_seqlens,
                                     cu_seqlens_k=cu_seqlens, max_seqlen_q=max_len, max_seqlen_k=max_len)[:3]
        return dq, dk, dv

    @fa4_bwd.register_fake
    def _(dout, q, k, v, out, lse, cu_seqlens, max_len, scale):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        q, k, v, cu_seqlens, ctx.max_len, ctx.scale = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = fa4_bwd(dout, q, k, v, out, lse, cu_seqlens, ctx.max_len, ctx.scale)
        return dq, dk, dv, None, None, None

    fa4_fwd.register_autograd(backward, setup_context=setup_context)
    _FA4_OPS.append(fa4_fwd)
    return fa4_fwd


def fa4_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale=None, window_size=(-1, 0), **_):
    """FlashAttention 4's varlen attention in torch's varlen_attn signature ([T, H, D]; K/V heads
    grouped natively; self-attention over packed samples, so one cu_seqlens); only the causal window
    (-1, 0) is asked for. Through prl::fa4_varlen, not torch's FA4 dispatcher override: torch 2.11's
    wrapper expects another return than flash-attn-4's."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _fa4_op()(q, k, v, cu_seqlens_q, max_q, scale)[0]


def _flash_attn_2() -> bool:
    """Whether the flash-attn 2 package is installed (flash-attn-4 installs flash_attn.cute alone)."""
    return importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec("flash_attn_2_cuda") is not None


def attn_implementation(device: torch.device, kernel: str = "auto") -> str:
    """The attention kernel for packed micro-batches (trainer.attention): on CUDA, `fa4` FlashAttention 4
    (fa4_varlen), failing where it cannot run; `torch` PyTorch's own varlen flash kernel whatever is
    installed; `auto` FA4 where _fa4_ready says it can run, else flash_attention_2 (the flash-attn
    package) where it is installed, else torch's kernel. SDPA on CPU.

    All keep packed samples apart with attention_mask=None: flash-attn and varlen through
    cu_seqlens (from position_ids), SDPA through the dense block-causal mask transformers builds
    when position_ids restart (masking_utils.find_packed_sequence_indices; tested).
    """
    if device.type != "cuda":
        return "sdpa"
    if kernel in ("fa4", "auto"):
        why_not = _fa4_ready(device)
        if why_not is None:  # K/V heads grouped natively: no probe (it would compile FA4 kernels for its shape)
            return register_varlen(fa4_varlen, device, gqa=True)
        if kernel == "fa4":
            raise RuntimeError(f"trainer.attention=fa4: {why_not}")
        if why_not != FA4_NOT_INSTALLED:
            logger.warning(f"trainer.attention=auto: not FlashAttention 4: {why_not}")
    if kernel == "auto" and _flash_attn_2():
        return "flash_attention_2"
    if _torch_varlen_attn() is not None:
        return register_varlen(_torch_varlen_attn(), device)
    return "sdpa"


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
    12,288 tokens ran slower than in the strict mode."""
    import torch._inductor.config as inductor_config  # torch imports Inductor lazily

    if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):  # a torch without the fusion: no guards
        inductor_config.triton.mix_order_reduction_non_strict_mode = True
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
    if trainer_cfg.compile:
        compile_layers(layers)
        if device.type == "cuda":
            # The LM head's softmax work fused: a chunk costs two bf16 [C, V] buffers instead of
            # several fp32 ones, so chunks can be 4x larger (fewer fp32 weight-gradient passes).
            model.compiled_loss, model.chunk_size = True, 4 * model.chunk_size

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
