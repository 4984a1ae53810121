"""A pinned host buffer for weight exports (prl.trainer.export writes from it, prl.trainer.broadcast_sender
sends from it)."""

from __future__ import annotations

import threading

import torch


class HostStaging:
    """One pinned host buffer, reused by every export: device-to-host copies at full speed and no
    fresh host allocation (page faults) per version. Whoever reads the previous version's tensors
    must be done with them before the next `views` (BackgroundWriter.wait)."""

    ALIGN = 64

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self._pinning: threading.Thread | None = None

    @classmethod
    def layout(cls, shapes: dict[str, torch.Size], dtype: torch.dtype) -> tuple[dict[str, int], int]:
        """Each tensor's bytes and the buffer's total (each tensor starts ALIGN-aligned)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = {name: shape.numel() * itemsize for name, shape in shapes.items()}
        return nbytes, sum(-(-n // cls.ALIGN) * cls.ALIGN for n in nbytes.values())

    def pin_ahead(self, shapes: dict[str, torch.Size], dtype: torch.dtype) -> None:
        """Allocate the buffer `views(shapes, dtype)` needs now, in a thread of its own, so that the
        first export does not: pinning runs at a few GB/s (7B in bf16: 6.4 s of the first step's
        export on an H200 host, benchmarks/reports/loop-7b-1p1-packing_h200x2_2026-11-28.md). `views` waits for it."""
        total = self.layout(shapes, dtype)[1]
        if self._pinning is None and (self.buffer is None or self.buffer.numel() < total):
            # The caller's device in the thread too: a thread starts on device 0, and pinning there would
            # make a CUDA context (hundreds of MiB) on a GPU that may be another process's.
            device = torch.cuda.current_device()
            self._pinning = threading.Thread(target=self._allocate, args=(total, device), name="pin-staging",
                                             daemon=True)
            self._pinning.start()

    def _allocate(self, total: int, device: int | None = None) -> None:
        if device is not None:
            torch.cuda.set_device(device)
        self.buffer = None  # free the old one first
        self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)

    def views(self, shapes: dict[str, torch.Size], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        if self._pinning is not None:
            self._pinning.join()
            self._pinning = None
        nbytes, total = self.layout(shapes, dtype)
        if self.buffer is None or self.buffer.numel() < total:
            self._allocate(total)
        views, offset = {}, 0
        for name, shape in shapes.items():
            views[name] = self.buffer[offset : offset + nbytes[name]].view(dtype).view(shape)
            offset += -(-nbytes[name] // self.ALIGN) * self.ALIGN
        return views
