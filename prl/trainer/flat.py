"""One trainer rank without FSDP (trainer.flat_params): the trained parameters' master weights, their
gradients and AdamW's moments each one flat tensor.

    flat = FlatParams(model, torch.bfloat16)    # the module's parameters become views of flat.compute
    optimizer = torch.optim.AdamW([flat.master], fused=True)
    loss.backward()                               # each gradient added into flat.master.grad, then freed
    flat.gradients_done(); optimizer.step(); flat.stepped()

Why: on one rank FSDP2 still does per-parameter work that a world of one does not need. It casts and
copies every parameter into and out of its all-gather buffers, and every gradient into and out of its
reduce-scatter buffers. It accumulates the micro-batches' gradients in fp32 one parameter at a time, and
wraps each result in a DTensor. At 1.5B on an H200 that was about 49 ms of GPU work a step besides fused
AdamW's 17 ms, 12 % of a 2-micro-batch step
(benchmarks/reports/trainer-head-width-timeline-1.5b-7b_h200_2026-12-04.md). Here each gradient is added
into the flat fp32 gradient as soon as the backward has it (a hook per parameter, as FSDP's own), and
then freed. Once a step, the gradient norm, the AdamW update and the cast of the master weights for the
next forward are one kernel each over the whole model.

Numerics are those of the FSDP path on one rank: compute in the compute dtype, gradients accumulated in
fp32 over the micro-batches, fp32 AdamW. The one difference: a parameter that got no gradient in a step
gets a zero one, so its moments decay, where torch's AdamW would skip it. Every parameter of a dense or
MoE model gets a gradient each step (an MoE's experts are one tensor a layer).

Checkpoints hold what FSDP's hold, under the same names (model.<name>, optim.state.<name>.exp_avg, ...),
as views of the flat tensors: a run may resume with flat_params or without, and on any number of ranks.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

ALIGN = 64
"""Each parameter starts at a multiple of this many elements of the flat tensors (128 bytes in bf16): the
compiled blocks' kernels get aligned inputs, as they do from separate allocations."""
ROW = 1 << 16
"""The flat tensors' length is a multiple of this: the gradient's norm is taken row by row, then over
the rows' norms, as FSDP's path takes it parameter by parameter. In one pass over 394k elements torch's
CPU norm was off by 2e-5 of the value (fp64's), more than its per-parameter norms."""
STATE_FRACTION = 0.8
"""The share of a GPU that the flat state may take (the rest: activations, the LM head's chunks)."""
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")
"""An optimizer group's settings that choose torch's implementation, not the update: a checkpoint's are
not taken (a CPU run's unfused AdamW would otherwise run unfused on the GPU that resumes it)."""


