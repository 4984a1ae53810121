"""LoRA adapter versions (trainer.lora) folded into full weights: W' = W + alpha / rank * B @ A.

A policy version of an adapter run is its adapters alone (peft's file layout, prl.trainer.export).
What serves it is the base model with that version's adapters folded into the weights
(prl.inference.worker): vLLM generates at the speed of the plain model, with no LoRA kernels, and a
version moves as megabytes instead of the whole model. An SFT job's own exported weights are folded
the same way, so an RL config can name them as its model.

    dict(merged_weights(base_named_tensors, adapter_tensors, scale))   # HF names in, HF names out
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where tensors are folded: the control plane reads versions' names too
    import torch

PREFIX = "base_model.model."
"""peft's saved names start with this, then the module path of the base model (`model.layers.0...`)."""
ADAPTER_CONFIG, ADAPTER_FILE = "adapter_config.json", "adapter_model.safetensors"
"""An adapter version's files (peft's layout; prl.trainer.export writes them)."""


def is_adapter(name: str) -> bool:
    """Whether a parameter or saved name is an adapter's (a LoRA A or B matrix)."""
    return ".lora_A." in name or ".lora_B." in name


def is_adapter_version(directory: Path) -> bool:
    return (directory / ADAPTER_CONFIG).is_file()


def scale_of(directory: Path) -> float:
    """alpha / rank from a version's adapter_config.json (peft's `lora_alpha` and `r`)."""
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    if config.get("use_rslora") or config.get("use_dora"):
        raise ValueError(f"{directory}: rsLoRA and DoRA adapters are not folded by prl")
    return float(config["lora_alpha"]) / int(config["r"])


def adapted_module(file_name: str) -> tuple[str, str]:
    """("model.layers.0.self_attn.q_proj", "A") from peft's saved name
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"; ValueError for any other name."""
    path = file_name.removeprefix(PREFIX)
    for part in ("A", "B"):
        suffix = f".lora_{part}.weight"
        if file_name.startswith(PREFIX) and path.endswith(suffix):
            return path.removesuffix(suffix), part
    raise ValueError(f"{file_name}: not a LoRA matrix of peft's layout (base_model.model.<module>.lora_A.weight)")


def pairs(adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Base weight name -> (A, B) of its adapter; ValueError unless every module has both."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapters.items():
        module, part = adapted_module(name)
        found.setdefault(module, {})[part] = tensor
    if incomplete := sorted(m for m, parts in found.items() if len(parts) != 2):
        raise ValueError(f"adapters without their A or B matrix: {incomplete[:3]}")
    return {f"{module}.weight": (parts["A"], parts["B"]) for module, parts in found.items()}


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, device=None) -> torch.Tensor:
    """weight + scale * b @ a, summed in fp32 on `device` (default: the weight's) and returned there
    in the weight's dtype."""
    import torch

    if a.shape[1] != weight.shape[1] or b.shape[0] != weight.shape[0] or a.shape[0] != b.shape[1]:
        raise ValueError(f"adapter A {list(a.shape)} and B {list(b.shape)} do not fit a weight of {list(weight.shape)}")
    device = device or weight.device
    delta = b.to(device, torch.float32) @ a.to(device, torch.float32)
    return (weight.to(device).float() + scale * delta).to(weight.dtype)


def merged_weights(base: Iterable[tuple[str, torch.Tensor]], adapters: dict[str, torch.Tensor],
                   scale: float, device=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base tensor, the adapted ones with their adapters folded in (on `device`: a GPU worker's,
    where the fp32 sum of a 7B model's weights takes milliseconds, not a CPU's seconds). ValueError when an adapter
    names a weight the base does not have, found once the base is read through: a server checks
    the names first (prl.inference.reload.check_adapter), and a worker whose load fails midway loads
    its previous version again (prl.inference.worker)."""
    todo = pairs(adapters)
    for name, tensor in base:
        if name in todo:
            a, b = todo.pop(name)
            tensor = merge(tensor, a, b, scale, device)
        yield name, tensor
    if todo:
        raise ValueError(f"adapters for weights the model does not have: {sorted(todo)[:3]}")
