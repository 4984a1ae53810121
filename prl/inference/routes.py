"""prl's routes inside vLLM's own OpenAI server: POST /update_weights (reload.py) and POST
/prl/generate (generate.py), and the request shape verifiers v1 needs from POST /inference/v1/generate.

Installed by `server.py` as `--middleware prl.inference.routes.PrlRoutes`. A middleware rather than a
FastAPI router because `vllm serve` builds its app internally and its only hooks are `--middleware`
and endpoint plugins (which need a package entry point plus VLLM_PLUGINS); a middleware also reaches
the extra API-server processes vLLM spawns for data parallelism.

It is also the server's door: every request but GET /health and GET /prl/proof must carry the run's
secret (prl.run.secret, given to the server as VLLM_API_KEY) as `Authorization: Bearer ...`. vLLM's own
key guards only /v1/...; /invocations (generates), /tokenize, /metrics, /load and the rest stay open
without this. With no key configured nothing but /health is served. GET /prl/proof?nonce=N is how the
server proves it holds the key before a client sends it (prl.run.proof): the key's HMAC over a fixed
prefix, the 64-hex-digit nonce and the server's own address, nothing else.

verifiers v1's TrainClient (renderers 0.1's `generate`) reads OpenAI-shaped logprobs from
/inference/v1/generate, each entry's token as "token_id:N", and names no `output_mode`. vLLM 0.32 added
`output_mode`, default "tokens", whose logprobs are {"token_id": N} with no `token`: every turn with a
sampled token failed as malformed. A request that names no mode gets "text" here, whose logprobs are
OpenAI's, with "token_id:N" placeholders under --return-tokens-as-token-ids (server.vllm_args sets it
for v1 environments). A request that names its mode keeps it; a vLLM without the field ignores it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from starlette.datastructures import Headers, QueryParams
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from prl.inference import generate, reload as weights
from prl.inference.replicas import log_rank
from prl.inference.teacher import is_teacher
from prl.run import proof
from prl.run.log import setup_logging


def _api_keys(app: Any) -> list[str]:
    """The keys vLLM's own auth accepts (--api-key, else VLLM_API_KEY)."""
    import vllm.envs as envs

    return [key for key in (app.state.args.api_key or [envs.VLLM_API_KEY]) if key]


SCALE_OUT_GENERATE = "/inference/v1/generate"
"""vLLM's token-in, token-out route (with --enable-scale-out), which verifiers v1's TrainClient samples from."""
GENERATE_OUTPUT_MODE = "text"
"""The `output_mode` of a SCALE_OUT_GENERATE request that names none (this module's docstring says why)."""

OPEN = frozenset({"/health"})
"""Paths served without the secret: liveness only (the supervisor and load balancers poll it). The
proof route (prl.run.proof) is answered here too, before the check: it serves nothing else."""


def _authorized(headers: Headers, keys: list[str]) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    digest = hashlib.sha256(token.encode()).digest()
    matches = [secrets.compare_digest(digest, hashlib.sha256(k.encode()).digest()) for k in keys]
    return scheme.lower() == "bearer" and any(matches)


def proof_response(scope: Scope, keys: list[str]) -> JSONResponse:
    """GET /prl/proof?nonce=N: the keys' proofs for this connection's server end (prl.run.proof); 400
    for a nonce that is not 64 hex digits, 503 with no key (nothing to prove), 405 for another method."""
    if scope["method"] != "GET":
        return JSONResponse({"error": "GET only"}, status_code=405)
    if not keys:
        return JSONResponse({"error": "no key configured"}, status_code=503)
    nonces = [v for k, v in QueryParams(scope.get("query_string", b"")).multi_items() if k == "nonce"]
    server = scope.get("server") or ("", 0)
    answer = proof.answer(keys, nonces[0], proof.address(*server[:2])) if len(nonces) == 1 else None
    if answer is None:
        return JSONResponse({"error": "nonce: 64 lowercase hex digits"}, status_code=400)
    return JSONResponse(answer)


def default_output_mode(body: bytes) -> bytes:
    """A SCALE_OUT_GENERATE body with GENERATE_OUTPUT_MODE where it names no `output_mode`; a body that
    is not a JSON object passes unchanged (vLLM answers it with its own 400)."""
    try:
        request = json.loads(body)
    except ValueError:
        return body
    if not isinstance(request, dict) or "output_mode" in request:
        return body
    return json.dumps({**request, "output_mode": GENERATE_OUTPUT_MODE}).encode()


async def with_body(scope: Scope, receive: Receive, rewrite) -> tuple[Scope, Receive]:
    """The request with its whole body read and passed through `rewrite` (bytes -> bytes): a scope whose
    content-length is the new body's, and a receive that gives that body once, then the client's own
    messages (vLLM listens on them for a disconnect, to cancel the generation)."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":  # the client left before its body arrived
            return scope, _replay([message], receive)
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = rewrite(b"".join(chunks))
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    return {**scope, "headers": headers}, _replay([{"type": "http.request", "body": body, "more_body": False}], receive)


def _replay(messages: list[dict], receive: Receive) -> Receive:
    async def replayed() -> dict:
        return messages.pop(0) if messages else await receive()
    return replayed


class PrlRoutes:
    """ASGI middleware answering prl's routes; everything else goes on to vLLM's app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.swapper: weights.WeightSwapper | None = None
        self.keys: list[str] | None = None
        self.teacher = is_teacher()
        # With data parallelism vLLM serves from extra, spawned API-server processes that did not
        # run jobs/inference.py's logging setup.
        setup_logging("inference", rank=log_rank())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"] == proof.ROUTE:
            await proof_response(scope, self._keys(scope))(scope, receive, send)
            return
        if scope["path"] not in OPEN and not _authorized(Headers(scope=scope), self._keys(scope)):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})  # policy violation
            else:
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"] == SCALE_OUT_GENERATE:
            scope, receive = await with_body(scope, receive, default_output_mode)
        if scope["type"] != "http" or scope["path"] not in (weights.ROUTE, generate.ROUTE):
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        if scope["path"] == generate.ROUTE:
            response = await generate.handle(request)
        elif self.teacher:  # the teacher's model stays what teacher.model names, for the whole run
            response = JSONResponse({"error": "a teacher server takes no weight updates"}, status_code=403)
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
