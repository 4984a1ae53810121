"""AdamW for bf16 master weights (trainer.master_dtype: bfloat16): each update computed in fp32 and
rounded stochastically back to bf16, so that updates far below bf16's resolution still move the
weights on average.

    optimizer = StochasticAdamW(params, lr=1e-6, weight_decay=0.0)   # torch.optim.AdamW's arguments

Why not torch's AdamW on bf16 parameters: it rounds to nearest. A weight of 0.02 has a bf16 spacing of
about 1.2e-4; AdamW's update is about lr (1e-6 for RL), so every update rounds away and the weights never
move. Rounding up with probability (remainder / spacing) keeps the expected weight equal to the fp32
update's. The moments are stored the same way: the second moment's increment, (1 - beta2) g^2, is
0.1 % of it, under bf16's 0.4 %.
"""

from __future__ import annotations

import shutil

import torch

CHUNK = {True: 1 << 26, False: 1 << 20}
"""Elements updated at a time, compiled or not: compiled, one kernel with no temporaries; eager, fp32
temporaries that stay in a CPU's cache."""
M32 = 0xFFFFFFFF


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2 parameter's) shard on this rank, else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def round_stochastic(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, rounded up in magnitude with probability (dropped low bits / 2**16); `noise`: uniform
    integers in [0, 2**16), one per element.

    A bf16 is an fp32 without its low 16 bits: adding a uniform 16-bit integer to the bits and then
    truncating carries into bit 16 with exactly that probability (the sign bit stays apart)."""
    bits = x.view(torch.int32)
    return ((bits + noise.to(torch.int32)) & -65536).view(torch.float32).to(torch.bfloat16)


def hash32(key: torch.Tensor) -> torch.Tensor:
    """A counter-based hash: int64 keys -> uniform 32-bit values (int64), computed where they are used.

    Why not torch.randint: a CPU generator draws about 30 M numbers a second on one thread, minutes for
    a 7B step on the host (trainer.offload); these integer ops fuse into the compiled update. Two
    xorshift-multiply rounds (Wellons' lowbias32, with multipliers under 2**31 so that no int64
    product overflows)."""
    x = (key ^ (key >> 32)) & M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & M32
    x = ((x ^ (x >> 15)) * 0x6B43A9B5) & M32
    return x ^ (x >> 16)


def _update_chunk(p, g, m, v, hyper, base) -> None:
    """AdamW on one chunk, in place, in fp32, then each of the three stored stochastically: the weight
    on the low 16 bits of one hash of (base + element index), the first moment on its high 16, the
    second on another hash's. `hyper`: [beta1, beta2, eps, lr x weight decay, step size, bias
    correction of the second moment] (fp32, on the chunk's device: values, not constants to compile
    in). Compiled, one kernel: a read of the four, a write of three."""
    beta1, beta2, eps, decay, step_size, bias2 = hyper.unbind()
    g32 = g.float()
    m32 = m.float() * beta1 + g32 * (1 - beta1)
    v32 = v.float() * beta2 + g32 * g32 * (1 - beta2)
    p32 = p.float()
    p32 = p32 - p32 * decay - step_size * m32 / ((v32 / bias2).sqrt() + eps)
    key = torch.arange(p.numel(), device=p.device) + base
    first, second = hash32(key), hash32(key ^ 0x5BD1E995)
    for exact, stored, noise in ((p32, p, first & 0xFFFF), (m32, m, first >> 16), (v32, v, second & 0xFFFF)):
        stored.copy_(round_stochastic(exact, noise))


_COMPILED: list = []


def _compiles_on(device: torch.device) -> bool:
    """Whether Inductor can build for `device`: a GPU's kernels need Triton, a host's a C++ compiler."""
    return device.type == "cuda" or any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++"))


def _kernel(compiled: bool):
    """_update_chunk, eager or through torch.compile (one graph for every chunk length, step and tensor:
    they are sizes and tensor values, not constants)."""
    if not compiled:
        return _update_chunk
    if not _COMPILED:
        _COMPILED.append(torch.compile(_update_chunk, dynamic=True))
    return _COMPILED[0]


class StochasticAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments) on bf16 parameters
    and bf16 moments, computed in fp32 and rounded stochastically (module docstring).

    The noise is a hash of (step, the tensor's index, the element's): a step repeated (an exact resume)
    rounds alike, and no random stream (sampling, dropout) is drawn from.

    `compiled`: the update through torch.compile, for GPU trainers (their host too, trainer.offload).
    Eager, its 25 passes over fp32 temporaries took 10 % of a 1.5B step on an H200, and a CPU (tests)
    would spend longer compiling than updating."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 compiled: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.compiled = compiled
        self._hyper: dict = {}

    @torch.no_grad()  # grad mode is part of what a compiled graph guards on: as step()
    def warm(self) -> None:
        """Compile the update before the first step (trainer.prewarm), on throwaway copies of one
        parameter of each kind: its device, its number of dims and whether it takes several chunks.
        The graph guards on the views' bases (a 1-D bias, a 2-D weight and a weight cut into chunks
        each compiled apart on CPU, checked), so a tiny stand-in would leave the first step compiling.
        Nothing of the optimizer or the parameters changes."""
        if not self.compiled:
            return
        kinds = set()
        for group in self.param_groups:
            for param in group["params"]:
                local = _local(param).detach()
                kind = (local.device, local.dim(), local.numel() > CHUNK[True])
                if kind in kinds or not _compiles_on(local.device):
                    continue
                kinds.add(kind)
                _update(*(local.clone() for _ in range(4)), 1, 0, self.hyper(group, 1, local.device), True)
        self._hyper = {}

    @torch.no_grad()
    def step(self, closure=None):
        self._hyper = {}
        for group in self.param_groups:
            for i, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:  # the same keys as torch's AdamW: checkpoints look alike
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                tensors = [_local(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])]
                step = int(state["step"])
                _update(*tensors, step, i, self.hyper(group, step, tensors[0].device), self.compiled)

    def hyper(self, group: dict, step: int, device: torch.device) -> torch.Tensor:
        """_update_chunk's `hyper` for `group` at `step` on `device`, made once per step (each is a copy
        to the device)."""
        key = (id(group), step, device)
        if key not in self._hyper:
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            self._hyper[key] = torch.tensor([beta1, beta2, group["eps"], lr * group["weight_decay"],
                                             lr / (1 - beta1**step), 1 - beta2**step], device=device)
        return self._hyper[key]


def _update(param, grad, exp_avg, exp_avg_sq, step: int, index: int, hyper: torch.Tensor, compiled: bool) -> None:
    """One AdamW update of the `index`-th (local) tensor, a chunk at a time (eager: fp32 temporaries of
    a chunk only). Hash keys: the step in bits 44-62, the tensor in 32-43, the element below."""
    device = param.device
    # Detached (no requires_grad to guard on: warm's tensors match); FSDP2's shards are contiguous.
    flat = [t.detach().view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
    compiled = compiled and _compiles_on(device)
    kernel, chunk = _kernel(compiled), CHUNK[compiled]
    for start in range(0, flat[0].numel(), chunk):
        base = torch.tensor(((step % 2**19) << 44) + ((index % 4096) << 32) + start, device=device)
        kernel(*(t[start : start + chunk] for t in flat), hyper, base)
