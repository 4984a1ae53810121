"""POST /prl/generate: token ids in; sampled ids and their logprobs out, as plain lists.

    curl -X POST http://HOST:PORT/prl/generate -H 'Content-Type: application/json' \\
         -d '{"token_ids": [1, 2, 3], "sampling_params": {"temperature": 1.0, "max_tokens": 16, "seed": 7}}'
    # 200 {"token_ids": [...], "logprobs": [...], "finish_reason": "length", "stop_reason": null,
    #      "prompt_tokens": 3}            400 {"error": "..."} (bad sampling params, prompt too long)
    # with "logprobs": false in the body: "logprobs": null, and the engine computes none
    # with "tools": [...] in the body: also "content" and "tool_calls", found by the server's tool-call
    #      parser (prl/inference/toolcalls.py); 400 from a server without one
    # with "routed_experts": true: also "routed_experts", {"data": base64, "shape": [positions, layers,
    #      top_k], "start": 0, "dtype": "uint8"} (verifiers' RoutedExpertsPayload), or null from a server
    #      started without --enable-return-routed-experts (trainer.routing_replay, prl/trainer/replay.py)

What the orchestrator's rollouts need and nothing more (prl/orchestrator/tokens.py). vLLM's own routes
turn every sampled token's logprob into a response object, with its text unless detokenizing is off:
on 2 x H200, 1.5B model, 256 requests x 1024 tokens (docs/performance.md), its token route gave 40.4k
tok/s without logprobs, 17.9-20.4k with them (text off) and 8.6k with text; Chat Completions with
logprobs 12.3k. Here the engine is asked directly (the server's own engine client, so requests are
batched with everything else and paused by /update_weights like any other), with `logprobs=0`,
no detokenizing, flat logprobs (vLLM's `FlatLogprobs`: a few flat lists per request instead of one
dict and one Logprob object per token) and only the final output; the floats are read off that once.
A trainer that recomputes the behaviour logprobs itself (trainer.behaviour_logprobs: recompute)
needs none: `"logprobs": false` asks the engine for the tokens alone.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse

from prl.inference import compat
from prl.inference.toolcalls import ToolCalls, parser_name

ROUTE = "/prl/generate"
FIXED = {"detokenize": False}
"""Set on every request: no text."""
LOGPROBS = {"logprobs": 0, "flat_logprobs": True}
"""Set unless the body says `"logprobs": false`: the sampled token's logprob (rank 0 = itself only), flat lists."""


ALLOWED = frozenset({
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "seed", "n", "stop", "stop_token_ids",
    "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "bad_words", "allowed_token_ids",
    "structured_outputs",
})
"""Sampling fields a request may set: those the orchestrator sends (orchestrator.sampling, an
environment's sampling args, extra_body) and nothing that multiplies the work of one request (n > 1,
best_of, top-k logprobs, prompt logprobs) or changes what comes back (output_kind, detokenize).
`structured_outputs` is vLLM's {"regex" | "json" | "choice" | "grammar": ...}: an environment that
constrains its model's output (prl.envs.calculator for a model new to its tool-call format)."""


class BadRequest(ValueError):
    """The body cannot be turned into a generation; the message says why."""


def parse(body: Any) -> tuple[list[int], dict, list | None, bool]:
    """(prompt ids, sampling params as keyword arguments, tools, routed experts wanted) from the JSON body;
    "logprobs" (default true) says whether to ask for the sampled tokens' logprobs."""
    if not isinstance(body, dict):
        raise BadRequest('body must be a JSON object {"token_ids": [...], "sampling_params": {...}}')
    ids, params = body.get("token_ids"), body.get("sampling_params", {})
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise BadRequest("token_ids must be a non-empty list of non-negative integers")
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be a JSON object")
    if not isinstance(logprobs := body.get("logprobs", True), bool):
        raise BadRequest("logprobs must be true or false")
    if not isinstance(routed := body.get("routed_experts", False), bool):
        raise BadRequest("routed_experts must be true or false")
    if unknown := sorted(set(params) - ALLOWED):
        raise BadRequest(f"sampling_params: {', '.join(map(str, unknown))} not accepted here (prl.inference.generate.ALLOWED)")
    if params.get("n", 1) != 1:
        raise BadRequest(f"sampling_params.n must be 1 (one completion per request), got {params['n']!r}")
    if not isinstance(params.get("structured_outputs", {}), dict):
        raise BadRequest('sampling_params.structured_outputs must be a JSON object, e.g. {"regex": "..."}')
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("tools must be a list of OpenAI tool objects")
    return ids, {**params, **FIXED, **(LOGPROBS if logprobs else {})}, tools or None, routed


