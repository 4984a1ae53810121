"""Policy versions for inference: `RUN/weights/step_N/` in Hugging Face format.

    model.safetensors   full (unsharded) weights in model.dtype, under the names and in the layout
                        of model.name's own checkpoint (checkpoint_layout: an MoE's experts one
                        matrix each, as vLLM loads them, not transformers' fused 3-D tensors)
    config.json, tokenizer files, ...   copied from model.name
    COMPLETE            written last; a directory without it does not exist for readers
                        (the RL loop's versions are not fsynced first: make_durable)

With adapters (trainer.lora) a version is the adapters alone, in peft's layout (what
`peft.PeftModel.from_pretrained(base, DIR)` and prl's inference server load):

    adapter_model.safetensors   every LoRA A and B matrix in model.dtype, peft's names
    adapter_config.json         rank, alpha, target modules, the base model (model.name)
    COMPLETE
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from prl.config import Config, LoraConfig
from prl.run import fence, lora
from prl.run.lora import ADAPTER_FILE, is_adapter
from prl.run.files import fsync_tree
from prl.run.rundir import RunDir, complete_steps, is_complete, mark_complete, remove_step, step_of
from prl.trainer.staging import HostStaging

if TYPE_CHECKING:
    from prl.trainer.broadcast_sender import Sender

WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf)$|.*\.(safetensors|bin)\.index\.json$")
"""Files of model.name that are weights (not copied: we write our own)."""


def weights_dir(rd: RunDir, step: int) -> Path:
    return rd.weights_dir(step)


def model_source_dir(name: str) -> Path:
    """model.name as a local directory: itself, or its (cached) snapshot on the Hugging Face hub."""
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, allow_patterns=["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]))


def _tied_names(module: nn.Module) -> set[str]:
    """Names of parameters that are another parameter (tied LM head): safetensors stores each once."""
    seen: set[int] = set()
    tied = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return tied


def _exported(model: nn.Module, prefix: str, adapter: Adapter | None) -> list[tuple[str, torch.Tensor]]:
    """(file name, tensor) of what gather_state_dict gathers, in its order."""
    tied = _tied_names(model)
    items = [(name.removeprefix(prefix), tensor) for name, tensor in model.state_dict().items() if name not in tied]
    if adapter is not None:
        items = [(adapter.file_name(name), tensor) for name, tensor in items if is_adapter(name)]
    return items


def gather_state_dict(model: nn.Module, dtype: torch.dtype, prefix: str = "causal_lm.",
                      staging: HostStaging | None = None, adapter: Adapter | None = None) -> dict[str, torch.Tensor]:
    """Full HF-named state dict on rank 0 (CPU, `dtype`); {} on other ranks. Collective: all ranks call.

    One tensor at a time: all-gathered and cast on the device (bf16 halves the bytes that cross to
    the host, and the cast runs on the GPU, not one CPU core), then copied out by rank 0. Extra
    device memory: one full tensor. The result never aliases a parameter (it is written to disk
    while training goes on); with `staging` (CUDA) it lives in that reused pinned buffer. With
    `adapter`: the adapters' matrices alone, under peft's file names.
    """
    items = _exported(model, prefix, adapter)
    rank0 = dist.get_rank() == 0
    on_gpu = bool(items) and items[0][1].is_cuda
    state = staging.views({name: t.shape for name, t in items}, dtype) if staging and rank0 and on_gpu else {}
    for name, tensor in items:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if not rank0:
            continue
        full = full.detach().to(dtype)
        if name in state:
            state[name].copy_(full, non_blocking=True)  # stream-ordered: `full` is not reused before
        else:
            state[name] = full.to("cpu", copy=True).contiguous()
    if state and on_gpu:
        torch.cuda.synchronize()  # the pinned copies are asynchronous; the writer reads them next
    return state


def checkpoint_layout(causal_lm: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank 0's gathered state under the names and in the layout of the checkpoint the model was loaded
    from, through transformers' own reverse of its loading conversions (what save_pretrained writes).

    transformers 5 fuses an MoE layer's experts on load (Qwen3-MoE: `mlp.experts.gate_up_proj`
    [E, 2I, H] from every `mlp.experts.N.gate_proj.weight` and `up_proj.weight`; Mixtral also renames
    `block_sparse_moe` to `mlp`); vLLM and the servers' name check (prl.inference.reload) go by the
    checkpoint's names. A dense model has no conversions: its state comes back as it is, no copy. An
    MoE's experts are copied once more in host memory (the reverse splits are not views)."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    if not isinstance(causal_lm, PreTrainedModel):  # a plain module (tests) has no loading conversions
        return state
    reverted = revert_weight_conversion(causal_lm, state) if state else state
    if reverted.keys() == state.keys() and all(reverted[name] is t for name, t in state.items()):
        return state  # in its own order: the broadcast's manifest and layout stay what they were
    return {name: t.contiguous() for name, t in reverted.items()}


def write_weights(state: dict[str, torch.Tensor], source: Path, rd: RunDir, step: int, durable: bool = True) -> Path:
    """Write version `step` (rank 0 only): temp dir, rename, then the COMPLETE marker (after an fsync
    of all of it where `durable`)."""
    def fill(tmp: Path) -> None:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        for item in sorted(source.iterdir()):
            if item.is_file() and not WEIGHT_FILES.match(item.name):
                # The content, not model.name's mode (0644 in a shared model directory): under the run's umask.
                shutil.copyfile(item, tmp / item.name)
        _set_config_dtype(tmp / "config.json", next(iter(state.values())).dtype)

    return _publish(rd, step, fill, durable)


def _publish(rd: RunDir, step: int, fill, durable: bool = True) -> Path:
    """weights/step_{step}: `fill(tmp)` writes a temporary directory, which is renamed, then marked
    complete; only by the run's current attempt (prl.run.fence), checked before each change."""
    final = weights_dir(rd, step)
    tmp = final.with_name(f".{final.name}.tmp")
    what = f"weights version {final.name}"
    fence.check(rd, what)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    fence.check(rd, what)
    # A resumed run recomputes versions it wrote before it stopped: the old directory goes.
    remove_step(final)
    os.rename(tmp, final)
    mark_complete(final, durable, fence=lambda: fence.check(rd, f"COMPLETE of {what}"))
    return final


