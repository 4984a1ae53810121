"""Trainer rank 0's side of the weight broadcast (prl.run.broadcast has the whole handshake).

Each exported version stays in host memory until the orchestrator asks for it (want/V) or a newer
one is asked for; at most `slots` versions are held (async_level + 2 covers a run that keeps up: the
orchestrator generates batch n with version n - async_level while the trainer exports n + 1), and
when a version must go unsent its go/V says 0, so nobody waits for it. The broadcast runs in a thread
of its own on its own process group: training does not wait for the servers, only the other way.

The store listens on a port the system picks, on MASTER_ADDR's address alone, recorded for the run's
other processes (Access.publish). What the receivers need to know (world, backend, bucket size, the
tensors) is signed with the run's key, and so are the names of have/V and go/V, which a Keeper puts
back within a tick when they are deleted (prl.run.broadcast_store): go/V stays until the version is
sent, so a deleted answer delays the orchestrator by that tick and never strands the version in
flight. A want/V only the orchestrator can name. The group's members prove the key to each other
once it is formed, and every version ends with its tag (prl.run.broadcast): the tensors are hashed in
threads from host memory while the buckets go out.
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
import traceback

import torch
from loguru import logger

from prl.run import broadcast as bc, broadcast_store as bs
from prl.trainer.staging import HostStaging

POLL_S = 0.005
"""How often the thread looks for a want/V: the servers' update waits at most this long for it."""
WANT_WAIT = datetime.timedelta(days=1)
"""How long a held version's waiter waits for its want/V (it ends sooner: dropped or sent, it is woken)."""
CONTROL_TIMEOUT_S = 30.0
"""How long the trainer waits for one of its requests on the store's shared connection (the offers,
the answers); each takes well under a millisecond. Past it the store counts as failed: the broadcast
ends and the run goes on with files, so a store that stops answering holds training up once, this
long (a TCPStore request itself waits for its answer without a limit: _on_store). The group's
rendezvous has a connection of its own, with the group's timeout."""
STUCK_S = 30.0
"""A thread that has not looked for a want/V this long, outside a broadcast, is stuck: the next export
logs where (the orchestrator stops waiting for answers after 60 s, prl.orchestrator.broadcast_coordinator)."""


