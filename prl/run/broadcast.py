"""Policy weights by broadcast, trainer rank 0 -> every vLLM worker (`inference.weight_transfer: broadcast`).

NCCL when trainer and inference both run on GPUs, gloo otherwise. The files are written as always
(a resumed run regenerates batches from them, and they are the fallback); what the broadcast saves
is the servers' wait for the file and their read of it, which on a shared filesystem at scale is
most of a weight update.

One TCPStore, hosted by trainer rank 0 on a port it picks when it starts (recorded in
logs/attempt_N/weights_store, which only the run's owner can read) and listening on MASTER_ADDR's
address alone (loopback in local mode; prl.run.broadcast_store), carries the handshake:

    trainer rank 0 (trainer/broadcast_sender.py)  stages each version in host memory, then sets have/V;
        on want/V it sets go/V=1 and broadcasts V; a version it drops unsent gets go/V=0
    orchestrator (orchestrator/broadcast_coordinator.py)  waits for have/V, sets want/V and waits for
        go/V; 1: POST /update_weights {"version": V} to every server; 0, no store, or any failure: the file
    every vLLM worker (inference/worker.py)  joins the group once (its rank from add("rank")) and
        receives V bucket by bucket into vLLM's reload_weights

The group is formed once per job attempt (the first broadcast) and never re-formed: after a failure
the run goes on with files. Both ends lay a version out the same way (`layout`): one contiguous
byte buffer in state-dict order, cut into buckets of about BUCKET_BYTES.

Only the run's own processes take part (issue: a cluster's other users reach every node's ports). The
store takes any client and lists its keys to it, so nothing rests on the store being private:
- every key of the run lies under a prefix derived from the run's secret (prl.run.secret): other runs
  and accidents stay out; a stranger who lists the keys still finds them;
- what the store says about the transfer (world size, backend, bucket size, the tensors) is signed
  with the secret and checked by every receiver before use (`Forged` if not); so are the control keys
  (have/V, want/V, go/V, bound to the store's nonce), which their writers keep in place: a key deleted
  or forged is logged as tampering and put back within a tick (prl.run.broadcast_store);
- once the group is formed, every rank proves the secret to every other over the group's own
  connections (`authenticate`): a stranger who took a rank, or a rank's place in the rendezvous,
  cannot, and the group is given up before any weights travel;
- every version ends with a tag, the secret's HMAC over the version number and the SHA-256 of each of
  its tensors, which each receiver checks before the version goes live; on a mismatch the worker loads
  the version's file instead and says so (inference/worker.py).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import math
import os
import secrets
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from prl.run import protocol, secret
from prl.run.attempt import Attempt
from prl.run.broadcast_store import Forged, claim_rank, get_signed, mac, scoped, store
from prl.run.files import write_atomic

BUCKET_BYTES = 256 << 20
"""Bytes per broadcast: large enough to run the link at full speed, small enough to be spare memory on
each end (the receiving worker holds a bucket until vLLM has loaded its layers)."""
ALIGN = 64
"""Each tensor starts at a multiple of this many bytes (any dtype can view it)."""
TIMEOUT_S = 600.0
"""How long a broadcast (and the group's first forming) may take before it counts as failed."""
PLAN, MANIFEST, RANK = "plan", "manifest", "rank"
GROUP_PREFIX = "prl_weights"
TAG_BYTES = 32
HASH_THREADS = min(16, os.cpu_count() or 1)
"""Threads that hash a version's tensors (hashlib releases the GIL). Measured on an H100 host: 2.9 GB
in 0.40 s on 16 threads, 0.45 s on 8 (benchmarks/reports/weight-broadcast-vllm-dp-1.5b_h100x2_2026-11-27.md), when
each tensor was one piece: the 1.5B model's 467 MB embedding on one thread was most of it."""
HASH_PIECE_BYTES = 32 << 20
"""Tensors are hashed in pieces of this size, each a task of its own: one large tensor, or the bucket
a receiving worker must hash before it reuses its host slot, spreads over every thread (on 4 x H200 a
worker's reload took 1.4-1.7 s by broadcast against 0.6-0.8 s by file while each bucket hashed on one
thread: benchmarks/reports/loop-1p1-2p1-3p1-1.5b_h200x4_2026-11-27.md).
benchmarks/reports/broadcast-hashing_cpu2_2026-11-27.md compares the two."""
HOST_SLOTS = 2
"""Pinned host buffers a receiving worker copies buckets into for hashing: a bucket's copy and hash
overlap vLLM's load of it and the next bucket's transfer; a slot is reused once its hash is done."""


HAVE, WANT, GO = "have", "want", "go"
"""The control keys' kinds (prl.run.broadcast_store.control names them): trainer holds V, orchestrator
wants V, trainer sends V (value 1) or dropped it unsent (value 0)."""


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


@dataclass(frozen=True)
class Access:
    """What a process of the run needs to reach the broadcast: the run's key and where trainer rank 0
    records its store's address."""

    key: bytes
    record: Path
    """logs/attempt_N/weights_store: `HOST:PORT`, written once the store listens."""

    @classmethod
    def of(cls, attempt: Attempt) -> Access:
        """The run's access for one attempt (its secret read from the run directory)."""
        return cls(run_key(secret.read(attempt.run_dir)), attempt.marker(protocol.WEIGHTS_STORE))

    def address(self) -> tuple[str, int] | None:
        """(host, port) of the store, None while trainer rank 0 has not recorded it."""
        try:
            host, port = self.record.read_text().strip().rsplit(":", 1)
        except (OSError, ValueError):
            return None
        return host, int(port)

    def publish(self, host: str, port: int) -> None:
        write_atomic(self.record, f"{host}:{port}\n")


def run_key(run_secret: str) -> bytes:
    """The broadcast's key: derived from the run's secret, so that it never equals a server's API key."""
    return hmac.new(run_secret.encode(), b"prl weight broadcast", hashlib.sha256).digest()


def proof(key: bytes, nonce: str, rank: int) -> bytes:
    return mac(key, b"member", nonce.encode(), str(rank).encode())


def authenticate(group: dist.ProcessGroup, key: bytes, nonce: str, rank: int, world: int,
                 device: torch.device) -> None:
    """Every rank shows every other one its proof of the run's secret for this group (`nonce`: made
    fresh by the trainer for each store). Forged names the ranks that could not: a stranger in the
    group, or one that took a rank's place in the rendezvous, learns nothing it can reuse."""
    mine = torch.frombuffer(bytearray(proof(key, nonce, rank)), dtype=torch.uint8).to(device)
    shown = [torch.empty(TAG_BYTES, dtype=torch.uint8, device=device) for _ in range(world)]
    group.allgather([shown], [mine]).wait()
    bad = [r for r, t in enumerate(shown) if not hmac.compare_digest(bytes(t.cpu().tolist()), proof(key, nonce, r))]
    if bad:
        raise Forged(f"weight broadcast: rank(s) {bad} of {world} did not prove the run's secret "
                     "(a process that is not the run's joined the group)")


def pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A host tensor's bytes in HASH_PIECE_BYTES pieces (one, possibly empty, for a small tensor)."""
    flat = tensor.reshape(-1).view(torch.uint8)
    return [flat[i : i + HASH_PIECE_BYTES] for i in range(0, flat.numel(), HASH_PIECE_BYTES)] or [flat]


def piece_digest(piece: torch.Tensor, ready=None) -> bytes:
    if ready is not None:  # the CUDA event after which the host copy holding `piece` is complete
        ready.synchronize()
    return hashlib.sha256(piece.numpy()).digest()


def combine(nbytes: int, digests: list[bytes]) -> bytes:
    """A tensor's digest: SHA-256 over its length and its pieces' digests, in order."""
    h = hashlib.sha256(nbytes.to_bytes(8, "little"))
    for digest in digests:
        h.update(digest)
    return h.digest()


def version_tag(key: bytes, version: int, digests: list[bytes]) -> bytes:
    return mac(key, b"version", str(version).encode(), *digests)


class Hashes:
    """The tensors' digests of one version, computed piece by piece in threads while the transfer goes on."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool = pool
        self.tensors: list[tuple[int, list[Future]]] = []  # (bytes, its pieces' digests) per tensor, in order

    def add(self, tensor: torch.Tensor) -> Done:
        """`tensor` on the host, not written to again before `digests` returns."""
        return self._add([tensor])

    def add_bucket(self, host: torch.Tensor, members: list[Entry], start: int, ready=None) -> Done:
        """The digests of `members`, from `host`: a host copy of the bucket that begins at byte `start`
        of the layout, complete once the CUDA event `ready` (if any) has passed."""
        return self._add([t for _, t in views(host, members, start)], ready)

    def _add(self, tensors: list[torch.Tensor], ready=None) -> Done:
        futures = []
        for tensor in tensors:
            parts = [self.pool.submit(piece_digest, piece, ready) for piece in pieces(tensor)]
            self.tensors.append((tensor.numel() * tensor.element_size(), parts))
            futures += parts
        return Done(futures)

    def digests(self) -> list[bytes]:
        return [combine(nbytes, [f.result() for f in parts]) for nbytes, parts in self.tensors]


@dataclass(frozen=True)
class Done:
    """What `Hashes.add*` queued: `result()` returns once all of it is hashed (the buffer may be reused)."""

    futures: list[Future]

    def result(self) -> None:
        for future in self.futures:
            future.result()


def hash_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="weights-hash")


@dataclass
class Receiver:
    """A worker's place in the group, once joined."""

    group: dist.ProcessGroup
    plan: list[tuple[int, int, list[Entry]]]
    backend: str
    key: bytes
    device: torch.device
    pool: ThreadPoolExecutor
    slots: list = field(default_factory=list)
    """[pinned host buffer, the future hashing what it holds] x HOST_SLOTS, made on the first receive."""
    stream: object = None

    def receive(self, hashes: Hashes) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of one broadcast version, bucket by bucket as they arrive; each bucket's
        bytes go to `hashes`. A fresh buffer per bucket: vLLM's layerwise reload keeps the tensors
        until each of its layers is whole."""
        for index, (start, end, members) in enumerate(self.plan):
            buffer = torch.empty(end - start, dtype=torch.uint8, device=self.device)
            broadcast(self.group, buffer)
            if self.device.type == "cuda":
                host, ready = self._copy_out(buffer, index)
                self.slots[index % HOST_SLOTS][1] = hashes.add_bucket(host, members, start, ready)
            else:
                hashes.add_bucket(buffer.clone(), members, start)
            yield from views(buffer, members, start)

    def _copy_out(self, buffer: torch.Tensor, index: int):
        """(pinned host copy of `buffer`, CUDA event when it is complete), on a stream of its own: the
        copy runs beside vLLM's load of the same bucket."""
        if not self.slots:
            size = max(end - start for start, end, _ in self.plan)
            self.slots = [[torch.empty(size, dtype=torch.uint8, pin_memory=True), None] for _ in range(HOST_SLOTS)]
            self.stream = torch.cuda.Stream(self.device)
        slot = self.slots[index % HOST_SLOTS]
        if slot[1] is not None:
            slot[1].result()  # the bucket it held is hashed
        host = slot[0][: buffer.numel()]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(buffer, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        buffer.record_stream(self.stream)  # not reused by the allocator before the copy is done
        return host, ready

    def verify(self, version: int, hashes: Hashes) -> bool:
        """Whether the tag the trainer sends after the last bucket matches what arrived as `version`."""
        return self.matches(version, hashes, self.read_tag())

    def read_tag(self) -> bytes:
        tag = torch.empty(TAG_BYTES, dtype=torch.uint8, device=self.device)
        broadcast(self.group, tag)
        return bytes(tag.cpu().tolist())

    def matches(self, version: int, hashes: Hashes, tag: bytes) -> bool:
        return hmac.compare_digest(tag, version_tag(self.key, version, hashes.digests()))


def join(access: Access, device: torch.device, timeout_s: float = TIMEOUT_S) -> Receiver:
    """Connect to trainer rank 0's store, take the next rank, form the group with everyone else and
    prove membership. The plan is the sender's: its layout, its bucket size, signed."""
    if (address := access.address()) is None:
        raise RuntimeError(f"weight broadcast: {access.record} is missing: the trainer hosts no store (yet)")
    store_ = scoped(store(*address, host_it=False, timeout_s=timeout_s), access.key)
    setup = get_signed(store_, access.key, PLAN)
    rank, world = store_.add(RANK, 1), setup["world"]
    if rank >= world:
        raise Forged(f"weight broadcast: rank {rank} handed out, the run has {world - 1} workers "
                     "(a process that is not the run's took a rank)")
    claim_rank(store_, rank)
    if setup["backend"] != "nccl":
        device = torch.device("cpu")
    group = new_group(store_, rank, world, setup["backend"], timeout_s)
    authenticate(group, access.key, setup["nonce"], rank, world, device)
    entries, _ = layout(get_signed(store_, access.key, MANIFEST))
    return Receiver(group, buckets(entries, setup["bucket_bytes"]), setup["backend"], access.key, device,
                    hash_pool())


def manifest_of(state: dict[str, torch.Tensor]) -> list[tuple[str, list[int], str]]:
    return [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state.items()]


def host_address(environ=os.environ) -> str:
    """The address others reach trainer rank 0 at: the job's MASTER_ADDR (loopback in local mode)."""
    return environ.get("MASTER_ADDR", "127.0.0.1")


def new_nonce() -> str:
    return secrets.token_hex(16)


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
