"""Staging: a policy version read into host memory while the engine generates, so that loading it
copies from memory instead of reading the file (`POST /update_weights {"path": DIR, "stage": true}`,
reload.py).

Batch by batch, each batch waits for the update to its version: at 1.5B on an H100 that was 0.65 s a
step, read from the page cache into pageable memory and copied to the GPU from there, with the engine
paused. The trainer usually finishes the version the next batch needs while the current one is still
generating (docs/performance.md); the orchestrator then asks each server to stage it, and a worker
thread reads the files into pinned host memory (reused from version to version) beside generation.
The update that follows hands vLLM's `reload_weights` those tensors instead of a path.

Runs inside each vLLM worker (worker.py). A staged copy is used only for the path it was read from
and only if none of its files changed since; anything else (a failed read, a different version, a
file rewritten) loads from the file as before. A worker declines to stage when the node's available
memory is short: the copy costs the checkpoint's size per worker, each file rounded up to a power
of two where it is pinned (host_bytes).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

CHUNK = 64 << 20
"""Bytes per read: each read releases the GIL, so the engine's own thread runs between them."""
HEADROOM = 2
"""Stage only if the workers' copies together take at most 1/HEADROOM of the node's available memory."""
DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
          "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
          "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
"""safetensors dtype names -> torch attribute names."""


def files_of(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def signature(files: list[Path]) -> list[tuple[str, int, int]]:
    """What must not change between staging and loading: each file's name, size and mtime."""
    return [(f.name, (s := f.stat()).st_size, s.st_mtime_ns) for f in files]


def mem_available() -> int | None:
    """The node's MemAvailable in bytes (Linux); None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def why_not(size: int, workers: int, available: int | None) -> str | None:
    """Why `workers` copies of `size` bytes cannot be staged; None when they can."""
    if available is None:
        return "the node's available memory is unknown"
    if size * workers * HEADROOM > available:
        return (f"{workers} x {size / 2**30:.1f} GiB would take more than 1/{HEADROOM} of the node's "
                f"{available / 2**30:.1f} GiB available")
    return None


class Staged:
    """One version being read, or already read, into host memory by a thread of its own."""

    def __init__(self, path: str, buffers: dict[str, Any]) -> None:
        """`buffers`: file name -> host buffer from earlier versions, reused when large enough (pinned
        memory is slow to allocate); updated in place."""
        self.path = path
        self.files = files_of(Path(path))
        self.signature = signature(self.files)
        self.buffers = buffers
        self.tensors: list[tuple[str, Any]] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, name="prl-stage-weights", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for file in self.files:
                self.tensors += read_file(file, self.buffers)
        except BaseException as e:  # reported by take(); the update reads the file instead
            self.error = e

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def take(self) -> tuple[list[tuple[str, Any]] | None, str]:
        """(the tensors, "") once read, waiting for the thread if need be; (None, why) if they cannot
        be used. Either way they are handed out once."""
        self.thread.join()
        tensors, self.tensors = self.tensors, []
        if self.error is not None:
            return None, f"reading it failed ({self.error})"
        try:
            if signature(files_of(Path(self.path))) != self.signature:
                return None, "its files changed since"
        except OSError as e:
            return None, f"its files changed since ({e})"
        return tensors, ""


def read_file(file: Path, buffers: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, tensor) of every tensor in a .safetensors file, as views of one host buffer."""
    import torch

    with file.open("rb", buffering=0) as f:
        header_size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_size))
        header.pop("__metadata__", None)
        size = max((info["data_offsets"][1] for info in header.values()), default=0)
        buffer = buffers.get(file.name)
        if buffer is None or buffer.numel() < size:  # the file's size: what `fits` compares with
            buffer = torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            buffers[file.name] = buffer
        view = memoryview(buffer.numpy()).cast("B")
        done = 0
        while done < size:
            read = f.readinto(view[done : min(done + CHUNK, size)])
            if not read:
                raise OSError(f"{file}: ended after {done} of {size} data bytes")
            done += read
    return [(name, as_tensor(buffer, info)) for name, info in header.items()]


def as_tensor(buffer: Any, info: dict) -> Any:
    import torch

    start, end = info["data_offsets"]
    dtype = getattr(torch, DTYPES[info["dtype"]])
    raw = buffer[start:end]
    if start % dtype.itemsize:  # safetensors does not promise alignment: a copy is
        raw = raw.clone()
    return raw.view(dtype).reshape(info["shape"])


def workers_on_node(worker: Any, environ: dict | os._Environ = os.environ) -> int:
    """vLLM workers on this node that may stage at once: what prl's server said (every GPU of the node
    has one, each reading the whole version), else this engine's own workers (a server started by hand)."""
    from prl.run.protocol import STAGING_WORKERS_ENV

    try:
        return max(1, int(environ.get(STAGING_WORKERS_ENV) or worker.parallel_config.world_size))
    except (AttributeError, TypeError, ValueError):
        return 1


def fits(files: list[Path], buffers: dict[str, Any]) -> bool:
    """Whether `buffers` (earlier versions') can hold each file without allocating."""
    return all(f.name in buffers and buffers[f.name].numel() >= f.stat().st_size for f in files)


def host_bytes(files: list[Path], pinned: bool) -> int:
    """The host memory that buffers for `files` take: pinned ones come from PyTorch's host allocator,
    which rounds each up to a power of two by default (a 2.9 GB version grew an engine's process by
    4.0 GB on an H200, benchmarks/reports/loop-1p1-engine-cpu-bound_h200x2_2026-11-28.md)."""
    sizes = [os.stat(f).st_size for f in files]
    return sum(1 << (size - 1).bit_length() if pinned and size else size for size in sizes)
