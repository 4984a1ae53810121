"""Grade a final answer against the reference with math-verify (symbolic equality, not string match).

    grade("0.5", "\\frac{1}{2}")   # -> 1.0

math-verify's timeouts use signal.alarm, which works only in a process's main thread: call `grade`
from the main thread, or through `GradingPool` (a process pool; asyncio's worker threads would fail
or, with timeouts off, hang forever on a pathological expression). This module imports nothing heavy,
so pool workers start fast.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from math_verify import parse, verify


def grade(response: str, answer: str, timeout_s: int = 5) -> float:
    """1.0 if `response` (the content of \\boxed{}) equals `answer` mathematically, else 0.0."""
    if not response.strip():
        return 0.0
    try:
        gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_s)
        pred = parse(f"\\boxed{{{response}}}", parsing_timeout=timeout_s)
        return float(verify(gold, pred, timeout_seconds=timeout_s))
    except Exception:  # math-verify raises on unparsable input and on timeouts: both are wrong answers
        return 0.0


class GradingPool:
    """`await pool.grade(response, answer)` in worker processes, started on first use."""

    def __init__(self, workers: int = 2, timeout_s: int = 5):
        self.workers, self.timeout_s = workers, timeout_s
        self._executor: ProcessPoolExecutor | None = None

    async def grade(self, response: str, answer: str) -> float:
        if not response.strip():
            return 0.0
        if self._executor is None:
            # spawn, not fork: the orchestrator has threads (asyncio, httpx), and a forked child of a
            # threaded process can deadlock on a lock some other thread held at fork time.
            self._executor = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        future = asyncio.get_running_loop().run_in_executor(self._executor, grade, response, answer, self.timeout_s)
        try:
            # The in-worker timeouts bound parse and verify separately; this bounds the whole call.
            return await asyncio.wait_for(future, timeout=4 * self.timeout_s + 30)
        except asyncio.TimeoutError:
            return 0.0

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