class Sender:
    def __init__(self, access: bc.Access, host: str, world: int, backend: str, device: torch.device, slots: int,
                 timeout_s: float, bucket_bytes: int = bc.BUCKET_BYTES, last_version: int | None = None):
        self.last_version = last_version
        self.raw_store = bs.store(host, 0, host_it=True, timeout_s=CONTROL_TIMEOUT_S)
        self.store = bs.scoped(self.raw_store, access.key)
        self.key, self.nonce = access.key, bc.new_nonce()
        self.keeper = bs.Keeper(self.store, "trainer")
        self.keeper.put(bc.PLAN, bs.signed(self.key, bc.PLAN, {"world": world, "backend": backend,
                                                                "bucket_bytes": bucket_bytes, "nonce": self.nonce}))
        self.answered: list[tuple[int, str]] = []
        """(version, go) answers the keeper keeps: until a later version is sent, the orchestrator may wait."""
        self.bucket_bytes = bucket_bytes
        self.pool = bc.hash_pool()
        self.world, self.backend, self.device, self.timeout_s = world, backend, device, timeout_s
        self.slots = [HostStaging() for _ in range(slots)]
        self.held: dict[int, tuple[HostStaging, dict[str, torch.Tensor]]] = {}
        self.wanted: set[int] = set()
        """Held versions whose want/V a waiter was told of (_await_want)."""
        self.waiters: list[threading.Thread] = []
        self.address = (host, self.raw_store.port)
        self.sending: int | None = None
        self.lock = threading.Lock()
        self.group = None
        self.manifest_set = False
        self.failed: BaseException | None = None
        """Set once a broadcast or the store failed: no version is offered after it."""
        self.store_failed = False
        """The store itself failed or stopped answering (_on_store): no request is made after it."""
        self.stop = threading.Event()
        self.looked = time.monotonic()
        """When the thread last looked for a want/V (or finished a broadcast)."""
        self.reported_stuck = False
        self.thread = threading.Thread(target=self._serve, name="weights-broadcast", daemon=True)
        self.thread.start()
        access.publish(host, self.raw_store.port)
        logger.info(f"weight broadcast: store at {host}:{self.raw_store.port}, {world - 1} inference workers, {backend}")

    def offers(self, version: int) -> bool:
        """Whether `version` is offered at all: not one the orchestrator never asks for (past the
        run's last_policy_version). Held, such a version took a pinned buffer of its own that was
        allocated on the spot: at 7B 7.7 s of each of a run's last two exports (h200x2-2026-11-28)."""
        return self.last_version is None or version <= self.last_version

    def staging(self) -> HostStaging:
        """A host buffer no held version uses, for the next export to gather into."""
        with self.lock:
            while True:
                used = {id(slot) for slot, _ in self.held.values()}
                if free := [slot for slot in self.slots if id(slot) not in used]:
                    return free[0]
                self._drop(min(v for v in self.held if v != self.sending), unsent=True)

    def spare(self) -> HostStaging | None:
        """A slot no held version uses whose buffer is allocated already, or None; nothing is dropped.
        Where a version that is not offered gathers: at 7B a buffer pinned on the spot took 7.5 s of the
        first such export (the 2 + 2 run of h200x4-2026-11-28). The writer reads it until its next
        wait(), and no later version is offered, so nothing else takes it meanwhile."""
        with self.lock:
            used = {id(slot) for slot, _ in self.held.values()}
            return next((slot for slot in self.slots if id(slot) not in used and slot.buffer is not None), None)

    def stage(self, version: int, slot: HostStaging, state: dict[str, torch.Tensor]) -> None:
        """Offer `version` (rank 0's full state, in `slot` on GPU) to the orchestrator."""
        if self.failed is not None:
            return
        self._report_stuck()
        if not self.manifest_set:
            if not self._on_store(f"offering version {version}", self.keeper.put, bc.MANIFEST,
                                  bs.signed(self.key, bc.MANIFEST, bc.manifest_of(state))):
                return
            self.manifest_set = True
        with self.lock:
            self.held[version] = (slot, state)
        waiter = threading.Thread(target=self._await_want, args=(version,), name=f"weights-want-{version}", daemon=True)
        waiter.start()
        self.waiters = [w for w in self.waiters if w.is_alive()] + [waiter]
        self._on_store(f"offering version {version}", self.keeper.put, self._name(bc.HAVE, version), "1")

    def close(self) -> None:
        """Stop serving; the group and the store go in this thread. Left to interpreter exit while the
        thread still polls, their C++ threads abort the process ("terminate called without an active
        exception")."""
        self.stop.set()
        self.thread.join(timeout=1 if self.store_failed else 10)  # the store failed: it may wait on it for ever
        with self.lock:
            for version in list(self.held):
                self._release(version)
        for waiter in self.waiters:  # woken by _release (unless the store failed); their connections go first
            waiter.join(timeout=0 if self.store_failed else 5)
        self.keeper.close(wait_s=1 if self.store_failed else 5)
        if self.thread.is_alive():  # stuck in a broadcast nobody joined: exit regardless
            logger.warning("weight broadcast thread still busy at exit")
            return
        self.pool.shutdown(wait=True)
        self.group = None
        self.store = self.raw_store = None

    def _report_stuck(self) -> None:
        """Once: where the thread is when it has not looked for a want/V for STUCK_S outside a broadcast,
        with the keeper's stack (they share the store's connection)."""
        stalled = time.monotonic() - self.looked
        if self.reported_stuck or self.sending is not None or stalled < STUCK_S or not self.thread.is_alive():
            return
        self.reported_stuck = True
        logger.error(f"weight broadcast: the thread has not looked for a want/V in {stalled:.0f}s (stuck; the "
                     f"orchestrator takes files after 60s):\n{self._stacks()}")

    def _stacks(self) -> str:
        """The stacks of the threads that share the store's connection: the broadcast thread, the keeper,
        and requests still waiting (_on_store)."""
        frames = sys._current_frames()
        threads = [self.thread, self.keeper.thread, *(t for t in threading.enumerate() if t.name == "weights-store-request")]
        return "\n".join(f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}"
                         for t in threads if t.ident in frames)

    def _drop(self, version: int, unsent: bool) -> None:
        """Forget `version` (lock held); a version dropped unsent tells a waiting orchestrator so."""
        del self.held[version]
        self._release(version)
        if unsent:
            self._answer(version, "0")

    def _release(self, version: int) -> None:
        """`version` is no longer offered (lock held): its have/V goes, and its waiter is woken by
        this process setting the want/V it waits for (nobody else reads that key)."""
        self.wanted.discard(version)
        if self._on_store(f"releasing version {version}", self.keeper.drop, self._name(bc.HAVE, version), True):
            self._on_store(f"releasing version {version}", self.store.set, self._name(bc.WANT, version), "1")

    def _on_store(self, what: str, request, *args) -> bool:
        """request(*args) on the store, True when it answered. A TCPStore request waits for its answer
        without a time limit, so it runs in a thread of its own, waited for CONTROL_TIMEOUT_S: a store
        that fails or does not answer ends the broadcast (logged once, with where the threads that share
        its connection are) and never holds training up longer; a request left waiting is abandoned."""
        if self.store_failed:
            return False
        done, errors = threading.Event(), []

        def run() -> None:
            try:
                request(*args)
            except Exception as e:  # DistStoreError / DistNetworkError, or the store already closed
                errors.append(e)
            finally:
                done.set()

        threading.Thread(target=run, name="weights-store-request", daemon=True).start()
        if not done.wait(CONTROL_TIMEOUT_S):
            errors.append(TimeoutError(f"no answer in {CONTROL_TIMEOUT_S:.0f}s; where the threads that share its "
                                       f"connection are:\n{self._stacks()}"))
        if errors and not self.store_failed:
            logger.error(f"weight broadcast: the store failed while {what} ({errors[0]}); files only from now on")
            self.store_failed = True
            self.failed = self.failed or errors[0]
        return not errors

    def _await_want(self, version: int) -> None:
        """Until want/V is set, on a connection of its own: the store tells a waiter the moment a key is
        set, however soon a stranger deletes it after (issue 53), where a look every POLL_S can miss it."""
        try:
            waiter = bs.scoped(bs.store(*self.address, host_it=False, timeout_s=self.timeout_s), self.key)
            waiter.wait([self._name(bc.WANT, version)], WANT_WAIT)
        except Exception:  # the store is gone (the trainer is exiting); the look every POLL_S remains
            return
        with self.lock:
            if version in self.held:
                self.wanted.add(version)

    def _name(self, kind: str, version: int, value: str = "1") -> str:
        return bs.control(self.key, self.nonce, kind, version, value)

    def _answer(self, version: int, go: str) -> bool:
        """go/V (lock held), kept until a later version is sent (the orchestrator asks in order); False when
        the store failed."""
        if not self._on_store(f"answering for version {version}", self.keeper.put, self._name(bc.GO, version, go), "1"):
            return False
        self.answered.append((version, go))
        return True

    def _sent(self, version: int) -> None:
        """`version` reached the workers (lock held): the answers up to it are moot."""
        for old, go in [a for a in self.answered if a[0] <= version]:
            self.keeper.drop(self._name(bc.GO, old, go), delete=False)
            self.answered.remove((old, go))

    def _wanted(self) -> int | None:
        """The newest held version the orchestrator asked for; older held ones are dropped."""
        with self.lock:
            versions = sorted(self.held, reverse=True)
        for version in versions:
            if version in self.wanted or self.store.check([self._name(bc.WANT, version)]):  # only the orchestrator names it
                with self.lock:
                    for older in [v for v in self.held if v < version]:
                        self._drop(older, unsent=True)
                    self.sending = version
                return version
        return None

    def _serve(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # Not the default stream: there the copies would queue behind the training step's kernels.
            torch.cuda.set_stream(torch.cuda.Stream(self.device))
        while not self.stop.is_set():
            self.looked = time.monotonic()
            try:
                version = self._wanted()
            except Exception as e:  # the store failed: nobody can be told anything through it
                if not self.store_failed:
                    logger.error(f"weight broadcast: the store failed ({e}), files only from now on")
                    self.store_failed = True
                    self.failed = self.failed or e
                return
            if version is None:
                time.sleep(POLL_S)
                continue
            try:
                self._send(version)
            except Exception as e:  # the group is unusable now: the orchestrator goes back to files
                if self.failed is None:
                    logger.error(f"weight broadcast of version {version} failed, files only from now on: {e}")
                    self.failed = e
                with self.lock:
                    self._answer(version, "0")
                return
            finally:
                with self.lock:
                    if self.held.pop(version, None) is not None:
                        self._release(version)
                    self.sending = None
                self.looked = time.monotonic()

    def _send(self, version: int) -> None:
        start = time.perf_counter()
        with self.lock:
            if not self._answer(version, "1"):
                raise self.failed  # logged already: nobody would join the group
        device = self.device if self.backend == "nccl" else torch.device("cpu")
        if self.group is None:  # every worker joins on its first update: formed once
            # On a connection of its own: the workers join over up to timeout_s, longer than a control request may take.
            rendezvous = bs.scoped(bs.store(*self.address, host_it=False, timeout_s=self.timeout_s), self.key)
            self.group = bc.new_group(rendezvous, 0, self.world, self.backend, self.timeout_s)
            bc.authenticate(self.group, self.key, self.nonce, 0, self.world, device)
        _, state = self.held[version]
        entries, total = bc.layout(bc.manifest_of(state))
        hashes = bc.Hashes(self.pool)
        for entry in entries:  # host memory, not written again until the version is dropped
            hashes.add(state[entry.name])
        spans = bc.buckets(entries, self.bucket_bytes)
        buffer = torch.empty(max(end - start for start, end, _ in spans), dtype=torch.uint8, device=device)
        for first, end, members in spans:
            chunk = buffer[: end - first]
            for name, view in bc.views(chunk, members, first):
                view.copy_(state[name], non_blocking=True)
            bc.broadcast(self.group, chunk)
        hashed = time.perf_counter()
        tag = bc.version_tag(self.key, version, hashes.digests())
        hashed = time.perf_counter() - hashed  # what the tag added: hashing left after the buckets went
        bc.broadcast(self.group, torch.frombuffer(bytearray(tag), dtype=torch.uint8).to(device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        logger.info(f"version {version} broadcast: {total / 2**20:.1f} MiB in {seconds:.2f}s "
                    f"(of which {hashed:.2f}s waiting for its tag's hashes)")
        with self.lock:
            self._sent(version)
