"""The RL objective: per-token logprobs from hidden states, and a token-level clipped policy gradient.

Logprobs are computed from the last hidden states and the LM-head weight in chunks of tokens,
with a custom backward that recomputes each chunk's logits: a [T, vocab] fp32 logits tensor
(T = 16k, vocab = 152k: 10 GB) never exists, neither in the forward nor saved for the backward.
"""

from __future__ import annotations

import torch

STATS = ("loss", "entropy", "mismatch_kl", "clipped", "tokens")
"""The per-step sums `policy_gradient_loss` returns, in this order (all-reduced as one tensor)."""


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    # The matmul runs in the compute dtype like vLLM's LM head (bf16 logits), then is upcast:
    # the trainer's logprobs then differ from the sampler's only by kernel noise.
    return (hidden @ weight.t()).float() / temperature


class _ChunkedLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (logprob of each target [N], entropy [N]), fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logits = _chunk_logits(hidden[start:end], weight, temperature)
            all_logprobs = logits.sub_(logits.logsumexp(dim=-1, keepdim=True))  # in place: one [C, V] buffer less
            logprobs[start:end] = all_logprobs.gather(1, targets[start:end, None]).squeeze(1)
            # -sum p log p, not logsumexp - sum p * logits: the latter cancels badly at low entropy in fp32.
            entropy[start:end] = -(all_logprobs.exp() * all_logprobs).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        # Accumulate the weight gradient in fp32: it sums T/chunk_size partial products.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            grad = grad_logprobs[start:end, None]
            # d logprob(y) / d logits = onehot(y) - softmax(logits)
            grad_logits = _chunk_logits(hidden[start:end], weight, ctx.temperature).softmax(dim=-1).mul_(-grad)
            grad_logits.scatter_add_(1, targets[start:end, None], grad)
            grad_logits = (grad_logits / ctx.temperature).to(hidden.dtype)
            grad_hidden[start:end] = grad_logits @ weight
            grad_weight += (grad_logits.t() @ hidden[start:end]).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def chunked_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T / temperature)[targets] and the entropy of that distribution, per row."""
    return _ChunkedLogprobs.apply(hidden, weight, targets, temperature, chunk_size)


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
