"""Policy versions for inference: `RUN/weights/step_N/` in Hugging Face format.

    model.safetensors   full (unsharded) weights in model.dtype, HF parameter names
    config.json, tokenizer files, ...   copied from model.name
    COMPLETE            written last; a directory without it does not exist for readers
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from prl.trainer.ckpt import newest_complete

WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf)$|.*\.(safetensors|bin)\.index\.json$")
"""Files of model.name that are weights (not copied: we write our own)."""
MARKER = "COMPLETE"


def weights_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "weights" / f"step_{step}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).exists()


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


def gather_state_dict(model: nn.Module, dtype: torch.dtype, prefix: str = "causal_lm.") -> dict[str, torch.Tensor]:
    """Full HF-named state dict on rank 0 (CPU, `dtype`); {} on other ranks. Collective: all ranks call."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    tied = _tied_names(model)
    return {
        name.removeprefix(prefix): tensor.to(dtype).contiguous()
        for name, tensor in state.items()
        if name not in tied
    }


def write_weights(state: dict[str, torch.Tensor], source: Path, run_dir: Path, step: int) -> Path:
    """Write version `step` (rank 0 only): temp dir, rename, then the COMPLETE marker."""
    final = weights_dir(run_dir, step)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    for item in sorted(source.iterdir()):
        if item.is_file() and not WEIGHT_FILES.match(item.name):
            shutil.copy2(item, tmp / item.name)
    _set_config_dtype(tmp / "config.json", next(iter(state.values())).dtype)
    # A resumed run recomputes versions it wrote before it stopped: the old directory goes.
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    (final / MARKER).touch()
    return final


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    """config.json says what the safetensors hold (readers with dtype="auto" go by it)."""
    if not path.exists():
        return
    config = json.loads(path.read_text())
    keys = [key for key in ("dtype", "torch_dtype") if key in config] or ["torch_dtype"]  # 5.x / 4.x names
    config |= {key: str(dtype).removeprefix("torch.") for key in keys}
    path.write_text(json.dumps(config, indent=2) + "\n")


def prune_weights(run_dir: Path, newest: int, keep: int) -> None:
    """Keep versions (newest - keep, newest] and (C - keep, C] for the newest complete checkpoint C.

    The orchestrator generates batch n with exactly version n - async_level (keep = async_level + 1),
    and a run resumed from C regenerates batches C, C+1, ... with versions from C - async_level on:
    those were written before C and cannot be recomputed, so they stay until a newer checkpoint
    completes. Versions above `newest` are left over from an attempt that got further before it was
    cut short.
    """
    checkpoint = newest_complete(run_dir)
    windows = [newest] if checkpoint is None else [newest, min(checkpoint, newest)]
    for path in (Path(run_dir) / "weights").glob("step_*"):
        step = int(path.name.removeprefix("step_"))
        if not any(top - keep < step <= top for top in windows):
            shutil.rmtree(path, ignore_errors=True)


def save_weights(model: nn.Module, dtype: torch.dtype, source: Path, run_dir: Path, step: int, keep: int) -> None:
    """Gather on all ranks; rank 0 writes `weights/step_{step}` and prunes old versions."""
    state = gather_state_dict(model, dtype)
    if dist.get_rank() == 0:
        write_weights(state, source, run_dir, step)
        prune_weights(run_dir, step, keep)
    # Nobody moves on (e.g. to exit) while rank 0 is still writing.
    dist.barrier()