def sampled_logprobs(logprobs: Any, ids: list[int]) -> list[float]:
    """The sampled tokens' logprobs. With logprobs=0 each position holds the sampled token alone, so
    the flat container's per-position start index points at it."""
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs
        starts = logprobs.start_indices[: len(ids)]
        if [logprobs.token_ids[start] for start in starts] != ids:  # a vLLM that orders them otherwise
            raise RuntimeError("vLLM's flat logprobs do not start with the sampled tokens")
        return [float(logprobs.logprobs[start]) for start in starts]
    return [float(position[token].logprob) for position, token in zip(logprobs, ids)]


def result(output: Any, routed: bool = False) -> dict:
    """The final RequestOutput of one request -> the response body; `routed`: with its routed experts."""
    completion = output.outputs[0]
    ids = list(completion.token_ids)
    answer = {
        "token_ids": ids,
        "logprobs": None if completion.logprobs is None else sampled_logprobs(completion.logprobs, ids),
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "prompt_tokens": len(output.prompt_token_ids or []),
    }
    if routed:
        answer["routed_experts"] = routed_payload(getattr(completion, "routed_experts", None))
    return answer


def routed_payload(experts: Any) -> dict | None:
    """vLLM's [positions, layers, top_k] expert ids (every prompt position, then every sampled token but the
    last, which the model never ran) as JSON: raw uint8 bytes in base64, not one number per id."""
    if experts is None:
        return None
    array = np.ascontiguousarray(experts, dtype=np.uint8)
    return {"data": base64.b64encode(array.tobytes()).decode("ascii"), "shape": list(array.shape), "start": 0,
            "dtype": "uint8"}


async def generate(engine: Any, ids: list[int], params: dict, tools: Any = None, routed: bool = False) -> dict:
    """One generation; `tools`: (ToolCalls, its request) to find the completion's tool calls with; `routed`:
    with the routed experts."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    if "structured_outputs" in params:
        try:
            params = {**params, "structured_outputs": StructuredOutputsParams(**params["structured_outputs"])}
        except (TypeError, *compat.request_errors()) as e:
            raise BadRequest(f"sampling_params.structured_outputs: {e}") from None
    try:
        sampling = SamplingParams(**params, output_kind=RequestOutputKind.FINAL_ONLY)
    except (TypeError, *compat.request_errors()) as e:
        raise BadRequest(f"sampling_params: {e}") from None
    request_id = f"prl-{uuid.uuid4().hex}"
    final = None
    try:
        async for final in engine.generate({"prompt_token_ids": ids}, sampling, request_id):
            pass
    except asyncio.CancelledError:  # the client went away: free the engine's slot
        await engine.abort(request_id)
        raise
    except compat.request_errors() as e:  # input validation, e.g. a prompt longer than the model
        raise BadRequest(str(e)) from None
    answer = result(final, routed)
    if tools is not None:
        parser, request = tools
        eos = answer["finish_reason"] == "stop" and not isinstance(answer["stop_reason"], str)
        answer |= parser.extract(request, answer["token_ids"], eos)
        if answer["tool_calls"]:
            answer["finish_reason"] = "tool_calls"  # as Chat Completions answers with tool_choice "auto"
    return answer


def tool_calls(app: Any, tools: list | None) -> tuple[ToolCalls, Any] | None:
    """The server's parser (made once per API process) and the request it reads `tools` from."""
    if tools is None:
        return None
    parser = getattr(app.state, "prl_tool_calls", None)
    if parser is None:
        parser = app.state.prl_tool_calls = ToolCalls(parser_name(app.state.args), app.state.engine_client.get_tokenizer())
    parser.parser_class()  # a server without a parser refuses before generating
    return parser, parser.request(tools)


async def handle(request: Request) -> JSONResponse:
    if request.method != "POST":
        return JSONResponse({"error": "use POST"}, status_code=405)
    try:
        ids, params, tools, routed = parse(await request.json())
        work = generate(request.app.state.engine_client, ids, params, tool_calls(request.app, tools), routed)
        answer = await unless_disconnected(request, work)
    except ValueError as e:  # BadRequest, and a body that is not JSON
        return JSONResponse({"error": str(e)}, status_code=400)
    # 499 (nginx's "client closed request"): nobody reads it; the generation was aborted.
    return JSONResponse(answer) if answer is not None else JSONResponse({"error": "client went away"}, status_code=499)


async def unless_disconnected(request: Request, work: Any) -> dict | None:
    """`work`'s result, or None once the client has gone away first (`work` is then cancelled, which
    aborts its engine request). The server does not cancel a handler whose client left: an
    orchestrator that stops mid-batch (its end, a failure, orchestrator.continuous cancelling the
    groups it no longer needs) would leave every request generating to its max_tokens, and the next
    weight update, which waits for running requests, behind them."""
    job, gone = asyncio.ensure_future(work), asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not job.done():
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)  # generate() aborts its engine request
    return None if job.cancelled() else job.result()


async def disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
