"""Policy weights by broadcast, trainer rank 0 -> every vLLM worker (`inference.weight_transfer: broadcast`).

NCCL when trainer and inference both run on GPUs, gloo otherwise. The files are written as always
(a resumed run regenerates batches from them, and they are the fallback); what the broadcast saves
is the servers' wait for the file and their read of it, which on a shared filesystem at scale is
most of a weight update.

One TCPStore, hosted by trainer rank 0 at $MASTER_ADDR:$PRL_WEIGHTS_PORT, carries the handshake:

    trainer rank 0 (trainer/broadcast.py)  stages each version in host memory, then sets have/V;
        on want/V it sets go/V=1 and broadcasts V; a version it drops unsent gets go/V=0
    orchestrator (orchestrator/broadcast.py)  waits for have/V, sets want/V and waits for go/V;
        1: POST /update_weights {"version": V} to every server; 0, no store, or any failure: the file
    every vLLM worker (inference/worker.py)  joins the group once (its rank from add("rank")) and
        receives V bucket by bucket into vLLM's reload_weights

The group is formed once per job attempt (the first broadcast) and never re-formed: after a failure
the run goes on with files. Both ends lay a version out the same way (`layout`): one contiguous
byte buffer in state-dict order, cut into buckets of about BUCKET_BYTES.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from prl.run import protocol

BUCKET_BYTES = 256 << 20
"""Bytes per broadcast: large enough to run the link at full speed, small enough to be spare memory on
each end (the receiving worker holds a bucket until vLLM has loaded its layers)."""
ALIGN = 64
"""Each tensor starts at a multiple of this many bytes (any dtype can view it)."""
TIMEOUT_S = 600.0
"""How long a broadcast (and the group's first forming) may take before it counts as failed."""
PORT_ENV = protocol.WEIGHTS_PORT_ENV
WORLD, RANK, MANIFEST, BACKEND, BUCKET = "world", "rank", "manifest", "backend", "bucket_bytes"
GROUP_PREFIX = "prl_weights"


def have_key(version: int) -> str:
    return f"have/{version}"


def want_key(version: int) -> str:
    return f"want/{version}"


def go_key(version: int) -> str:
    return f"go/{version}"


@dataclass(frozen=True)
class Entry:
    """One tensor's place in the version's byte buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


def layout(manifest: list[tuple[str, list[int], str]]) -> tuple[list[Entry], int]:
    """(entries, total bytes) for [(name, shape, dtype name), ...] in that order."""
    entries, offset = [], 0
    for name, shape, dtype in manifest:
        nbytes = math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        entries.append(Entry(name, tuple(shape), dtype, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def buckets(entries: list[Entry], limit: int = BUCKET_BYTES) -> list[tuple[int, int, list[Entry]]]:
    """Contiguous (start, end, entries) byte ranges of about `limit` bytes; a larger tensor goes alone."""
    out: list[tuple[int, int, list[Entry]]] = []
    for entry in entries:
        end = entry.offset + entry.nbytes
        if out and end - out[-1][0] <= limit:
            start, _, members = out[-1]
            out[-1] = (start, end, [*members, entry])
        else:
            out.append((entry.offset, end, [entry]))
    return out


def views(buffer: torch.Tensor, members: list[Entry], start: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The tensors of `members` inside `buffer` (uint8), which begins at byte `start` of the layout."""
    return [(e.name, buffer[e.offset - start : e.offset - start + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape))
            for e in members]


def receive(group: dist.ProcessGroup, plan: list[tuple[int, int, list[Entry]]], device: torch.device):
    """(name, tensor) of one broadcast version, bucket by bucket as they arrive. A fresh buffer per
    bucket: vLLM's layerwise reload keeps the tensors until each of its layers is whole."""
    for start, end, members in plan:
        buffer = torch.empty(end - start, dtype=torch.uint8, device=device)
        broadcast(group, buffer)
        yield from views(buffer, members, start)


def join(address: tuple[str, int], timeout_s: float = TIMEOUT_S) -> tuple[dist.ProcessGroup, list, str]:
    """A receiver's (group, bucket plan, backend): connect to trainer rank 0's store, take the next
    rank and form the group with everyone else. The plan is the sender's: its layout, its bucket size."""
    store_ = store(*address, host_it=False, timeout_s=timeout_s)
    rank, world, backend = store_.add(RANK, 1), int(store_.get(WORLD)), store_.get(BACKEND).decode()
    group = new_group(store_, rank, world, backend, timeout_s)
    entries, _ = layout(get_json(store_, MANIFEST))
    return group, buckets(entries, int(store_.get(BUCKET))), backend


def manifest_of(state: dict[str, torch.Tensor]) -> list[tuple[str, list[int], str]]:
    return [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state.items()]


def store(host: str, port: int, host_it: bool, timeout_s: float) -> dist.TCPStore:
    """The handshake store: trainer rank 0 hosts it, everyone else connects (waiting up to timeout_s)."""
    return dist.TCPStore(host, port, None, host_it, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def address(environ=os.environ) -> tuple[str, int] | None:
    """Where the store is, from the job's environment; None when the run does not broadcast."""
    port = environ.get(PORT_ENV)
    return (environ.get("MASTER_ADDR", "127.0.0.1"), int(port)) if port else None


def new_group(store_: dist.Store, rank: int, world: int, backend: str, timeout_s: float) -> dist.ProcessGroup:
    """A process group of its own beside whatever default group the process has (vLLM's, torchrun's)."""
    prefixed = dist.PrefixStore(GROUP_PREFIX, store_)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """In place from rank 0 (the trainer)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def put_json(store_: dist.Store, key: str, value) -> None:
    store_.set(key, json.dumps(value))


def get_json(store_: dist.Store, key: str):
    return json.loads(store_.get(key))
