"""The attention kernel of packed micro-batches (trainer.attention): FlashAttention 4 as a torch custom
op, PyTorch's own varlen flash kernel, or flash-attn 2, registered with transformers.

    config.attn_implementation = attn_implementation(device, cfg.trainer.attention)   # "prl_varlen" on CUDA
"""

from __future__ import annotations

import importlib.util
import inspect
import os

import torch
from loguru import logger
from transformers import AttentionInterface


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
FA4_CACHE = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


def _fa4_api_missing() -> str | None:
    """What prl::fa4_varlen calls that this flash-attn-4 lacks (its varlen function's return_lse, its
    backward's keywords), or why flash_attn.cute does not import; None: nothing. Checked because the
    backward is a private function of the package, which its betas may change (4.0.0b19 and
    4.0.0b36 have it alike; b36 is the one measured). Before the import, FA4's kernel cache is turned
    on where the run names its directory (a private one: protocol.COMPILE_CACHES)."""
    if os.environ.get(FA4_CACHE):
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")  # read at flash_attn.cute's import
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
            # The ops registered now, not at their first call: that call is inside a compiled block's
            # first trace, where registering breaks the graph, and the frames compiled around that
            # break stay in use (each block in five graphs: 50.8 % MFU at 1.5B on an H200, not 54),
            # and a recompute of an activation-checkpointed block, traced whole, saved one tensor
            # less than its first forward (torch.utils.checkpoint refused it; benchmarks/reports/
            # trainer-graphs-kernels-7b_h200_2026-12-03.md).
            _fa4_op()
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
