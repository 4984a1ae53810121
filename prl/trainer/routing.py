"""How a mixture-of-experts policy routes its tokens, per step: what metrics.jsonl says under `routing/`.

    routing/load_max_over_mean/layer_N   the most loaded expert's share of layer N's routed tokens over
                                         the mean share (1 / experts): 1 is perfect balance, `experts /
                                         top_k` means every token went to the same top_k experts
    routing/entropy/layer_N              the router's entropy (nats) over all experts, mean per token
    routing/load_max_over_mean, routing/entropy   their worst (max) and mean over the layers
    train/router_aux_loss                the model's own load-balancing loss (token-weighted mean),
                                         added to the loss times trainer.router_aux_loss_coef

A dense model has none of these (Tally.of: None). Tallied only in forwards that build a graph (the
training forward), not in the behaviour recompute's; summed over micro-batches and ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn


def experts_of(causal_lm: nn.Module) -> tuple[int, int] | None:
    """(experts, experts per token) of an MoE causal LM of transformers (Qwen2/3-MoE, OLMoE, Mixtral
    all keep them on the model), None for a dense one."""
    experts, top_k = getattr(causal_lm, "num_experts", None), getattr(causal_lm, "num_experts_per_tok", None)
    return (int(experts), int(top_k)) if experts and top_k else None


def layer_sums(router_logits: Sequence[torch.Tensor], top_k: int) -> torch.Tensor:
    """[layers, experts + 2]: per layer how many of its tokens' top_k picks went to each expert, the sum
    of the router's per-token entropy, and the token count. Sums, so micro-batches and ranks add up."""
    rows = []
    for logits in router_logits:
        logits = logits.detach().float().reshape(-1, logits.shape[-1])  # [tokens, experts]
        picks = torch.topk(logits, top_k, dim=-1).indices  # softmax is monotone: the same experts
        counts = torch.bincount(picks.flatten(), minlength=logits.shape[-1]).float()
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum()
        rows.append(torch.cat([counts, entropy[None], logits.new_tensor([logits.shape[0]])]))
    return torch.stack(rows)


def metrics_of(sums: torch.Tensor) -> dict[str, float]:
    """The `routing/` metrics (module docstring) of layer_sums, summed over a step."""
    counts, entropy, tokens = sums[:, :-2], sums[:, -2], sums[:, -1].clamp(min=1)
    share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
    ratio = share.max(dim=1).values * share.shape[1]
    mean_entropy = entropy / tokens
    out = {}
    for i, (r, h) in enumerate(zip(ratio.tolist(), mean_entropy.tolist())):
        out[f"routing/load_max_over_mean/layer_{i}"] = r
        out[f"routing/entropy/layer_{i}"] = h
    out["routing/load_max_over_mean"] = ratio.max().item()
    out["routing/entropy"] = mean_entropy.mean().item()
    return out


def load_balancing_loss(causal_lm: nn.Module, router_logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """The model's own auxiliary load-balancing loss (its modeling module's `load_balancing_loss_func`,
    what its forward adds with output_router_logits), over every token of the micro-batch."""
    experts, top_k = experts_of(causal_lm)
    func = sys.modules[type(causal_lm).__module__].load_balancing_loss_func
    return func(tuple(router_logits), experts, top_k, None)


class Tally:
    """One step's routing, kept by the policy (model.PolicyModel.routing)."""

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.sums: torch.Tensor | None = None
        self.aux_sum: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None
        """The newest training forward's load-balancing loss, with its graph (the step adds it to the loss)."""

    @staticmethod
    def of(causal_lm: nn.Module) -> Tally | None:
        moe = experts_of(causal_lm)
        return Tally(moe[1]) if moe is not None else None

    def reset(self) -> None:
        self.sums = self.aux_sum = self.aux_loss = None

    def add(self, causal_lm: nn.Module, router_logits: Sequence[torch.Tensor]) -> None:
        """A training forward's router logits (one [tokens, experts] per MoE layer)."""
        sums = layer_sums(router_logits, self.top_k)
        self.aux_loss = load_balancing_loss(causal_lm, router_logits)
        aux = self.aux_loss.detach().float() * sums[0, -1]  # token-weighted: a mean over the step
        self.sums = sums if self.sums is None else self.sums + sums
        self.aux_sum = aux if self.aux_sum is None else self.aux_sum + aux

    def metrics(self) -> dict[str, float]:
        """The step's routing metrics over every rank (collective: all ranks call it); {} without a tally."""
        if self.sums is None:
            return {}
        both = torch.cat([self.sums.flatten(), self.aux_sum[None]])
        if dist.is_initialized():
            dist.all_reduce(both)
        sums = both[:-1].reshape(self.sums.shape)
        return metrics_of(sums) | {"train/router_aux_loss": (both[-1] / sums[0, -1].clamp(min=1)).item()}
