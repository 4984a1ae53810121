"""Expert parallelism in the trainer (trainer.expert_parallel): each rank keeps experts / ranks of every
MoE layer's experts for good, and a token's hidden state travels by all-to-all to the rank that holds each
of its top-k experts, and back.

Without it FSDP2 shards the experts' fused tensors ([experts, ...]) on their first dimension too, but it
all-gathers a layer's experts before the layer's forward and reduce-scatters their gradients after its
backward: every rank moves every expert's weights once each way per step (per micro-batch where the
gradients do not accumulate unsharded, and again for the backward's all-gather where blocks reshard).
With it the expert weights never move; what moves is top_k rows of hidden size per token, twice in the
forward and twice in the backward. Which is faster depends on the shape, the tokens per step and the
links between the GPUs: benchmarks/trainer_bench.py measures both (docs/moe.md).

The layout is FSDP's own: one mesh over every trainer rank, rank r holding experts [r E/W, (r+1) E/W)
of each layer as a DTensor sharded on dim 0. Checkpoints (DCP), exported versions and the behaviour
policy's versions see them as they see FSDP's parameters. FSDP leaves them out (ignored_params): the
all-to-all's backward brings every rank's contribution to the rank that holds an expert, so its gradient
there is complete, the sum over ranks that FSDP's reduction also computes (parallelize: no division).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

EXPERT_TENSORS = ("gate_up_proj", "down_proj")
"""A transformers 5 experts module's fused weights, [experts, ...] each (Qwen2/3-MoE, OLMoE, Mixtral)."""


def experts_modules(causal_lm: nn.Module) -> list[nn.Module]:
    """Every experts module of the model: transformers' `@use_experts_implementation` classes (their
    forward takes hidden states [T, H], top-k expert ids and weights [T, k])."""
    return [m for m in causal_lm.modules() if hasattr(type(m).forward, "__wrapped__")
            and all(isinstance(getattr(m, name, None), nn.Parameter) for name in EXPERT_TENSORS)]


def shard_experts(causal_lm: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Distribute every experts module's weights over `mesh` (dim 0: whole experts per rank) and route
    its tokens by all-to-all; returns the parameters FSDP must leave alone. ValueError, naming the key,
    where the model cannot be split so."""
    ranks = mesh.size()
    modules = experts_modules(causal_lm)
    if not modules:
        raise ValueError(f"trainer.expert_parallel: {type(causal_lm).__name__} has no experts module transformers "
                         "runs by experts_implementation (gate_up_proj / down_proj tensors)")
    kept: set[nn.Parameter] = set()
    for module in modules:
        if module.num_experts % ranks:
            raise ValueError(f"trainer.expert_parallel: {module.num_experts} experts per layer cannot be split "
                             f"evenly over {ranks} trainer ranks")
        if getattr(module, "has_bias", False) or not getattr(module, "has_gate", True):
            raise ValueError(f"trainer.expert_parallel: {type(module).__name__} has expert biases or no gate, "
                             "which expert parallelism does not split")
        for name in EXPERT_TENSORS:
            param = getattr(module, name)
            sharded = nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)]), requires_grad=param.requires_grad)
            setattr(module, name, sharded)
            kept.add(sharded)
        module.forward = types.MethodType(dispatched_forward, module)
    return kept


class LocalExperts:
    """An experts module seen through this rank's experts: transformers' own implementation of the
    module (eager, grouped_mm, batched_mm) runs on it unchanged."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        self._module = module
        self.gate_up_proj, self.down_proj = (getattr(module, n).to_local().to(dtype) for n in EXPERT_TENSORS)
        self.num_experts = self.gate_up_proj.shape[0]
        self._is_expert_parallel = False  # transformers' own (replicated tokens, sentinel ids): not this

    def __getattr__(self, name: str):
        return getattr(self._module, name)

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        return type(self._module)._apply_gate(self, gate_up_out)


def inverse(perm: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(perm)
    out[perm] = torch.arange(perm.numel(), device=perm.device)
    return out


@torch.compiler.disable  # split sizes are data (host syncs): the block's graph stops here, runs eager
def dispatched_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward with its experts spread over the ranks: each (token, expert) pair's
    row goes to the expert's rank, which runs its experts on what it received, and comes back to be
    weighted and summed as the module's own forward does. Every rank calls it the same number of times
    (packing: every rank gets as many micro-batches)."""
    weight = self.gate_up_proj
    mesh, group = weight.device_mesh, weight.device_mesh.get_group()
    ranks, local = mesh.size(), weight.to_local().shape[0]
    tokens, top_k = top_k_index.shape
    hidden = hidden_states.shape[-1]
    experts = ranks * local

    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert, so by the rank that holds it
    rows = hidden_states[order // top_k]
    per_expert = torch.bincount(flat, minlength=experts)
    from_each = torch.empty_like(per_expert)  # [source rank, local expert]: the rows each sends here
    dist.all_to_all_single(from_each, per_expert, group=group)
    send = per_expert.view(ranks, local).sum(1).tolist()
    recv = from_each.view(ranks, local).sum(1).tolist()
    received = funcol.all_to_all_single_autograd(rows, recv, send, group)

    # Received rows come by source rank, then by expert within it: group them by expert for the kernels.
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=flat.device).repeat(ranks), from_each)
    by_expert = torch.argsort(expert_of_row, stable=True)
    ones = received.new_ones(received.shape[0], 1)
    mine = LocalExperts(self, received.dtype)
    computed = _implementation(self)(mine, received[by_expert], expert_of_row[by_expert, None], ones)
    returned = funcol.all_to_all_single_autograd(computed[inverse(by_expert)], send, recv, group)
    pairs = returned[inverse(order)].view(tokens, top_k, hidden)
    return (pairs * top_k_weights[..., None].to(pairs.dtype)).sum(dim=1).to(hidden_states.dtype)


def _implementation(module: nn.Module):
    """The function transformers runs the module's experts with (trainer.experts_implementation)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS.get_interface(module.config._experts_implementation, type(module).forward.__wrapped__)


def mesh_of(device: torch.device) -> DeviceMesh:
    """One dimension over every rank: the mesh FSDP and the experts share."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))
