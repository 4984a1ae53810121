"""AdamW for bf16 master weights (trainer.master_dtype: bfloat16): each update computed in fp32 and
rounded stochastically back to bf16, so that updates far below bf16's resolution still move the
weights on average; and AdamW whose moments live in host memory (trainer.offload_optimizer), streamed
through the GPU a chunk at a time while it updates, for fp32 or bf16 master weights.

    optimizer = StochasticAdamW(params, lr=1e-6, weight_decay=0.0)   # torch.optim.AdamW's arguments
    optimizer = StochasticAdamW(params, lr=1e-6, state_on_host=True)  # moments in page-locked host memory

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
    """AdamW on one chunk, in place, in fp32, then each of the three stored: as is in fp32, else
    rounded stochastically, the weight on the low 16 bits of one hash of (base + element index), the
    first moment on its high 16, the second on another hash's. `hyper`: [beta1, beta2, eps, lr x
    weight decay, step size, bias correction of the second moment] (fp32, on the chunk's device:
    values, not constants to compile in). Compiled, one kernel: a read of the four, a write of three."""
    beta1, beta2, eps, decay, step_size, bias2 = hyper.unbind()
    g32 = g.float()
    m32 = m.float() * beta1 + g32 * (1 - beta1)
    v32 = v.float() * beta2 + g32 * g32 * (1 - beta2)
    p32 = p.float()
    p32 = p32 - p32 * decay - step_size * m32 / ((v32 / bias2).sqrt() + eps)
    key = torch.arange(p.numel(), device=p.device) + base
    first, second = hash32(key), hash32(key ^ 0x5BD1E995)
    for exact, stored, noise in ((p32, p, first & 0xFFFF), (m32, m, first >> 16), (v32, v, second & 0xFFFF)):
        stored.copy_(exact if stored.dtype == torch.float32 else round_stochastic(exact, noise))


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
    """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments) computed in fp32,
    on parameters and moments of one dtype: bf16 ones rounded stochastically (module docstring), fp32
    ones stored as computed.

    The noise is a hash of (step, the tensor's index, the element's): a step repeated (an exact resume)
    rounds alike, and no random stream (sampling, dropout) is drawn from.

    `compiled`: the update through torch.compile, for GPU trainers (their host too, trainer.offload).
    Eager, its 25 passes over fp32 temporaries took 10 % of a 1.5B step on an H200, and a CPU (tests)
    would spend longer compiling than updating.

    `state_on_host` (trainer.offload_optimizer): the two moments in host memory (make_arena), page-locked
    beside a GPU (8 bytes a parameter with fp32 weights, 4 with bf16, off the GPU), updated where the
    parameters are through _Streamer's buffers, a chunk at a time. An FSDP2 parameter's moments are
    DTensors around the host shards, as its own would be: DCP checkpoints hold them as they hold torch's
    AdamW's."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 compiled: bool = False, state_on_host: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.compiled = compiled
        self.state_on_host = state_on_host
        self._hyper: dict = {}
        self._streamer: _Streamer | None = None
        self._arena: dict | None = None

    @torch.no_grad()  # grad mode is part of what a compiled graph guards on: as step()
    def warm(self) -> None:
        """Compile the update before the first step (trainer.prewarm), on throwaway copies of one
        parameter of each kind: its device, its number of dims and whether it takes several chunks.
        The graph guards on the views' bases (a 1-D bias, a 2-D weight and a weight cut into chunks
        each compiled apart on CPU, checked), so a tiny stand-in would leave the first step compiling.
        With the moments on the host, through the streamer's buffers, as step() does. Nothing of the
        optimizer or the parameters changes. With state_on_host the host arena is made here too
        (page-locking a 14B's 59 GB takes seconds, better spent while the servers start)."""
        if self.state_on_host:
            self._host_arena()
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
                moments = [local.to("cpu", copy=True) if self.state_on_host else local.clone() for _ in range(2)]
                _update(local.clone(), local.clone(), *moments, 1, 0, self.hyper(group, 1, local.device), True,
                        self._streamer_for(local) if self.state_on_host else None)
        if self._streamer is not None:
            self._streamer.finish()
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
                    state["exp_avg"] = self._zeros(param, "exp_avg")
                    state["exp_avg_sq"] = self._zeros(param, "exp_avg_sq")
                state["step"] += 1
                tensors = [_local(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])]
                step = int(state["step"])
                _update(*tensors, step, i, self.hyper(group, step, tensors[0].device), self.compiled,
                        self._streamer_for(tensors[0]) if self.state_on_host else None)
        if self._streamer is not None:
            self._streamer.finish()  # a checkpoint, or the next step's copies, read what this one stored

    def hyper(self, group: dict, step: int, device: torch.device) -> torch.Tensor:
        """_update_chunk's `hyper` for `group` at `step` on `device`, made once per step (each is a copy
        to the device)."""
        key = (id(group), step, device)
        if key not in self._hyper:
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            self._hyper[key] = to_device([beta1, beta2, group["eps"], lr * group["weight_decay"],
                                          lr / (1 - beta1**step), 1 - beta2**step], torch.float32, device)
        return self._hyper[key]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, which puts every state on its parameter's device, then the moments copied into their
        host places (state_on_host). So a resume holds the moments on the GPU for a moment (torch's
        per-state cast is a static method of Optimizer, not one a subclass can replace): at 14B with
        bf16 weights 59 GB beside the 30 GB of weights, before any gradient exists."""
        super().load_state_dict(state_dict)
        if not self.state_on_host:
            return
        for param, state in self.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:  # (DCP may have read the checkpoint into the arena itself: then no copy)
                    loaded, state[key] = _local(state[key]), self._place(param, key)
                    if _local(state[key]).data_ptr() != loaded.data_ptr():
                        _local(state[key]).copy_(loaded)

    def _zeros(self, param: torch.Tensor, key: str) -> torch.Tensor:
        """A fresh moment `key` of `param`: on its device, or zeroed in its place on the host."""
        if not self.state_on_host:
            return torch.zeros_like(param)
        moment = self._place(param, key)
        _local(moment).zero_()
        return moment

    def _place(self, param: torch.Tensor, key: str) -> torch.Tensor:
        """The host arena's view for moment `key` of `param` (the arena made at the first call), wrapped
        as `param` is (an FSDP2 DTensor: its spec, mesh, placements and global shape)."""
        local = self._host_arena()[param][key]
        if not hasattr(param, "to_local"):
            return local
        from torch.distributed.tensor import DTensor

        # Built as FSDP2 builds its offloaded shards: DTensor.from_local would copy a host tensor to the
        # mesh's device (a GPU's), which is where the moments must not be.
        return DTensor(local, param._spec, requires_grad=False)

    def _host_arena(self) -> dict:
        """make_arena of every parameter, made at the first call."""
        if self._arena is None:
            self._arena = make_arena([p for group in self.param_groups for p in group["params"]])
        return self._arena

    def _streamer_for(self, local: torch.Tensor) -> _Streamer:
        """The streamer of `local`'s device, made once: its buffers fit the largest local parameter's
        chunk (a 7B's embedding shard: CHUNK elements)."""
        if self._streamer is None:
            largest = max(_local(p).numel() for group in self.param_groups for p in group["params"])
            compiled = self.compiled and _compiles_on(local.device)
            self._streamer = _Streamer(local.device, min(largest, CHUNK[compiled]))
        return self._streamer


def make_arena(params: list[torch.Tensor]) -> dict:
    """Host memory for both moments of every parameter (this rank's shards): one zeroed tensor per
    dtype, page-locked where the parameters live on a GPU (cudaHostRegister: copies to and from it do
    not block; torch's pinned allocator would round each tensor up to a power of two, 1.8x for a 14B's
    MLP weights); {param: {"exp_avg": view, "exp_avg_sq": view}} of the parameters' local shapes."""
    sizes: dict[torch.dtype, int] = {}
    for param in params:
        sizes[param.dtype] = sizes.get(param.dtype, 0) + 2 * _local(param).numel()
    flat = {dtype: torch.zeros(n, dtype=dtype) for dtype, n in sizes.items()}
    if any(_local(p).device.type == "cuda" for p in params):
        for tensor in flat.values():
            nbytes = tensor.numel() * tensor.element_size()
            error = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
            if int(error) != 0:
                raise RuntimeError(f"trainer.offload_optimizer: could not page-lock {nbytes / 2**30:.1f} GiB of host "
                                   f"memory for AdamW's moments (cudaHostRegister: error {int(error)})")
    arena, offset = {}, dict.fromkeys(sizes, 0)
    for param in params:
        local = _local(param)
        views = {}
        for key in ("exp_avg", "exp_avg_sq"):
            start = offset[param.dtype]
            views[key] = flat[param.dtype][start : start + local.numel()].view(local.shape)
            offset[param.dtype] = start + local.numel()
        arena[param] = views
    return arena


class _Streamer:
    """Moments kept in host memory, through the parameters' device for their update (StochasticAdamW's
    state_on_host): SLOTS buffers of [2, chunk] on the device, each chunk's moments copied in on one
    CUDA stream, updated on the current one, copied back on a third, so that the copy in of chunk k + 1
    and the copy out of chunk k - 1 (both PCIe directions) run while chunk k updates. Events order a
    slot's reuse after its copy out; finish() waits for the last. On a CPU the same copies, run in order
    (tests run this path)."""

    SLOTS = 2

    def __init__(self, device: torch.device, chunk: int):
        self.device, self.chunk, self.count = device, chunk, 0
        self.buffers: dict[torch.dtype, list[torch.Tensor]] = {}
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.copy_in, self.copy_out = torch.cuda.Stream(device), torch.cuda.Stream(device)
            self.loaded, self.updated, self.stored = ([torch.cuda.Event() for _ in range(self.SLOTS)]
                                                      for _ in range(3))

    def update(self, kernel, param, grad, exp_avg, exp_avg_sq, hyper, base) -> None:
        """kernel(param, grad, m, v, hyper, base) on device copies m, v of the host chunks `exp_avg`,
        `exp_avg_sq`, whose values it then stores back."""
        slot = self.count % self.SLOTS
        self.count += 1
        if exp_avg.dtype not in self.buffers:
            self.buffers[exp_avg.dtype] = [torch.empty(2, self.chunk, dtype=exp_avg.dtype, device=self.device)
                                          for _ in range(self.SLOTS)]
        buffer = self.buffers[exp_avg.dtype][slot]
        m, v = buffer[0, : param.numel()], buffer[1, : param.numel()]
        if not self.cuda:
            m.copy_(exp_avg)
            v.copy_(exp_avg_sq)
            kernel(param, grad, m, v, hyper, base)
            exp_avg.copy_(m)
            exp_avg_sq.copy_(v)
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_in):
            self.copy_in.wait_event(self.stored[slot])  # the slot's previous chunk is back on the host
            m.copy_(exp_avg, non_blocking=True)
            v.copy_(exp_avg_sq, non_blocking=True)
            self.loaded[slot].record(self.copy_in)
        compute.wait_event(self.loaded[slot])
        kernel(param, grad, m, v, hyper, base)
        self.updated[slot].record(compute)
        with torch.cuda.stream(self.copy_out):
            self.copy_out.wait_event(self.updated[slot])
            exp_avg.copy_(m, non_blocking=True)
            exp_avg_sq.copy_(v, non_blocking=True)
            self.stored[slot].record(self.copy_out)

    def finish(self) -> None:
        """Wait, on the host, for every copy out so far: the moments on the host are this step's."""
        if self.cuda:
            self.copy_out.synchronize()


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, copied there without waiting. A plain torch.tensor(..., device=gpu)
    synchronizes the stream: the host would wait for the backward's last kernel before each tensor's update
    and then launch the 339 updates of a 1.5B one by one onto an idle GPU: 64 ms of the GPU's step against
    27 ms with this (fused fp32 AdamW: 17), benchmarks/reports/trainer-head-width-timeline-1.5b-7b_h200_2026-12-04.md.
    From page-locked memory the copy is queued like a kernel (torch's host allocator keeps the buffer until
    it is done)."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def _update(param, grad, exp_avg, exp_avg_sq, step: int, index: int, hyper: torch.Tensor, compiled: bool,
            streamer: _Streamer | None = None) -> None:
    """One AdamW update of the `index`-th (local) tensor, a chunk at a time (eager: fp32 temporaries of
    a chunk only), with the moments through `streamer` when they live on the host. Hash keys: the step
    in bits 44-62, the tensor in 32-43, the element below."""
    device = param.device
    # Detached (no requires_grad to guard on: warm's tensors match); FSDP2's shards are contiguous.
    flat = [t.detach().view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
    compiled = compiled and _compiles_on(device)
    kernel, chunk = _kernel(compiled), CHUNK[compiled]
    starts = range(0, flat[0].numel(), chunk)
    bases = to_device([((step % 2**19) << 44) + ((index % 4096) << 32) + start for start in starts], torch.int64, device)
    for start, base in zip(starts, bases):
        views = [t[start : start + chunk] for t in flat]
        if streamer is None:
            kernel(*views, hyper, base)
        else:
            streamer.update(kernel, *views, hyper, base)
