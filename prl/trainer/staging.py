"""A pinned host buffer for weight exports (prl.trainer.export writes from it, prl.trainer.broadcast_sender
sends from it)."""

from __future__ import annotations

import torch


class HostStaging:
    """One pinned host buffer, reused by every export: device-to-host copies at full speed and no
    fresh host allocation (page faults) per version. Whoever reads the previous version's tensors
    must be done with them before the next `views` (BackgroundWriter.wait)."""

    ALIGN = 64

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def views(self, shapes: dict[str, torch.Size], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = {name: shape.numel() * itemsize for name, shape in shapes.items()}
        total = sum(-(-n // self.ALIGN) * self.ALIGN for n in nbytes.values())
        if self.buffer is None or self.buffer.numel() < total:
            self.buffer = None  # free the old one first
            self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        views, offset = {}, 0
        for name, shape in shapes.items():
            views[name] = self.buffer[offset : offset + nbytes[name]].view(dtype).view(shape)
            offset += -(-nbytes[name] // self.ALIGN) * self.ALIGN
        return views
