"""The orchestrator's side of the weight broadcast (prl.run.broadcast has the whole handshake).

For each version it needs, the orchestrator takes whichever comes first: the trainer saying it holds
the version (have/V), then the broadcast; or the version's file. Anything that goes wrong (no store
yet, the trainer gone, a version dropped unsent, a failed broadcast) means the file, and a failed
broadcast means files for the rest of the attempt. The store's address is what trainer rank 0
recorded in the attempt's directory once its store listened (prl.run.broadcast.Access).
"""

from __future__ import annotations

import asyncio
import datetime
import time
from pathlib import Path

from loguru import logger

from prl.run import broadcast as bc
from prl.run.rundir import is_complete

POLL_S = 0.02
CONNECT_EVERY_S = 1.0


class Coordinator:
    def __init__(self, access: bc.Access | None):
        self.access = access
        self.store = None
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
                    if store.check([bc.have_key(version)]):
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

    async def _claim(self, store, version: int) -> bool:
        store.set(bc.want_key(version), "1")
        # The trainer answers within its poll interval: go (1) or dropped unsent (0).
        go = await asyncio.to_thread(store.get, bc.go_key(version))
        return go == b"1"

    async def _connect(self):
        if self.store is None and time.monotonic() - self._last_try >= CONNECT_EVERY_S:
            self._last_try = time.monotonic()
            if (address := self.access.address()) is None:  # the trainer hosts it once its model is loaded
                return None
            try:  # in a thread: connecting waits up to its timeout, the event loop must not
                raw = await asyncio.to_thread(bc.store, *address, host_it=False, timeout_s=2.0)
                # Connecting gives up fast; the answer to a want may wait behind the trainer's poll.
                raw.set_timeout(datetime.timedelta(seconds=60))
                self.store = bc.scoped(raw, self.access.key)
            except Exception:  # recorded but not listening (yet, or any more)
                self.store = None
        return self.store