@dataclass(frozen=True)
class Adapter:
    """Versions as LoRA adapters (trainer.lora) of the base model `base` (model.name)."""

    lora: LoraConfig
    base: str
    folded: bool = False
    """Write full weights with the adapters folded in (an SFT job's, which an RL config names as its
    model) instead of the adapters alone."""

    @staticmethod
    def file_name(name: str) -> str:
        """peft's saved name of an adapter parameter: `base_model.model.` first, no adapter name."""
        return "base_model.model." + name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")

    def fold(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gathered state of the adapted model (peft's in-memory names) as plain HF weights."""
        adapters = {self.file_name(name): t for name, t in state.items() if is_adapter(name)}
        base = [(name.replace(".base_layer.", "."), t) for name, t in state.items() if not is_adapter(name)]
        return dict(lora.merged_weights(base, adapters, self.lora.scale))

    def write(self, state: dict[str, torch.Tensor], directory: Path) -> None:
        import peft

        save_file(state, directory / ADAPTER_FILE, metadata={"format": "pt"})
        # The modules adapted, named in full as add_adapters names them to peft: the bare names would
        # make peft wrap an MoE's fused experts too when it loads the file (docs/moe.md).
        modules = sorted({lora.adapted_module(name)[0] for name in state})
        config = peft.LoraConfig(r=self.lora.rank, lora_alpha=self.lora.alpha, lora_dropout=self.lora.dropout,
                                 target_modules=modules, bias="none",
                                 base_model_name_or_path=self.base, task_type="CAUSAL_LM")
        config.save_pretrained(str(directory))


def adapter_of(cfg: Config, folded: bool = False) -> Adapter | None:
    """How versions are written with trainer.lora; None without adapters (full weights)."""
    return Adapter(cfg.trainer.lora, cfg.model.name, folded) if cfg.trainer.lora.enabled else None


def write_adapter(state: dict[str, torch.Tensor], adapter: Adapter, rd: RunDir, step: int, durable: bool = True) -> Path:
    """Write adapter version `step` (rank 0 only), as write_weights does a full one."""
    return _publish(rd, step, lambda tmp: adapter.write(state, tmp), durable)


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    """config.json says what the safetensors hold (readers with dtype="auto" go by it)."""
    if not path.exists():
        return
    config = json.loads(path.read_text())
    keys = [key for key in ("dtype", "torch_dtype") if key in config] or ["torch_dtype"]  # 5.x / 4.x names
    config |= {key: str(dtype).removeprefix("torch.") for key in keys}
    path.write_text(json.dumps(config, indent=2) + "\n")


def prune_weights(rd: RunDir, newest: int, keep: int) -> None:
    """Keep versions (newest - keep, newest] and (C - keep, C] for every complete checkpoint C.

    The orchestrator generates batch n with exactly version n - async_level (keep: prl.run.batch.weights_kept),
    and a run resumed from C (the newest after a requeue, any kept one with `prl resume --step`)
    regenerates batches C, C+1, ... with versions from C - async_level on: those were written before
    C and cannot be recomputed, so they live as long as C does. Versions above `newest` are left
    over from an attempt that got further before it was cut short.
    """
    windows = [newest] + [min(c, newest) for c in complete_steps(rd.checkpoints)]
    fence.check(rd, "pruning weights")
    for path in rd.weights.glob("step_*"):
        step = step_of(path)
        if step is not None and not any(top - keep < step <= top for top in windows):
            remove_step(path)


class BackgroundWriter:
    """Rank 0's file writes in one background thread, one at a time and in order.

    The disk write of version N+1 then overlaps step N+1's compute; readers still see a version only
    once its COMPLETE marker exists. `wait()` re-raises a failed write; call it before exiting.
    """

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights")
        self._pending: Future | None = None
        self.staging = HostStaging()  # reused only after wait(): the pending write reads it
        self.last_s: float | None = None
        """Seconds the write that the newest wait() found took, hand-off to return (a version: to its
        COMPLETE). Set by wait() in the caller's thread, never by the write's own: which write it times
        then follows the caller's order, not how fast the disk was."""

    def submit(self, fn, *args) -> None:
        self.wait()
        self._pending = self._pool.submit(self._timed, fn, *args)

    @staticmethod
    def _timed(fn, *args) -> float:
        start = time.perf_counter()
        fn(*args)
        return time.perf_counter() - start

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.last_s = pending.result()


def make_durable(rd: RunDir, newest: int, keep: int) -> None:
    """fsync the complete versions in (newest - keep, newest]: those a run resumed from checkpoint
    `newest` loads (prune_weights' window), before that checkpoint exists (rank 0, no write pending).

    The RL loop publishes each version without an fsync (save_weights' durable=False): the servers read
    it from the page cache or the file server. The next batch waits for that COMPLETE (2.4 s after the
    step's end at 1.5B on a 4 x H200 node), and the fsync of 3.1 GB was half of a publication on a
    2-core VM (benchmarks/reports/publish-fsync_cpu2_2026-11-27.md). A node that crashes can then leave a
    COMPLETE version whose data never reached the disk. No run reads one: a launch rewinds the run directory to its newest complete checkpoint C,
    removing every version after C (prl.run.rewind.rewind_plan), and those up to C that it keeps were made durable
    here, before C's own COMPLETE. On a version already written back (the kernel does within about 30 s)
    the fsync costs next to nothing."""
    for path in rd.weights.glob("step_*"):
        step = step_of(path)
        if step is not None and newest - keep < step <= newest and is_complete(path):
            fsync_tree(path)


def _write_and_prune(state: dict, source: Path, rd: RunDir, step: int, keep: int, adapter: Adapter | None,
                     durable: bool = True) -> None:
    if adapter is not None and not adapter.folded:
        write_adapter(state, adapter, rd, step, durable)
    else:
        write_weights(state, source, rd, step, durable)
    prune_weights(rd, step, keep)


def pin_staging_ahead(model: nn.Module, dtype: torch.dtype, writer: BackgroundWriter, sender: Sender | None,
                      adapter: Adapter | None, version: int) -> None:
    """Rank 0 on a GPU: pin the host buffer that save_weights of `version`, the first, gathers into now,
    in the background (HostStaging.pin_ahead), while the trainer waits for its first batch."""
    if dist.get_rank() != 0:
        return
    items = _exported(model, "causal_lm.", None if adapter is None or adapter.folded else adapter)
    if not items or not items[0][1].is_cuda:
        return
    offered = sender is not None and sender.offers(version)
    staging = sender.staging() if offered else writer.staging  # as save_weights picks it
    staging.pin_ahead({name: tensor.shape for name, tensor in items}, dtype)


def save_weights(model: nn.Module, dtype: torch.dtype, source: Path, rd: RunDir, step: int, keep: int,
                 writer: BackgroundWriter | None = None, sender: Sender | None = None,
                 adapter: Adapter | None = None, durable: bool = True) -> None:
    """Gather on all ranks; rank 0 writes `weights/step_{step}` (with `adapter`: the adapters alone)
    and prunes old versions (in `writer`'s thread if given, else before returning), and offers the
    version to `sender`'s broadcast (prl.trainer.broadcast_sender) if given. durable=False: no fsync
    before its COMPLETE (make_durable, before a checkpoint)."""
    if writer is not None:
        writer.wait()  # the previous version is on disk and its staging buffer free
    staging = writer.staging if writer is not None else None
    to_sender = sender is not None and dist.get_rank() == 0
    offer = to_sender and sender.offers(step)
    if offer:
        staging = sender.staging()  # the sender keeps versions until they are asked for
    elif to_sender:
        staging = sender.spare() or staging  # a buffer pinned already, not one to pin now
    state = gather_state_dict(model, dtype, staging=staging, adapter=None if adapter is None or adapter.folded else adapter)
    if adapter is not None and adapter.folded and state:
        state = adapter.fold(state)
    if adapter is None or adapter.folded:
        state = checkpoint_layout(getattr(model, "causal_lm", model), state)
    if offer:
        sender.stage(step, staging, state)
    if dist.get_rank() == 0:
        if writer is not None:
            writer.submit(_write_and_prune, state, source, rd, step, keep, adapter, durable)
        else:
            _write_and_prune(state, source, rd, step, keep, adapter, durable)
    # Nobody moves on (e.g. to exit) while rank 0 is still writing synchronously.
    if writer is None:
        dist.barrier()
