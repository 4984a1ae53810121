"""prl's routes inside vLLM's own OpenAI server: POST /update_weights (reload.py) and POST
/prl/generate (generate.py).

Installed by `server.py` as `--middleware prl.inference.routes.PrlRoutes`. A middleware rather than a
FastAPI router because `vllm serve` builds its app internally and its only hooks are `--middleware`
and endpoint plugins (which need a package entry point plus VLLM_PLUGINS); a middleware also reaches
the extra API-server processes vLLM spawns for data parallelism.

It is also the server's door: every request but GET /health must carry the run's secret (prl.run.secret,
given to the server as VLLM_API_KEY) as `Authorization: Bearer ...`. vLLM's own key guards only
/v1/...; /invocations (generates), /tokenize, /metrics, /load and the rest stay open without this.
With no key configured nothing but /health is served.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from prl.inference import generate, reload as weights
from prl.inference.replicas import log_rank
from prl.run.log import setup_logging


def _api_keys(app: Any) -> list[str]:
    """The keys vLLM's own auth accepts (--api-key, else VLLM_API_KEY)."""
    import vllm.envs as envs

    return [key for key in (app.state.args.api_key or [envs.VLLM_API_KEY]) if key]


OPEN = frozenset({"/health"})
"""Paths served without the secret: liveness only (the supervisor and load balancers poll it)."""


def _authorized(headers: Headers, keys: list[str]) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    digest = hashlib.sha256(token.encode()).digest()
    matches = [secrets.compare_digest(digest, hashlib.sha256(k.encode()).digest()) for k in keys]
    return scheme.lower() == "bearer" and any(matches)


class PrlRoutes:
    """ASGI middleware answering prl's routes; everything else goes on to vLLM's app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.swapper: weights.WeightSwapper | None = None
        self.keys: list[str] | None = None
        # With data parallelism vLLM serves from extra, spawned API-server processes that did not
        # run jobs/inference.py's logging setup.
        setup_logging("inference", rank=log_rank())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        if scope["path"] not in OPEN and not _authorized(Headers(scope=scope), self._keys(scope)):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})  # policy violation
            else:
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        if scope["type"] != "http" or scope["path"] not in (weights.ROUTE, generate.ROUTE):
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        if scope["path"] == generate.ROUTE:
            response = await generate.handle(request)
        else:
            response = await weights.handle(request, self._swapper(request))
        await response(scope, receive, send)

    def _keys(self, scope: Scope) -> list[str]:
        if self.keys is None:  # app.state.args exists once vLLM has built its app, before any request
            self.keys = _api_keys(scope["app"])
        return self.keys

    def _swapper(self, request: Request) -> weights.WeightSwapper:
        # The engine client exists only once the app state is initialised, after the middleware is built.
        if self.swapper is None:
            engine = request.app.state.engine_client
            self.swapper = weights.WeightSwapper(engine, engine.model_config.model)
        return self.swapper
