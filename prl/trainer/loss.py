"""The RL objective: per-token logprobs from hidden states, and a token-level clipped policy gradient.

Logprobs are computed from the last hidden states and the LM-head weight in chunks of tokens,
with a custom backward: a [T, vocab] fp32 logits tensor (T = 16k, vocab = 152k: 10 GB) never
exists. The backward either recomputes each chunk's logits (one more LM-head GEMM) or, when the
caller allows it (`keep_logits`), reuses the forward's compute-dtype chunks: the same values,
bit for bit, for T x vocab x 2 bytes of memory between the forward and the backward.
"""

from __future__ import annotations

import torch

STATS = ("loss", "entropy", "mismatch_kl", "clipped", "tokens")
"""The per-step sums `policy_gradient_loss` returns, in this order (all-reduced as one tensor)."""


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The matmul runs in the compute dtype like vLLM's LM head (bf16 logits); the kernels below
    # upcast: the trainer's logprobs then differ from the sampler's only by kernel noise.
    return hidden @ weight.t()


def _logprob_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """[C, V] logits -> (logprob of each target, entropy, logsumexp), fp32, each [C]."""
    scaled = logits.float() / temperature
    lse = scaled.logsumexp(dim=-1)
    all_logprobs = scaled - lse[:, None]
    logprobs = all_logprobs.gather(1, targets[:, None]).squeeze(1)
    # -sum p log p, not logsumexp - sum p * logits: the latter cancels badly at low entropy in fp32.
    entropy = -(all_logprobs.exp() * all_logprobs).sum(dim=-1)
    return logprobs, entropy, lse


def _grad_logits(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    """d loss / d logits = grad * (onehot(target) - softmax) / temperature, in the logits' dtype.

    The softmax comes from the forward's logsumexp: one pass over the [C, V] logits, no reduction.
    """
    softmax = (logits.float() / temperature - lse[:, None]).exp()
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
    return ((onehot.float() - softmax) * (grad[:, None] / temperature)).to(logits.dtype)


# On CUDA the [C, V] elementwise/reduction work (upcast, logsumexp, gather, entropy; the softmax
# gradient) is memory-bound and, eager, several times the LM-head matmul (about eight passes over
# an fp32 [C, V] tensor per chunk). Compiled, each is one or two passes over the bf16 logits.
_COMPILED = {}


def _kernels(compiled: bool):
    if not compiled:
        return _logprob_stats, _grad_logits
    if not _COMPILED:
        _COMPILED["stats"] = torch.compile(_logprob_stats, dynamic=True)
        _COMPILED["grad"] = torch.compile(_grad_logits, dynamic=True)
    return _COMPILED["stats"], _COMPILED["grad"]


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """grad_weight (fp32) += grad_logits.T @ hidden; on CUDA with fp32 output straight from the GEMM
    (a bf16 product, upcast and added is three more passes over [V, H])."""
    if grad_logits.is_cuda and grad_logits.dtype != torch.float32 and _FP32_OUT_GEMM[0]:
        try:
            torch.addmm(grad_weight, grad_logits.t(), hidden, out_dtype=torch.float32, out=grad_weight)
            return
        except (RuntimeError, TypeError):  # a torch without addmm.dtype_out for this device/dtype
            _FP32_OUT_GEMM[0] = False
    grad_weight += (grad_logits.t() @ hidden).float()


_FP32_OUT_GEMM = [True]


class _ChunkedLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (logprob of each target [N], entropy [N]), fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, compiled, keep_logits):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        stats, _ = _kernels(compiled)
        ctx.logits = []
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logits = _chunk_logits(hidden[start:end], weight)
            logprobs[start:end], entropy[start:end], lse[start:end] = stats(logits, targets[start:end], temperature)
            if keep_logits and any(ctx.needs_input_grad[:2]):
                ctx.logits.append(logits)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_size, ctx.compiled = temperature, chunk_size, compiled
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        _, grad_kernel = _kernels(ctx.compiled)
        grad_hidden = torch.empty_like(hidden)
        # Accumulate the weight gradient in fp32: it sums T/chunk_size partial products.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        kept, ctx.logits = ctx.logits, None
        for i, start in enumerate(range(0, hidden.shape[0], ctx.chunk_size)):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            # Kept from the forward, or recomputed: same inputs, same kernel, the same logits.
            logits = kept[i] if kept else _chunk_logits(hidden[start:end], weight)
            if kept:
                kept[i] = None  # freed chunk by chunk
            grad_logits = grad_kernel(logits, targets[start:end], lse[start:end], grad_logprobs[start:end],
                                      ctx.temperature).to(hidden.dtype)
            grad_hidden[start:end] = grad_logits @ weight
            _accumulate_weight_grad(grad_weight, grad_logits, hidden[start:end])
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
    chunk_size: int = 1024, compiled: bool = False, keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T / temperature)[targets] and the entropy of that distribution, per row.

    `compiled`: the per-chunk softmax work through torch.compile (GPU; eager everywhere else).
    `keep_logits`: keep the [N, V] compute-dtype logits for the backward instead of recomputing them.
    """
    return _ChunkedLogprobs.apply(hidden, weight, targets, temperature, chunk_size, compiled, keep_logits)


def policy_gradient_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    mb: dict,
    total_loss_tokens: int,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped importance-weighted policy gradient of one micro-batch -> (loss, sums of STATS).

    The loss is summed over this micro-batch's completion tokens and divided by `total_loss_tokens`,
    the completion tokens of the whole step (every micro-batch on every rank), so that accumulating
    micro-batches and summing gradients over ranks gives exactly the token mean of the step.
    """
    mask = mb["loss_mask"].to(torch.float32)
    advantages = mb["advantages"].to(torch.float32)
    # Rollouts come from the inference engine's (possibly older) policy: weight each token by
    # pi_theta / pi_inference and clip that ratio, so a stale or numerically different sampler cannot
    # push the update far (PPO's pessimistic min of unclipped and clipped surrogate).
    log_ratio = (logprobs - mb["inference_logprobs"].to(torch.float32)) * mask
    ratio = log_ratio.exp()
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    loss = (token_loss * mask).sum() / max(total_loss_tokens, 1)

    with torch.no_grad():
        # Tokens whose gradient the clip removed: the ratio left the trust region in the direction
        # the advantage pushes it.
        clipped = ((ratio < 1.0 - clip_low) & (advantages < 0)) | ((ratio > 1.0 + clip_high) & (advantages > 0))
        # k3 estimator of KL(pi_inference || pi_theta) on the sampled tokens: >= 0, unbiased.
        mismatch_kl = ratio - log_ratio - 1.0
        stats = torch.stack(
            [
                (token_loss * mask).sum(),
                (entropy * mask).sum(),
                (mismatch_kl * mask).sum(),
                (clipped.float() * mask).sum(),
                mask.sum(),
            ]
        )
    return loss, stats


def stats_to_metrics(stats: torch.Tensor) -> dict[str, float]:
    """Step-level sums (all ranks) -> token means; `tokens` stays a count."""
    sums = dict(zip(STATS, stats.tolist()))
    tokens = max(sums["tokens"], 1.0)
    metrics = {name: value / tokens for name, value in sums.items() if name != "tokens"}
    metrics["clip_fraction"] = metrics.pop("clipped")
    metrics["loss_tokens"] = sums["tokens"]
    return metrics
