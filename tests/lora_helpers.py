"""What the LoRA tests of both tiers share: adapters that look trained, and the base they fit."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from prl.config import LoraConfig
from prl.run import lora
from prl.trainer.export import Adapter
from prl.trainer.model import add_adapters

LORA = LoraConfig(rank=4, alpha=8.0)


def trained_adapters(tiny_model: Path, seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny model with adapters whose B is not zero (as after some training), and those
    adapters under peft's file names."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(seed)
    add_adapters(model, LORA)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05)
    return model, {Adapter.file_name(n): t.detach().clone() for n, t in model.state_dict().items() if lora.is_adapter(n)}


def base_state(tiny_model: Path) -> dict[str, torch.Tensor]:
    return load_file(tiny_model / "model.safetensors")