class FlatParams:
    """The flat tensors of a model's trained parameters, and the hooks that fill the gradient
    (module docstring). `compute_dtype`: the module's parameters' dtype from now on. In the master dtype
    they are views of the master weights themselves (a CPU trainer's fp32); otherwise of `compute`,
    which `stepped` casts from the master weights after each update."""

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype):
        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        dtypes = {p.dtype for _, p in self.named}
        if len(dtypes) != 1:
            raise ValueError(f"trainer.flat_params: the trained parameters have several dtypes ({sorted(map(str, dtypes))})")
        self.spans, total = [], 0
        for _, p in self.named:
            self.spans.append((total, p.numel()))
            total += -(-p.numel() // ALIGN) * ALIGN
        total = -(-total // ROW) * ROW
        device = self.named[0][1].device
        if device.type == "cuda":
            check_fits(total, compute_dtype, torch.cuda.get_device_properties(device).total_memory)
        # Zeros: the padding between parameters stays zero in the weights, gradients and moments.
        self.master = nn.Parameter(torch.zeros(total, dtype=dtypes.pop(), device=device))
        self.master.grad = torch.zeros_like(self.master)
        aliased = compute_dtype == self.master.dtype
        self.compute = self.master.data if aliased else torch.empty(total, dtype=compute_dtype, device=device)
        with torch.no_grad():
            for (_, p), (start, n) in zip(self.named, self.spans):
                self.master[start : start + n].copy_(p.detach().reshape(-1))
                p.data = self.compute[start : start + n].view(p.shape)  # frees the loaded tensor
                p.register_post_accumulate_grad_hook(functools.partial(self._add, self._view(self.master.grad, p)))
        self._fresh: set[int] = set()
        self.stepped()

    def _view(self, flat: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """`param`'s place in `flat` (the master weights, their gradient or a moment), in its shape."""
        start, n = self.spans[self._index[id(param)]]
        return flat[start : start + n].view(param.shape)

    @functools.cached_property
    def _index(self) -> dict[int, int]:
        return {id(p): i for i, (_, p) in enumerate(self.named)}

    def _add(self, grad: torch.Tensor, param: nn.Parameter) -> None:
        """After the backward accumulated `param`'s gradient: into its fp32 place (the step's first one
        copied, no zeroing pass), and the compute-dtype gradient freed."""
        if id(param) in self._fresh:
            grad.copy_(param.grad)
            self._fresh.discard(id(param))
        else:
            grad.add_(param.grad)
        param.grad = None

    def reset(self) -> None:
        """The next gradient of every parameter starts the step's sum (after a step, or a prewarm's backward)."""
        self._fresh = {id(p) for _, p in self.named}

    def gradients_done(self) -> None:
        """Before the step's gradient norm: zeros for a parameter that got no gradient this step."""
        for _, p in self.named:
            if id(p) in self._fresh:
                self._view(self.master.grad, p).zero_()

    def grad_norm(self) -> torch.Tensor:
        """The gradient's 2-norm (fp32, on its device): two reductions, no host sync."""
        rows = torch.linalg.vector_norm(self.master.grad.view(-1, ROW), dim=1)
        return torch.linalg.vector_norm(rows)

    def stepped(self) -> None:
        """After the master weights changed (an update, a checkpoint loaded): the weights for compute
        cast from them, one kernel, and the next step's gradients fresh."""
        if self.compute.data_ptr() != self.master.data_ptr():
            self.compute.copy_(self.master.detach())
        self.reset()

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """get_model_state_dict's layout: every name of model.state_dict() (a tied LM head's too), a trained
        parameter's being the view of its master weights."""
        master = {id(p): self._view(self.master.detach(), p) for _, p in self.named}
        return {name: master.get(id(t), t) for name, t in model.state_dict(keep_vars=True).items()}

    def optim_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """get_optimizer_state_dict's layout, under the parameters' names: views of the flat moments, the
        one step count, and the group's settings. A fresh optimizer's state is made first (zeros, step 0)
        for a checkpoint to load into."""
        state = optimizer.state[self.master]
        if not state:
            fused = optimizer.param_groups[0].get("fused") or optimizer.param_groups[0].get("capturable")
            state["step"] = torch.zeros((), dtype=torch.float32, device=self.master.device if fused else "cpu")
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(self.master), torch.zeros_like(self.master)
        per_name = {name: {"step": state["step"], "exp_avg": self._view(state["exp_avg"], p),
                           "exp_avg_sq": self._view(state["exp_avg_sq"], p)} for name, p in self.named}
        (group,) = optimizer.param_groups
        settings = {key: value for key, value in group.items() if key != "params"}
        return {"state": per_name, "param_groups": [settings | {"params": [name for name, _ in self.named]}]}

    def loaded(self, optimizer: torch.optim.Optimizer, optim_state: dict | None) -> None:
        """After DCP filled model_state's and optim_state's views in place: the group's settings as the
        checkpoint has them (as torch's load_state_dict takes them, IMPLEMENTATION_KEYS aside), and the
        weights for compute cast from the loaded master weights."""
        if optim_state is not None:
            (saved,) = optim_state["param_groups"]
            (group,) = optimizer.param_groups
            group.update({k: v for k, v in saved.items() if k != "params" and k not in IMPLEMENTATION_KEYS})
        self.stepped()


def state_bytes(numel: int, compute_dtype: torch.dtype) -> int:
    """The flat state of `numel` fp32 elements: master weights, gradient and AdamW's two moments (16 bytes
    an element), and the weights for compute unless they are the master weights themselves."""
    compute = 0 if compute_dtype == torch.float32 else torch.tensor([], dtype=compute_dtype).element_size()
    return numel * (16 + compute)


def fits(numel: int, compute_dtype: torch.dtype, gpu_bytes: int) -> bool:
    """Whether the flat state of `numel` elements takes at most STATE_FRACTION of the GPU."""
    return state_bytes(numel, compute_dtype) <= STATE_FRACTION * gpu_bytes


def check_fits(numel: int, compute_dtype: torch.dtype, gpu_bytes: int) -> None:
    """ValueError naming trainer.flat_params when the flat state would take more than STATE_FRACTION of the
    GPU: a 7B's is 137 GB, against FSDP's path, whose bf16 master weights or host moments fit it."""
    if not fits(numel, compute_dtype, gpu_bytes):
        raise ValueError(f"trainer.flat_params: the flat state of {numel / 1e9:.1f}B parameters takes "
                         f"{state_bytes(numel, compute_dtype) / 2**30:.0f} GiB, over {STATE_FRACTION:.0%} of this GPU's "
                         f"{gpu_bytes / 2**30:.0f} GiB; set it to false (FSDP's path, with trainer.master_dtype bfloat16 "
                         "or offload_optimizer for less memory: docs/gpu.md)")


def chosen(setting: bool | None, blocker: str | None, numel: int, compute_dtype: torch.dtype,
           gpu_bytes: int | None) -> tuple[bool, str]:
    """trainer.flat_params resolved, and why: as set, or (None) on for a GPU trainer (`gpu_bytes`: its
    memory; None on CPU) when nothing needs FSDP's layout (`blocker`: what does) and the state fits."""
    if setting is not None:
        return setting, f"trainer.flat_params={str(setting).lower()}"
    if gpu_bytes is None:
        return False, "trainer.flat_params unset: FSDP on CPU"
    if blocker is not None:
        return False, f"trainer.flat_params unset; not possible here: {blocker}"
    if not fits(numel, compute_dtype, gpu_bytes):
        return False, (f"trainer.flat_params unset, and its state of {state_bytes(numel, compute_dtype) / 2**30:.0f} GiB "
                       f"would take over {STATE_FRACTION:.0%} of the GPU's {gpu_bytes / 2**30:.0f} GiB")
    return True, "trainer.flat_params unset: one GPU, and the state fits"
