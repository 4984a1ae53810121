"""The inference servers as the orchestrator sees them: verifiers clients, readiness, weight updates.

URLs come from `PRL_INFERENCE_URLS` (comma-separated `http://host:port/v1`); the server itself is
the URL without `/v1` (`/health`, prl's `/update_weights`).

The run's key goes only to a server that has proved it holds it (prl.run.proof): /health is polled
without it, a server is ready once it answers /health and proves the key, and every request that
carries the key waits for that proof, asked again after any failed connection to that server.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import time
from pathlib import Path
from typing import Any

import httpx
from loguru import logger
from openai import DEFAULT_CONNECTION_LIMITS, AsyncOpenAI, DefaultAsyncHttpxClient

from prl.config import Config
from prl.orchestrator.chat import RolloutClient
from prl.orchestrator.tokens import NO_KEY, TokenClient
from prl.run import secret
from prl.run.proof import Proofs, Unproven

OPENAI_HTTP = importlib.import_module(type(DEFAULT_CONNECTION_LIMITS).__module__.split(".")[0])
"""The HTTP library under the OpenAI client: httpx2 for openai 3 (a fork of httpx), httpx before."""
REQUEST_TIMEOUT_S = 3600.0
"""One chat completion; long generations on a busy server are legitimately slow."""
UPDATE_TIMEOUT_S = 1800.0
"""One /update_weights: the server drains running requests, then reloads from the shared filesystem."""


def inference_urls(environ: dict[str, str] | os._Environ = os.environ) -> list[str]:
    urls = [u.strip().rstrip("/") for u in environ.get("PRL_INFERENCE_URLS", "").split(",") if u.strip()]
    if not urls:
        raise RuntimeError("PRL_INFERENCE_URLS is empty: the orchestrator needs the inference servers' /v1 URLs")
    return urls


def api_key(cfg: Config) -> str:
    """The servers' key: the run's secret, or the variable that inference.api_key_env names."""
    return secret.server_key(cfg)


def route_tokenizer(cfg: Config) -> str | None:
    """What `Servers(tokenizer=...)` takes for the run's `orchestrator.rollout_route`: the model's
    tokenizer for the token route (docs/inference.md), None for Chat Completions. Training batches,
    online evals and `prl eval` all go the same way, so an eval of saved weights repeats the online one."""
    return cfg.model.name if cfg.orchestrator.rollout_route == "tokens" else None


def server_url(url: str) -> str:
    """`http://host:port/v1` -> `http://host:port`."""
    return url.removesuffix("/v1")


class ProvenTransport(httpx.AsyncBaseTransport):
    """A transport that sends a request only to a server that has proved the key (`proofs`), and
    forgets that proof when a connection to it fails. `http`: the library of the client it serves,
    httpx, or OPENAI_HTTP for the OpenAI client."""

    def __init__(self, proofs: Proofs, limits: httpx.Limits, http: Any = httpx):
        self.proofs, self.errors = proofs, http.TransportError
        self.inner = http.AsyncHTTPTransport(limits=limits)

    async def handle_async_request(self, request: Any) -> Any:
        url = str(request.url)
        await self.proofs.ensure(url)
        try:
            return await self.inner.handle_async_request(request)
        except self.errors:
            self.proofs.forget(url)
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()


class Servers:
    """One verifiers client per server, plus the plain-HTTP endpoints around them."""

    def __init__(self, urls: list[str], api_key: str | None = None, max_connections: int = 1024,
                 tokenizer: str | None = None, logprobs: bool = True, routed_experts: bool = False):
        """`tokenizer`: the served model's tokenizer (a path or hub id): rollouts then go out as token
        ids (prl.orchestrator.tokens); None: through Chat Completions. `logprobs` False: the token
        route asks for no logprobs (Chat Completions always does: verifiers reads them). `routed_experts`:
        the token route asks for each turn's routed experts too (trainer.routing_replay)."""
        self.urls = urls
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.proofs = Proofs(api_key) if api_key else None
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.http = httpx.AsyncClient(headers=self.headers, transport=self._transport(limits), timeout=httpx.Timeout(60.0))
        self.probe = httpx.AsyncClient(timeout=httpx.Timeout(60.0))  # /health: never the key
        self._refusals: dict[str, str] = {}
        # verifiers 0.3's Environment rejects a bare AsyncOpenAI ("Unsupported client type"): it
        # wants one of its own vf.Client adapters; this one speaks Chat Completions.
        openai = [AsyncOpenAI(base_url=url, api_key=api_key or NO_KEY, timeout=REQUEST_TIMEOUT_S, max_retries=3,
                              http_client=DefaultAsyncHttpxClient(transport=self._transport(DEFAULT_CONNECTION_LIMITS, OPENAI_HTTP)))
                  for url in urls]
        self.clients = [TokenClient(c, tokenizer, logprobs, self.proofs, routed_experts) if tokenizer else RolloutClient(c) for c in openai]

    def _transport(self, limits: httpx.Limits, http: Any = httpx) -> httpx.AsyncBaseTransport:
        """With a key: a transport that sends it only to servers that proved it; without, `http`'s own."""
        return ProvenTransport(self.proofs, limits, http) if self.proofs else http.AsyncHTTPTransport(limits=limits)

    async def wait_ready(self, timeout_s: float = 3600.0, poll_s: float = 0.5) -> None:
        """Until every server answers /health with 200 (model load can take many minutes) and has proved
        the key. Asked every poll_s: a connection refused or a 503 costs the server nothing, and the
        first batch starts at most poll_s after it is ready. A server that fails the proof is said once
        (and in the minutely note), and asked again: the run's own server may still come."""
        deadline, last_note = time.monotonic() + timeout_s, time.monotonic()
        pending = list(self.urls)
        while pending:
            pending = [url for url in pending if not await self._healthy(url)]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"inference servers not ready after {timeout_s:.0f}s: {', '.join(pending)}")
            if time.monotonic() - last_note > 60:
                refused = [self._refusals[u] for u in pending if u in self._refusals]
                logger.info(f"waiting for inference servers: {', '.join(pending)}" + "".join(f"; {r}" for r in refused))
                last_note = time.monotonic()
            await asyncio.sleep(poll_s)

    async def _healthy(self, url: str) -> bool:
        try:
            if (await self.probe.get(f"{server_url(url)}/health")).status_code != 200:
                return False
            if self.proofs is not None:
                await self.proofs.ensure(url)
        except httpx.HTTPError:
            return False
        except Unproven as e:
            if self._refusals.get(url) != str(e):
                logger.warning(str(e))
            self._refusals[url] = str(e)
            return False
        self._refusals.pop(url, None)
        return True

    async def model_name(self) -> str:
        """The name the first server serves its model under (what requests must say)."""
        response = await self.http.get(f"{self.urls[0]}/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    async def update_weights(self, path: Path, in_flight: bool = False) -> list[str]:
        """POST /update_weights {"path": ...} to every server at once; raises naming a server that failed.
        `in_flight`: running requests are kept and go on under the new weights (orchestrator.continuous).
        Returns where each server loaded it from: "staged" (stage_weights' copy) or "file"."""
        return list(await asyncio.gather(*(self._update_one(url, path, None, in_flight) for url in self.urls)))

    async def stage_weights(self, path: Path) -> list[str]:
        """POST /update_weights {"path": ..., "stage": true} to every server: each starts reading the
        version into host memory while it generates (prl.inference.readahead). Their answers, in order."""
        body = {"path": str(path), "stage": True}
        return [answer["status"] for answer in await asyncio.gather(*(self._post_update(url, body) for url in self.urls))]

    async def receive_weights(self, version: int, path: Path, in_flight: bool = False) -> None:
        """POST /update_weights {"version": ..., "path": ...}: every server at once, for together they
        receive the trainer's broadcast of `version` (prl.run.broadcast); `path` is its file copy."""
        await asyncio.gather(*(self._update_one(url, path, version, in_flight) for url in self.urls))

    async def _update_one(self, url: str, path: Path, version: int | None, in_flight: bool) -> str:
        body = {"path": str(path)} | ({"version": version} if version is not None else {})
        body |= {"in_flight": True} if in_flight else {}
        return (await self._post_update(url, body)).get("source", "file")

    async def _post_update(self, url: str, body: dict) -> dict:
        """POST /update_weights `body` to one server; its answer, or RuntimeError naming the server."""
        endpoint = f"{server_url(url)}/update_weights"
        response = await self.http.post(endpoint, json=body, timeout=UPDATE_TIMEOUT_S)
        if response.status_code != 200:
            raise RuntimeError(f"{endpoint} answered {response.status_code} for {body}: {response.text[:500]}")
        return response.json()

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self.clients), self.http.aclose(), self.probe.aclose())
