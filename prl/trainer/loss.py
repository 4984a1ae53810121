"""The RL objective: per-token logprobs from hidden states, and the policy loss (`trainer.loss`).

Logprobs are computed from the last hidden states and the LM-head weight in chunks of tokens,
with a custom backward: a [T, vocab] fp32 logits tensor (T = 16k, vocab = 152k: 10 GB) never
exists. The backward either recomputes each chunk's logits (one more LM-head GEMM) or, when the
caller allows it (`keep_logits`), reuses the forward's compute-dtype chunks: the same values,
bit for bit, for T x vocab x 2 bytes of memory between the forward and the backward.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prl.config import LossConfig
from prl.config.validate import ConfigError, split_import_path


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The matmul runs in the compute dtype like vLLM's LM head (bf16 logits); the kernels below
    # upcast: the trainer's logprobs then differ from the sampler's only by kernel noise.
    return hidden @ weight.t()


def _logprob_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """[C, V] logits -> (logprob of each target, entropy, logsumexp), fp32, each [C].

    Two passes over the logits: their max m, then in one pass s = sum e and t = sum e (x - m) with
    e = exp(x - m). log p = (x - m) - log s, and the entropy -sum p log p = log s - t / s: every term
    relative to the max (the max token's is 0 exactly), so no large terms cancel at low entropy
    (not logsumexp - sum p x, which does). A logsumexp, then a pass for the entropy, took three.
    """
    scaled = logits.float() / temperature
    top = scaled.amax(dim=-1, keepdim=True)
    shifted = scaled - top
    e = shifted.exp()
    s = e.sum(dim=-1)
    log_s = s.log()
    logprobs = shifted.gather(1, targets[:, None]).squeeze(1) - log_s
    entropy = log_s - (e * shifted).sum(dim=-1) / s
    return logprobs, entropy, top[:, 0] + log_s


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


def compiled_by_rows(fn):
    """`fn` through torch.compile for any number of rows (each tensor argument's dim 0) and the
    vocabulary of the first call: dynamic=True also made the vocabulary a symbol, and every element's
    row then came from a division by a number known only at run time. On an H200, [4,096, 151,936]
    logits: 1.466 -> 0.758 ms for the logprob kernel, 2.107 -> 0.871 ms for the gradient's
    (benchmarks/reports/trainer-graphs-kernels-7b_h200_2026-12-03.md)."""
    compiled = torch.compile(fn)

    def call(*args):
        for arg in args:
            if isinstance(arg, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return compiled(*args)

    return call


def _kernels(compiled: bool):
    if not compiled:
        return _logprob_stats, _grad_logits
    if not _COMPILED:
        _COMPILED["stats"], _COMPILED["grad"] = compiled_by_rows(_logprob_stats), compiled_by_rows(_grad_logits)
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


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of `size` rows, a last chunk of one row joined to the one before:
    compiled, a 1-row chunk is a size torch.compile specializes on, so it would recompile both kernels
    in the middle of a run (dynamic=True or not), as a micro-batch of 4,098 tokens makes at chunks of
    4,096 (the prewarm's micro-batches never do)."""
    bounds = [(start, min(start + size, n)) for start in range(0, n, size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


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
        for start, end in _chunks(n, chunk_size):
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
        for i, (start, end) in enumerate(_chunks(hidden.shape[0], ctx.chunk_size)):
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


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch as a loss sees it: 1-D fp32 tensors over its T packed tokens (samples back to
    back; `position_ids` restart at 0 at each sample's first token)."""

    logprobs: torch.Tensor
    """The trainer's log-probability of each token (differentiable)."""
    behaviour_logprobs: torch.Tensor
    """The behaviour policy's log-probability of each token: vLLM's when it was sampled, or the trainer's
    recomputation with that version (trainer.behaviour_logprobs); 0 where loss_mask is False."""
    advantages: torch.Tensor
    """The token's advantage: its sample's (0 where loss_mask is False), times trainer.loss.reward_weight,
    with a teacher less teacher_kl_coef x the token's teacher KL (distill_advantages)."""
    loss_mask: torch.Tensor
    """Bool: True on the tokens the model sampled, the only ones a loss may train."""
    entropy: torch.Tensor
    """Entropy of the trainer's distribution at each token (no gradient)."""
    position_ids: torch.Tensor
    """Position of each token within its sample."""


CustomLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""`fn(inputs: LossInputs, **trainer.loss.custom_args) -> (loss, stats)`: `loss` is the SUM of the
per-token loss over the micro-batch (the trainer divides it by the loss tokens of the whole step, on
every rank, so that accumulation and data parallelism give the token mean); `stats` maps names to
sums over the micro-batch's loss tokens, the same names at every call, reported per step as
`train/custom/<name>` (sum / loss tokens of the step)."""


class PolicyLoss:
    """The configured loss of a micro-batch -> (loss, sums of `self.stats` over its loss tokens).

    The loss is summed over the micro-batch's completion tokens and divided by `total_loss_tokens`,
    the completion tokens of the whole step (every micro-batch on every rank), so that accumulating
    micro-batches and summing gradients over ranks gives exactly the token mean of the step.
    """

    METRIC_NAMES = {"clipped": "clip_fraction", "masked": "masked_fraction", "kl": "kl_term",
                    "out_of_band": "ratio_masked_fraction"}

    def __init__(self, cfg: LossConfig, custom: CustomLoss | None = None):
        self.cfg, self.custom = cfg, custom
        own = {"clip": ("clipped",), "dppo": ("masked",), "custom": ()}[cfg.type] + (("kl",) if cfg.kl_tau else ())
        own += ("out_of_band",) if cfg.ratio_band else ()
        self.shared = ("loss", "entropy", "mismatch_kl", *(("teacher_kl",) if cfg.teacher_kl_coef else ()))
        # The names of the sums each call returns, in order (all-reduced as one tensor); a custom
        # loss's are known at its first call.
        self.stats: tuple[str, ...] | None = None if custom else (*self.shared, *own, "tokens")

    def __call__(self, logprobs, entropy, mb: dict, total_loss_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        behaviour, mask = mb["behaviour_logprobs"].flatten().float(), mb["loss_mask"].flatten()
        advantages, teacher_kl = distill_advantages(self.cfg, mb["advantages"].flatten().float(), behaviour,
                                                    mb.get("teacher_logprobs"), mask)
        inputs = LossInputs(logprobs.flatten(), behaviour, advantages, mask, entropy.flatten(),
                            mb["position_ids"].flatten())
        mask = inputs.loss_mask.float()
        log_ratio = (inputs.logprobs - inputs.behaviour_logprobs) * mask
        with torch.no_grad():
            # k3 estimator of KL(pi_inference || pi_theta) on the sampled tokens: >= 0, unbiased.
            mismatch_kl = ((log_ratio.exp() - log_ratio - 1.0) * mask).sum()
            shared = [(inputs.entropy * mask).sum(), mismatch_kl, *([teacher_kl.sum()] if self.cfg.teacher_kl_coef else [])]
        if self.custom is not None:
            loss_sum, own = self._custom(inputs)
        else:
            loss_sum, own = self._builtin(inputs, log_ratio, mask)
        stats = torch.stack([loss_sum.detach(), *shared, *own, mask.sum()]).double()
        return loss_sum / max(total_loss_tokens, 1), stats

    def _builtin(self, inputs: LossInputs, log_ratio: torch.Tensor, mask: torch.Tensor):
        ratio = log_ratio.exp()
        token_loss, dropped = (clip_loss if self.cfg.type == "clip" else dppo_loss)(inputs, ratio, self.cfg)
        own = [(dropped.float() * mask).sum()]
        out_of_band = None
        if self.cfg.ratio_band:
            out_of_band = ratio_out_of_band(ratio.detach(), *self.cfg.ratio_band) & inputs.loss_mask
            token_loss = torch.where(out_of_band, 0.0, token_loss)
        loss_sum = (token_loss * mask).sum()
        if self.cfg.kl_tau:
            # On every loss token, those the clip or the mask took out of the policy gradient included:
            # they are the ones that drifted, and this term still pulls them back (gradient 2 tau log r).
            kl = self.cfg.kl_tau * (log_ratio.square() * mask).sum()
            loss_sum = loss_sum + kl
            own.append(kl.detach())
        if out_of_band is not None:
            own.append(out_of_band.float().sum())
        return loss_sum, own

    def _custom(self, inputs: LossInputs):
        loss_sum, stats = self.custom(inputs, **self.cfg.custom_args)
        names = tuple(sorted(stats))
        first = len(self.shared)
        if self.stats is None:
            self.stats = (*self.shared, *(f"custom/{n}" for n in names), "tokens")
        elif self.stats[first:-1] != tuple(f"custom/{n}" for n in names):
            raise ValueError(f"trainer.loss.custom {self.cfg.custom} returned stats {list(names)}, "
                             f"earlier {[n.removeprefix('custom/') for n in self.stats[first:-1]]}: the names must not change")
        return loss_sum, [torch.as_tensor(stats[n], dtype=torch.float32, device=loss_sum.device).detach() for n in names]

    def metrics(self, stats: torch.Tensor) -> dict[str, float]:
        """Step-level sums (all ranks) -> token means; `loss_tokens` stays a count."""
        sums = dict(zip(self.stats, stats.tolist()))
        tokens = sums.pop("tokens")
        return {self.METRIC_NAMES.get(k, k): v / max(tokens, 1.0) for k, v in sums.items()} | {"loss_tokens": tokens}


def distill_advantages(cfg: LossConfig, advantages: torch.Tensor, behaviour: torch.Tensor,
                       teacher: torch.Tensor | None, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(each token's advantage, its teacher KL or None): reward_weight x the sample's advantage, less
    teacher_kl_coef x (behaviour logprob - teacher logprob) on the loss tokens.

    log pi_student(y_t) - log pi_teacher(y_t) at a token the student sampled is the k1 estimate of
    the reverse KL KL(student || teacher) at that position; as a per-token advantage (a constant to the
    gradient, as in prime-rl, slime and Thinking Machines' on-policy distillation), the policy
    gradient of -coef x k1 lowers the student's probability of the tokens the teacher finds less
    likely than the student does, and raises the others: it goes through the importance ratio and
    its clip or mask like the reward's advantage, and a custom loss sees it in `advantages`."""
    if not cfg.teacher_kl_coef:
        return advantages * cfg.reward_weight if cfg.reward_weight != 1 else advantages, None
    if teacher is None:
        raise ValueError("trainer.loss.teacher_kl_coef is set, but the micro-batch has no teacher_logprobs")
    teacher_kl = (behaviour.detach() - teacher.flatten().float()) * mask
    return cfg.reward_weight * advantages - cfg.teacher_kl_coef * teacher_kl, teacher_kl


def clip_loss(inputs: LossInputs, ratio: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic min of the unclipped and the clipped surrogate, per token -> (loss, clipped).

    Rollouts come from the inference engine's (possibly older) policy: each token is weighted by
    pi_theta / pi_inference and that ratio clipped, so a stale or numerically different sampler
    cannot push the update far."""
    advantages = inputs.advantages
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    token_loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    with torch.no_grad():
        # Tokens whose gradient the clip removed: the ratio left the trust region in the direction
        # the advantage pushes it.
        clipped = ((ratio < 1.0 - cfg.clip_low) & (advantages < 0)) | ((ratio > 1.0 + cfg.clip_high) & (advantages > 0))
    return token_loss, clipped


def dppo_loss(inputs: LossInputs, ratio: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """-ratio * advantage on the tokens inside the trust region, nothing on the others -> (loss, masked).

    The trust region is measured on probabilities, not on the ratio (DPPO's binary total-variation
    mask, prime-rl's default): a rare token may double its probability harmlessly, a likely one may
    not move by 0.2. A token is masked only in the direction its advantage pushes it: up for A > 0,
    down for A < 0. Unlike the clip, a masked token gets no gradient even where PPO's min would keep
    the unclipped term."""
    advantages = inputs.advantages
    with torch.no_grad():
        moved = inputs.logprobs.exp() - inputs.behaviour_logprobs.exp()
        masked = ((advantages > 0) & (moved > cfg.dppo_mask_high)) | ((advantages < 0) & (moved < -cfg.dppo_mask_low))
    return -(ratio * advantages) * ~masked, masked


def ratio_out_of_band(ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Bool: tokens whose importance ratio lies outside [low, high] (trainer.loss.ratio_mask_low/high).

    Such a token gets no policy gradient whatever its advantage's sign (IcePop, Ring-1T): the clip and
    the DPPO mask only act in the direction the advantage pushes, so a token the trainer finds 20x
    likelier than the sampler did (a routing flip in an MoE, bf16 noise on a rare token) keeps, with
    A < 0, a gradient of weight 20 (PPO's unbounded side), and one it finds 20x less likely keeps, with
    A > 0, a gradient towards a probability the sampler never had. The KL term, when set, still pulls
    both back."""
    return (ratio < low) | (ratio > high)


def load_custom(path: str) -> CustomLoss:
    """The function `trainer.loss.custom` names, imported once at trainer start."""
    module_name, name = split_import_path(path, "trainer.loss.custom")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any error of the user's module, reported as one line naming the key
        raise ConfigError(f"trainer.loss.custom: cannot import {module_name}: {type(e).__name__}: {e}".splitlines()[0]) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"trainer.loss.custom: {module_name} has no function {name}")
    return fn


def build_loss(cfg: LossConfig) -> PolicyLoss:
    return PolicyLoss(cfg, load_custom(cfg.custom) if cfg.type == "custom" else None)
