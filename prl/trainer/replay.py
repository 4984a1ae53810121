"""Routing replay (trainer.routing_replay): the trainer's MoE layers send each token to the experts vLLM
sent it to when it sampled, instead of their own top-k.

Why: a router whose top-k scores nearly tie picks another expert under the trainer's kernels than under
vLLM's, and that token's logprob then comes from a different network; the importance ratio measures the
routing flip, not the policy's change (docs/moe.md, "Routing replay"). vLLM (GPU, started with
--enable-return-routed-experts) returns every processed position's top-k expert ids, [positions, layers,
top_k]; the orchestrator lays them along the sample's tokens (prl.orchestrator.trajectory.routing_of) and
the batch carries them as `routed_experts`, uint8 [1, T, layers, top_k], NO_ROUTE where nothing was recorded
(a sample's last token, which vLLM never runs through the model; a sample from a server that returned
none). A position with NO_ROUTE keeps the trainer's own choice.

The replayed experts' weights are still the trainer's router's: its softmax over all experts at the
replayed ids (renormalised where the router renormalises its top-k), so the router keeps its gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from prl.run.batch import ROUTED_KEY
from prl.run.packing import NO_ROUTE


class Replayed:
    """Mixed into a router's class: its forward returns the replayed experts where `prl_replay` has them."""

    prl_replay: torch.Tensor | None = None
    """This layer's recorded experts for the current forward, uint8 [tokens, top_k]; None: the router's own."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, scores, indices = super().forward(hidden_states)
        replay = self.prl_replay
        if replay is None:
            return logits, scores, indices
        recorded = replay[:, :1] != NO_ROUTE
        chosen = torch.where(recorded, replay.long(), indices)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
        if getattr(self, "norm_topk_prob", True):  # Mixtral's router always renormalises and has no flag
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(scores.dtype), chosen


def routers_of(causal_lm: nn.Module) -> list[nn.Module]:
    """The MoE layers' routers, in layer order: transformers 5's top-k routers, whose forward returns
    (logits, top-k weights, top-k ids): Qwen2/3-MoE and Mixtral tested (tests/unit/test_replay.py), OLMoE's
    of the same form."""
    return [m for m in causal_lm.modules() if type(m).__name__.endswith("TopKRouter")]


def install(causal_lm: nn.Module) -> list[nn.Module]:
    """Make every router replayable (before compile and sharding: both see the final classes); its routers."""
    routers = routers_of(causal_lm)
    if not routers:
        raise ValueError(f"trainer.routing_replay: {type(causal_lm).__name__} has no top-k routers to replay")
    for router in routers:
        if not isinstance(router, Replayed):
            router.__class__ = type(f"Replayed{type(router).__name__}", (Replayed, type(router)), {})
    return routers


def set_replay(routers: list[nn.Module], routed_experts: torch.Tensor | None) -> None:
    """The experts the next forward (and its recompute in the backward) replays: [1, T, layers, top_k], or
    None for the routers' own choice."""
    if routed_experts is not None and routed_experts.shape[2] != len(routers):
        raise ValueError(f"routed_experts has {routed_experts.shape[2]} layers, the model {len(routers)} routers")
    for layer, router in enumerate(routers):
        router.prl_replay = None if routed_experts is None else routed_experts[0, :, layer]


def unrecorded(routers: list[nn.Module], input_ids: torch.Tensor) -> torch.Tensor:
    """Nothing recorded for `input_ids` [1, T]: the routers' own choice. A replaying model's forwards always
    get a tensor (the prewarm's, a rank's one-token filler), so torch.compile meets one kind of input."""
    shape = (1, input_ids.shape[1], len(routers), routers[0].top_k)
    return torch.full(shape, NO_ROUTE, dtype=torch.uint8, device=input_ids.device)


def replayed_positions(micro_batches: list[dict]) -> int:
    """How many of the (host) micro-batches' positions have recorded experts (`train/routing_replayed`)."""
    return sum(int((mb[ROUTED_KEY][0, :, 0, 0] != NO_ROUTE).sum()) for mb in micro_batches if ROUTED_KEY in mb)
