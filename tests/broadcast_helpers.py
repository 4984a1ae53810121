"""What the weight broadcast's tests of both tiers share: a run key, and versions whose layout needs aligning."""

from __future__ import annotations

import torch

from prl.run import broadcast as bc

CPU = torch.device("cpu")
KEY = bc.run_key("a run's secret, as prl.run.secret makes one: 43 characters")


def version_state(seed: int) -> dict[str, torch.Tensor]:
    """Odd sizes and mixed dtypes: offsets that need aligning, and one tensor larger than a bucket."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 19, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(19, generator=g),
        "layers.0.mlp.weight": torch.randn(300, 41, generator=g).to(torch.bfloat16),
        "lm_head.bias": torch.randn(3, generator=g).to(torch.float16),
    }
