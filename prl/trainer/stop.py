"""Stop requests for a trainer rank: SIGUSR1/SIGTERM, or the file `$PRL_LOG_DIR/stop_requested`.

Imports nothing heavy: jobs/trainer.py installs the handlers before it imports torch (seconds), because
torchrun starts the ranks with USR1 and TERM ignored (the batch script and local mode start it so,
so that torchrun itself neither dies of USR1 nor kills the ranks 30 s after a TERM); a signal that
arrives while a rank still inherits SIG_IGN is lost. The file, written by the batch script or local
supervisor on USR1/TERM, covers even that window: it is looked at wherever the flag is.
"""

from __future__ import annotations

import signal
from pathlib import Path

from prl.run.attempt import Attempt
from prl.run.protocol import STOP_REQUEST

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_received: list[str] = []


def _handle(signum, frame) -> None:
    # Only record it: the handler may run in the middle of a collective or a file write.
    _received.append(signal.Signals(signum).name)


def install() -> None:
    """From now on USR1/TERM request a checkpoint instead of killing (or being ignored by) the rank."""
    for sig in SIGNALS:
        signal.signal(sig, _handle)


def ignore() -> None:
    """Once the last checkpoint is complete: nothing is left to save, and no late signal may turn a
    finished rank into a failed one. CPython resets Python-level handlers to SIG_DFL while the
    interpreter shuts down (USR1's default action kills); SIG_IGN is left in place."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class StopFlag:
    """Whether this rank was asked to stop (signal or file); the trainer acts on it at a step boundary."""

    def __init__(self, log_dir: str | None = None):
        install()  # idempotent: jobs/trainer.py has usually done it already
        attempt = Attempt.current() if log_dir is None else Attempt(Path(log_dir))
        self.file = attempt.marker(STOP_REQUEST) if attempt is not None else None

    @property
    def requested(self) -> bool:
        return bool(_received) or (self.file is not None and self.file.exists())

    def reason(self) -> str:
        if _received:
            return f"signal {_received[0]}"
        return f"{self.file}" if self.requested else "none"
