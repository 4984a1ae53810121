"""Deadlines and the progress watchdog of a component (trainer rank, orchestrator): no silent hangs.

    watchdog = Watchdog.start(cfg.watchdog, "trainer", rank, dump_to=rank_log)
    watchdog.expect("rendezvous", cfg.watchdog.ready_timeout_s)   # a readiness deadline
    ...
    watchdog.progress("batch 3")   # one unit of work done; next deadline: the stall window

A thread checks the deadline every second. When it passes, the component has stalled: every thread's
Python stack goes to the rank log, `$PRL_LOG_DIR/stalled` gets one line (component, rank, what it
waited for, for how long), and the process exits 16 (protocol.EXIT_STALLED); the supervisor ends or
requeues the job on that file. The other ranks of the component see the file and dump their own
stacks before they exit too, so every rank's stack is in the logs, not only the first to notice.

The thread needs the GIL: a hang inside a C call that holds it (rare: collectives and sleeps release
it) stops the thread too. faulthandler's C-level timer is the backstop for that case: it dumps the
stacks a minute after the deadline and exits 1 (it cannot write the `stalled` file).
"""

from __future__ import annotations

import faulthandler
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from loguru import logger

from prl.config import WatchdogConfig
from prl.run.attempt import Attempt
from prl.run.protocol import EXIT_STALLED, STALLED

POLL_S = 1.0
"""How often the thread looks at the deadline and for another rank's `stalled` file."""
PEER_GRACE_S = 3.0
"""Between writing `stalled` and exiting: the component's other ranks see the file and dump their
stacks before this exit makes torchrun tear them down."""
BACKSTOP_MARGIN_S = 60.0
"""faulthandler's C-level dump comes this long after the deadline: only if the thread could not act."""


class Watchdog:
    def __init__(self, component: str, rank: int, stall_s: float, stall_factor: float,
                 log_dir: Path | None = None, dump_to: Path | None = None):
        self.component, self.rank = component, rank
        self.stall_s, self.stall_factor = stall_s, stall_factor
        self.stalled_file = Path(log_dir) / STALLED if log_dir else None
        self.dump_file = open(dump_to, "a") if dump_to else sys.stderr  # faulthandler writes to its fd
        self.what, self.since, self.deadline = "start", time.monotonic(), math.inf
        self.durations: list[float] = []
        self._last_progress: float | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, cfg: WatchdogConfig, component: str, rank: int = 0, dump_to: Path | None = None) -> Watchdog:
        """A running watchdog for this process (stall_minutes is converted to seconds here)."""
        attempt = Attempt.current()
        watchdog = cls(component, rank, cfg.stall_minutes * 60, cfg.stall_factor, attempt.dir if attempt else None, dump_to)
        watchdog._thread = threading.Thread(target=watchdog._run, name="prl-watchdog", daemon=True)
        watchdog._thread.start()
        return watchdog

    def window(self) -> float:
        """No progress for this long is a stall: max(stall_minutes, stall_factor x median step); inf if disabled."""
        if self.stall_s <= 0:
            return math.inf
        median = statistics.median(self.durations) if self.durations else 0.0
        return max(self.stall_s, self.stall_factor * median)

    def expect(self, what: str, within_s: float) -> None:
        """From now, `what` must happen within `within_s` seconds (inf: no deadline)."""
        self.what, self.since, self.deadline = what, time.monotonic(), time.monotonic() + within_s
        if self._thread is None:
            return
        faulthandler.cancel_dump_traceback_later()
        if math.isfinite(within_s):
            faulthandler.dump_traceback_later(within_s + BACKSTOP_MARGIN_S, file=self.dump_file, exit=True)

    def progress(self, what_next: str) -> None:
        """One unit of work done; `what_next` is expected within the stall window. Durations between
        progress calls feed the median (the first unit, with its start-up and warm-up, does not)."""
        now = time.monotonic()
        if self._last_progress is not None:
            self.durations.append(now - self._last_progress)
        self._last_progress = now
        self.expect(what_next, self.window())

    def stop(self) -> None:
        """No more deadlines (the work is done)."""
        self.expect("nothing", math.inf)

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            if time.monotonic() > self.deadline:
                self.stall(f"{self.what}: nothing for {time.monotonic() - self.since:.0f}s "
                           f"(limit {self.deadline - self.since:.0f}s)")
            peer = self._peer_stalled()
            if peer:
                self.stall(f"another {self.component} rank stalled ({peer}); this rank was at: {self.what}", write=False)

    def _peer_stalled(self) -> str | None:
        """The `stalled` line if another rank of this component wrote it."""
        try:
            line = self.stalled_file.read_text().strip() if self.stalled_file else ""
        except OSError:
            return None
        return line if line.split(" ", 1)[0] == self.component else None

    def stall(self, reason: str, write: bool = True) -> None:
        """Dump every thread's stack, write `stalled` (unless a peer did), exit EXIT_STALLED."""
        line = f"{self.component} rank {self.rank}: {reason}"
        logger.error(f"stalled: {line}; stacks of every thread follow")
        self.dump_file.flush()
        faulthandler.dump_traceback(file=self.dump_file, all_threads=True)
        self.dump_file.flush()
        if write and self.stalled_file is not None:
            write_once(self.stalled_file, line + "\n")
            time.sleep(PEER_GRACE_S)
        os._exit(EXIT_STALLED)


def write_once(path: Path, text: str) -> bool:
    """Create `path` with `text` unless it exists (the first rank to stall names the cause); a
    hard link is atomic on shared filesystems, where O_EXCL is not everywhere."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
