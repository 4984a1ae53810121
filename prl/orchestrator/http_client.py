"""POSTs to an inference server's own JSON routes (/tokenize, /prl/generate) for the token route.

Why not the OpenAI client that Chat Completions uses: its `post` costs the orchestrator 3.9 ms of CPU
per request (request options, retries and response models around an httpx connection pool that scans
every connection per request); aiohttp costs 0.45 ms for the same request and answer (2-core VM,
benchmarks/reports/orchestrator-http-client_cpu2_2026-11-27.md).
The orchestrator is one Python thread: at 3.9 ms it could send at most ~250 requests a second,
whatever the GPUs behind it could serve.

What the OpenAI client did and this keeps: the run's key as a bearer token, a per-request timeout,
and up to `retries` more tries, with backoff, for a connection that failed and for the answers that
mean "try again" (408, 409, 429, 5xx). What it adds: the key goes only to a server that has proved
it holds it (prl.run.proof), proved again after any failed connection.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import aiohttp
import httpx

from prl.run.proof import Proofs

RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
"""Answers after which the request is sent again (the OpenAI client's own list, 5xx spelled out)."""
BACKOFF_S = 0.5
"""First pause before a retry; doubled each time."""


class ServerError(RuntimeError):
    """The server answered with an error status; `text` is its body (vLLM's message)."""

    def __init__(self, url: str, status: int, text: str):
        super().__init__(f"{url} answered {status}: {text[:500]}")
        self.status, self.text = status, text


class ServerRoutes:
    """One server's routes, over one aiohttp session per event loop (a session belongs to the loop
    it was made in; the orchestrator has one, tests start several)."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float, retries: int = 3,
                 proofs: Proofs | None = None):
        """`proofs`: the servers' proofs of `api_key`, shared with the caller's other clients (else its own)."""
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.proofs = (proofs or Proofs(api_key)) if api_key else None
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.retries = retries
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            self._sessions = {old: s for old, s in self._sessions.items() if not old.is_closed()}
            # limit=0: as many connections as requests in flight (orchestrator.max_concurrent bounds those).
            connector = aiohttp.TCPConnector(limit=0)
            session = self._sessions[loop] = aiohttp.ClientSession(
                headers=self.headers, timeout=self.timeout, connector=connector)
        return session

    async def post(self, path: str, body: dict) -> Any:
        """The route's JSON answer; ServerError for an error status (after retries where it may pass),
        aiohttp's ClientError for a connection that failed every try."""
        url = f"{self.base_url}{path}"
        for attempt in itertools.count():
            try:
                await self._proven(url)
                async with self.session().post(url, json=body) as response:
                    if response.status < 400:
                        return await response.json(content_type=None)
                    error = ServerError(url, response.status, await response.text())
            except aiohttp.ClientConnectionError:
                if self.proofs is not None:
                    self.proofs.forget(url)
                if attempt >= self.retries:
                    raise
            else:
                if attempt >= self.retries or error.status not in RETRY_STATUS:
                    raise error
            await asyncio.sleep(BACKOFF_S * 2**attempt)

    async def _proven(self, url: str) -> None:
        """Once the server has proved the key (prl.run.proof); Unproven (it answered, wrongly: not
        retried) or aiohttp's ClientConnectionError (it could not be reached, as for the request)."""
        if self.proofs is None:
            return
        try:
            await self.proofs.ensure(url)
        except httpx.TransportError as e:
            raise aiohttp.ClientConnectionError(f"{url}: {type(e).__name__}: {e}") from e

    async def close(self) -> None:
        """Close this loop's session (those of loops already closed went with them)."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()
