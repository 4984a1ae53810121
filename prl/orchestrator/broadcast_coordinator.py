"""The orchestrator's side of the weight broadcast (prl.run.broadcast has the whole handshake).

For each version it needs, the orchestrator takes whichever comes first: the trainer saying it holds
the version (have/V), then the broadcast; or the version's file. Anything that goes wrong (no store
yet, the trainer gone, a version dropped unsent, a failed broadcast) means the file, and a failed
broadcast means files for the rest of the attempt. The store's address is what trainer rank 0
recorded in the attempt's directory once its store listened (prl.run.broadcast.Access).

The control keys' names are signed with the run's key and the store's nonce
(prl.run.broadcast_store.control): a key nobody signed is never looked at. This process keeps its
want/V in place while it waits (set again, and logged as tampering, when deleted), and it is told of
the trainer's go/V by the store the moment that is set (a wait on a connection of its own), so a
go/V deleted as it appears is still seen; the trainer puts back a deleted one within a tick. None
of it stops the broadcast for later versions; a want/V left unanswered for ANSWER_TIMEOUT_S does.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from pathlib import Path

import torch.distributed as dist
from loguru import logger

from prl.run import broadcast as bc, broadcast_store as bs
from prl.run.rundir import is_complete

POLL_S = 0.02
CONNECT_EVERY_S = 1.0
WAIT_S = 0.2
"""One wait for go/V with value 1, between looks at want/V (still there?) and at go/V with value 0."""
ANSWER_TIMEOUT_S = 60.0
"""How long the trainer may take to answer a want/V (it polls every 5 ms; longer: its thread is stuck, and
the broadcast is off for the rest of the attempt)."""


class Coordinator:
    def __init__(self, access: bc.Access | None):
        self.access = access
        self.store = None
        self.waiter = None
        self.nonce = ""
        self.broken = access is None
        self._last_try = 0.0

    async def offer(self, version: int, weights_dir: Path) -> bool:
        """True once the trainer broadcasts `version` (the servers must now receive it); False when
        the file is the way: the trainer does not hold the version but its file is complete, or the
        broadcast is off or failed. A held version goes by broadcast even if its file is complete."""
        while not self.broken:
            # The file first, then the store: the trainer stages a version before it writes the file,
            # so a file seen complete means a held version is in the store by now. The other order
            # lost the race when this process was descheduled between its two looks (a loaded CI
            # machine): no have/V, then the file complete, and a held version went by file.
            complete = is_complete(weights_dir)
            if (store := await self._connect()) is not None:
                try:
                    if store.check([self._name(bc.HAVE, version)]):
                        return await self._claim(store, version)
                except Exception as e:  # the trainer (which hosts the store) is gone or restarting
                    logger.warning(f"weight broadcast store unreachable ({e}); version {version} by file")
                    self.store = None
            if complete:
                return False
            await asyncio.sleep(POLL_S)
        return False

    def failed(self, error: BaseException) -> None:
        logger.error(f"weight broadcast failed, files only from now on: {error}")
        self.broken = True

    def _name(self, kind: str, version: int, value: str = "1") -> str:
        return bs.control(self.access.key, self.nonce, kind, version, value)

    async def _claim(self, store, version: int) -> bool:
        """want/V, then the trainer's answer: go/V with value 1 to broadcast, 0 dropped unsent."""
        want, go, dropped = (self._name(bc.WANT, version), self._name(bc.GO, version, "1"),
                             self._name(bc.GO, version, "0"))
        deadline, placed, logged = time.monotonic() + ANSWER_TIMEOUT_S, False, False
        while time.monotonic() < deadline:
            if not store.check([want]):
                if placed and not logged:
                    logged = True
                    logger.warning(f"weight broadcast: tampering: want/{version} was deleted from the store by "
                                   "a process that is not the run's; set again")
                store.set(want, "1")
                placed = True
            if await asyncio.to_thread(self._told, go):
                return True
            if store.check([dropped]):
                return False
        # The trainer answers within milliseconds unless its thread is stuck, and then it stays stuck: every
        # later version would wait as long again.
        self.failed(TimeoutError(f"no answer to want/{version} in {ANSWER_TIMEOUT_S:.0f}s (the trainer's "
                                 "broadcast thread is stuck: its log shows where)"))
        return False

    def _told(self, name: str) -> bool:
        """Whether `name` is set within WAIT_S, on the waiting connection: the store answers the wait
        when the key is set, however soon it is deleted after."""
        try:
            self.waiter.wait([name], datetime.timedelta(seconds=WAIT_S))
            return True
        except dist.DistStoreError as e:
            if "timeout" not in str(e):
                raise
            return False

    async def _connect(self):
        if self.store is None and time.monotonic() - self._last_try >= CONNECT_EVERY_S:
            self._last_try = time.monotonic()
            if (address := self.access.address()) is None:  # the trainer hosts it once its model is loaded
                return None
            try:  # in a thread: connecting waits up to its timeout, the event loop must not
                raw = await asyncio.to_thread(bs.store, *address, host_it=False, timeout_s=2.0)
                store = bs.scoped(raw, self.access.key)
                plan = await asyncio.to_thread(bs.get_signed, store, self.access.key, bc.PLAN)
                waiter = await asyncio.to_thread(bs.store, *address, host_it=False, timeout_s=2.0)
                raw.set_timeout(datetime.timedelta(seconds=60))
                self.waiter, self.nonce, self.store = bs.scoped(waiter, self.access.key), plan["nonce"], store
            except Exception as e:  # recorded but not listening (yet, or any more), or a forged plan
                if isinstance(e, bs.Forged):
                    logger.warning(f"{e}: not acted on")
                self.store = None
        return self.store
