"""Reading a policy version ahead into host memory (prl.inference.readahead), without vLLM.

    pytest tests/unit/test_readahead.py        # a few seconds

The server side against real vLLM: tests/integration/test_inference.py::test_a_staged_version_loads_from_memory.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from prl.inference import readahead


def version(directory: Path, seed: int = 0) -> Path:
    """A version of mixed dtypes, one of odd byte size so that the next tensor starts unaligned."""
    g = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"a.flags": torch.tensor([1, 0, 1], dtype=torch.uint8),
               "b.weight": torch.randn(5, 3, generator=g).to(torch.bfloat16),
               "c.bias": torch.randn(7, generator=g)}, directory / "model-00001-of-00002.safetensors")
    save_file({"d.weight": torch.randn(4, 4, generator=g).half()}, directory / "model-00002-of-00002.safetensors")
    return directory


def expected(directory: Path) -> dict[str, torch.Tensor]:
    return {name: t for f in readahead.files_of(directory) for name, t in load_file(f).items()}


def test_a_staged_version_is_the_files_tensors_and_reuses_its_buffers(tmp_path):
    buffers: dict = {}
    first = readahead.Staged(str(version(tmp_path / "step_1", seed=1)), buffers)
    tensors, why = first.take()
    assert why == "" and sorted(name for name, _ in tensors) == ["a.flags", "b.weight", "c.bias", "d.weight"]
    reference = expected(tmp_path / "step_1")
    for name, tensor in tensors:
        assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name]), name
    assert first.take() == ([], "")  # handed out once
    kept = {name: buffer.data_ptr() for name, buffer in buffers.items()}
    assert readahead.fits(readahead.files_of(tmp_path / "step_1"), buffers)  # no more memory: not checked again
    assert not readahead.fits(readahead.files_of(tmp_path / "step_1"), {})

    second, _ = readahead.Staged(str(version(tmp_path / "step_2", seed=2)), buffers).take()
    assert {name: buffer.data_ptr() for name, buffer in buffers.items()} == kept  # the same memory, refilled
    reference = expected(tmp_path / "step_2")
    assert all(torch.equal(tensor, reference[name]) for name, tensor in second)


def test_a_copy_is_refused_when_its_files_changed_or_could_not_be_read(tmp_path):
    directory = version(tmp_path / "step_1")
    staged = readahead.Staged(str(directory), {})
    staged.thread.join()
    file = readahead.files_of(directory)[1]
    stat = file.stat()
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # rewritten since (same size)
    assert staged.take() == (None, "its files changed since")

    staged = readahead.Staged(str(directory), {})
    staged.thread.join()
    file.unlink()
    tensors, why = staged.take()
    assert tensors is None and why.startswith("its files changed since")

    short = version(tmp_path / "step_2")
    data = readahead.files_of(short)[0]
    data.write_bytes(data.read_bytes()[:-4])  # a header that promises more than the file holds
    tensors, why = readahead.Staged(str(short), {}).take()
    assert tensors is None and "reading it failed" in why and "ended after" in why


def test_staging_is_declined_when_the_node_lacks_the_memory(tmp_path):
    gib = 2**30
    assert readahead.why_not(3 * gib, 1, 64 * gib) is None
    assert "4 x 3.0 GiB would take more than 1/2 of the node's 20.0 GiB available" in readahead.why_not(3 * gib, 4, 20 * gib)
    assert readahead.why_not(3 * gib, 1, None) == "the node's available memory is unknown"  # unknown is not "enough"
    assert readahead.mem_available() > 0  # Linux's /proc/meminfo, read
    (tmp_path / "a.safetensors").write_bytes(b"x" * 3000)
    (tmp_path / "b.safetensors").write_bytes(b"x" * 4096)
    files = readahead.files_of(tmp_path)
    assert readahead.host_bytes(files, pinned=False) == 7096
    assert readahead.host_bytes(files, pinned=True) == 4096 + 4096  # the host allocator's powers of two
    engine = SimpleNamespace(parallel_config=SimpleNamespace(world_size=2))
    assert readahead.workers_on_node(engine, {"PRL_STAGING_WORKERS": "8"}) == 8  # the node's, as the server said
    assert readahead.workers_on_node(engine, {}) == 2  # a server started by hand: its engine's own


def test_the_read_releases_the_engines_thread(tmp_path):
    """The engine's loop runs beside the reading thread: reads go in chunks, outside the GIL."""
    directory = tmp_path / "big"
    directory.mkdir()
    save_file({"w": torch.zeros(48 << 20, dtype=torch.uint8)}, directory / "model.safetensors")
    staged = readahead.Staged(str(directory), {})
    ticks, start = 0, time.monotonic()
    while not staged.done:
        ticks += 1
        time.sleep(0.001)
    assert ticks >= 1 and time.monotonic() - start < 30
    tensors, why = staged.take()
    assert why == "" and tensors[0][1].shape == (48 << 20,)


def test_a_tensor_at_an_unaligned_offset_reads_back(tmp_path):
    """safetensors' own writer aligns, but the format does not promise it: a file written by another tool."""
    import json

    value = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    header = json.dumps({"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "b": {"dtype": "BF16", "shape": [2], "data_offsets": [3, 7]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes([7, 8, 9])
                                                 + value.view(torch.uint8).numpy().tobytes())
    tensors = dict(readahead.Staged(str(tmp_path), {}).take()[0])
    assert tensors["a"].tolist() == [7, 8, 9] and torch.equal(tensors["b"], value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool])
def test_every_dtype_reads_back(tmp_path, dtype):
    directory = tmp_path / str(dtype)
    directory.mkdir()
    tensor = (torch.arange(12) % 3).to(dtype).reshape(3, 4)
    save_file({"x": tensor}, directory / "model.safetensors")
    (name, read), = readahead.Staged(str(directory), {}).take()[0]
    assert read.dtype == dtype and torch.equal(read, tensor)
