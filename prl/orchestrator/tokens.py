"""Rollouts as tokens: every turn continues from the ids of the turns before it, through vLLM's
token-in/token-out route, with the sampled tokens' logprobs as floats.

Why not Chat Completions: each turn there re-renders the whole conversation from message text and
re-tokenizes it. Tokens the model sampled that are not valid UTF-8 on their own come back as U+FFFD
and re-tokenize differently, so a later turn's prompt no longer extends the earlier turns' ids and
the rollout cannot be trained on as one sequence (69-81 % of 3-turn rollouts were dropped that way).
And it is slow: for every sampled token vLLM's front end decodes a logprob entry with its text and
bytes (docs/performance.md, "Where the rollout gap goes").

Here:
- turn 1's prompt ids come from the server's /tokenize (vLLM's own chat template, tools and
  chat_template_kwargs applied as Chat Completions would);
- turn k > 1's prompt ids are turn k-1's prompt + completion ids, then the tokens the template puts
  after an assistant message, then the environment's new messages rendered by the template (the
  "bridge": [assistant "x", *env] with a generation prompt, minus [assistant "x"] without);
- the engine call is prl's POST /prl/generate (prl/inference/generate.py): ids in, ids and the
  sampled tokens' logprobs out as two lists, no per-token text or response object anywhere;
- both routes are plain JSON POSTs through aiohttp (prl.orchestrator.http_client), not the OpenAI client:
  a tenth of the orchestrator's CPU per request;
- the completion's text, which the environment parses, is decoded once here (special tokens skipped,
  as Chat Completions does).

Tools (an environment's tool_defs, verifiers' ToolEnv and StatefulToolEnv): every /tokenize renders
them with the chat template, as Chat Completions would; /prl/generate gets them too and answers with
the completion's tool calls, found by the server's tool-call parser (prl/inference/toolcalls.py,
inference.tool_call_parser). The next turn continues from the sampled ids: the bridge's stand-in
assistant message carries tool calls with the ids the tool messages answer (templates that check
that a tool message follows a call), and the tool results join the sequence outside the loss mask.

Requests this route cannot express go through Chat Completions (the parent class), logged once:
stop strings (vLLM needs the detokenizer for those).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

import verifiers as vf
from loguru import logger
from openai.types.chat import ChatCompletion

from prl.orchestrator.chat import RolloutClient
from prl.orchestrator.http_client import ServerError, ServerRoutes
from prl.run.proof import Proofs

GENERATE = "/prl/generate"
"""prl's token-in/token-out route on the inference server (prl.inference.generate)."""
CHAT_ONLY = ("stop",)
"""What sends a request to Chat Completions instead (see the module docstring)."""
NOT_SAMPLING = {"return_token_ids", "chat_template_kwargs", "logprobs", "top_logprobs", "max_completion_tokens"}
"""Request fields of the chat route that are not vLLM SamplingParams (or are set by the route)."""
OVERLONG = ("maximum model length", "maximum context length", "context length", "longer than")
FINISH_REASONS = ("stop", "length")
"""The route's finish reasons that TokenClient.to_response makes a Response of itself; any other
(vLLM's "abort") goes through the ChatCompletion as it always did, which refuses it: the rollout errs."""
NO_KEY = "EMPTY"
"""The OpenAI client's key for servers that take none (it refuses an empty one): never sent as a bearer here."""
TOKENIZED_KEPT = 4096
"""Renderings TokenClient.tokenize keeps (then it starts afresh): a step's prompts, many times over."""


@cache
def load_tokenizer(path: str) -> Any:
    """The tokenizer at `path`, loaded once per process, when the first client is made: the orchestrator
    makes its clients before it waits for its servers. Loaded at the first completion's decode, as it
    was, importing transformers and reading the tokenizer held up the whole first batch: 2.4 s on a
    2-core VM with the tiny model's tokenizer, 3.9 s with a 151,936-id one, and the first batch of a
    GPU run ended 7-8 s after its last token (benchmarks/reports/loop-1p1-engine-cpu-bound_h200x2_2026-11-28.md).
    Not in a thread beside the process's other work: `datasets` looks transformers up in sys.modules
    while it hashes a dataset, and met it half imported (module 'transformers' has no attribute
    'PreTrainedTokenizerBase')."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers' own types vary by what is missing (OSError, ValueError, hub errors)
        raise RuntimeError(f"the token route decodes with model.name's tokenizer, which did not load from "
                           f"{path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


class BridgeError(ValueError):
    """A later turn's messages do not extend the previous turn's (the environment rewrote history)."""


class TokenClient(RolloutClient):
    """verifiers' Chat Completions adapter whose requests go out as token ids (module docstring)."""

    _fallbacks_logged: set[str] = set()

    def __init__(self, client: Any, tokenizer_path: str, logprobs: bool = True, proofs: Proofs | None = None,
                 routed_experts: bool = False):
        """`logprobs` False: the route returns none, and the rollouts carry 0.0 in their place (the
        trainer recomputes them: trainer.behaviour_logprobs). `proofs`: the servers' proofs of the key,
        shared with the client's other routes (prl.run.proof). `routed_experts`: each turn's tokens carry
        the experts vLLM routed them to (trainer.routing_replay; verifiers' RoutedExpertsPayload)."""
        super().__init__(client)
        self.proofs = proofs
        self.tokenizer_path = tokenizer_path
        self.logprobs = logprobs
        self.routed_experts = routed_experts
        self._end_of_turn: dict[str, list[int]] = {}
        self._tokenized: dict[str, asyncio.Future] = {}
        self.tokenizer = load_tokenizer(tokenizer_path)  # now, not at the first decode: its docstring

    @cached_property
    def server(self) -> ServerRoutes:
        """The server root (the client's URL without /v1), with the client's key, timeout and retries."""
        client = self.client
        timeout = getattr(client.timeout, "read", client.timeout)  # a number, or httpx's Timeout
        key = None if client.api_key == NO_KEY else client.api_key
        return ServerRoutes(str(client.base_url).rstrip("/").removesuffix("/v1"), key,
                            float(timeout), client.max_retries, self.proofs)

    async def close(self) -> None:
        await self.server.close()
        await super().close()

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        reason = next((key for key in CHAT_ONLY if sampling_args.get(key)), None)
        if reason is not None:
            if reason not in TokenClient._fallbacks_logged:
                TokenClient._fallbacks_logged.add(reason)
                logger.warning(f"rollout requests with {reason!r} go through Chat Completions: turns are "
                               "re-tokenized from text there, and multi-turn rollouts can be dropped")
            return await super().get_native_response(prompt, model, sampling_args, tools, **kwargs)
        state = kwargs["state"]
        template = Template((sampling_args.get("extra_body") or {}).get("chat_template_kwargs") or {}, tools or None)
        if state["trajectory"]:
            ids = await self.continuation_ids(state, prompt, template)
        else:
            ids = await self.tokenize(prompt, template, add_generation_prompt=True)
        return await self.generate(ids, model, sampling_args, template.tools)

    async def tokenize(self, messages: list, template: Template, add_generation_prompt: bool) -> list[int]:
        """The server's rendering of `messages`, asked once per distinct request: a group's rollouts
        start from the same prompt and ask together, and the server's answer depends on nothing
        else (its chat template and tokenizer are fixed for its life)."""
        body = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        if template.kwargs:
            body["chat_template_kwargs"] = template.kwargs
        if template.tools:
            body["tools"] = template.tools
        key = json.dumps(body, sort_keys=True)
        loop = asyncio.get_running_loop()
        known = self._tokenized.get(key)
        if known is None or known.get_loop() is not loop or known.cancelled():
            if len(self._tokenized) >= TOKENIZED_KEPT:
                self._tokenized.clear()
            known = self._tokenized[key] = loop.create_task(self.server.post("/tokenize", body))
        try:
            return list((await asyncio.shield(known))["tokens"])
        except BaseException:
            if known.done() and (known.cancelled() or known.exception() is not None):
                self._tokenized.pop(key, None)  # a failed request is asked again, not remembered
            raise

    async def end_of_turn(self, template: Template) -> list[int]:
        """The ids the template puts after an assistant message's content (Qwen: <|im_end|> "\\n"):
        where renderings of two one-letter assistant messages stop differing."""
        key = json.dumps([template.kwargs, template.tools], sort_keys=True)
        if key not in self._end_of_turn:
            x, y = [await self.tokenize([{"role": "assistant", "content": c}], template, False) for c in "xy"]
            last = max((i for i, (a, b) in enumerate(zip(x, y)) if a != b), default=len(x) - 1)
            self._end_of_turn[key] = x[last + 1 :]
        return self._end_of_turn[key]

    async def continuation_ids(self, state: dict, prompt: list, template: Template) -> list[int]:
        """Turn k's prompt ids: turn k-1's ids, its end of turn, the bridge to the new messages."""
        last = state["trajectory"][-1]
        tokens = last["tokens"]
        before, _ = await self.to_native_prompt([*last["prompt"], *last["completion"]])
        if tokens is None or [_plain(m) for m in prompt[: len(before)]] != [_plain(m) for m in before]:
            raise BridgeError(f"turn {len(state['trajectory']) + 1}'s messages do not extend turn "
                              f"{len(state['trajectory'])}'s prompt and completion")
        new = prompt[len(before):]
        dummy = stand_in_assistant(new)
        base = await self.tokenize([dummy], template, add_generation_prompt=False)
        full = await self.tokenize([dummy, *new], template, add_generation_prompt=True)
        if full[: len(base)] != base:
            raise BridgeError("the chat template renders an assistant message differently when messages follow it")
        end = await self.end_of_turn(template)
        completion = tokens["completion_ids"]
        # A completion that stopped on the template's end-of-turn token already holds it; one cut by
        # max_tokens (or stopped by another EOS) gets the whole end of turn, as re-rendering would add it.
        if completion and end and completion[-1] == end[0]:
            end = end[1:]
        return [*tokens["prompt_ids"], *completion, *end, *full[len(base) :]]

    async def generate(self, ids: list[int], model: str, sampling_args: dict, tools: list | None = None) -> ChatCompletion:
        args = {**sampling_args, **(sampling_args.get("extra_body") or {})}
        args.pop("extra_body", None)
        args.setdefault("max_tokens", args.get("max_completion_tokens"))
        params = {k: v for k, v in args.items() if k not in NOT_SAMPLING and v is not None}
        body = {"token_ids": ids, "sampling_params": params, "logprobs": self.logprobs}
        if self.routed_experts:
            body["routed_experts"] = True
        if tools:
            body["tools"] = tools
        try:
            result = await self.server.post(GENERATE, body)
        except ServerError as e:
            if e.status == 400 and any(phrase in e.text.lower() for phrase in OVERLONG):
                raise vf.OverlongPromptError from e
            raise
        return RouteAnswer(result, ids, model)

    async def raise_from_native_response(self, response: Any) -> None:
        """The route answers one completion a request, and an empty one stays a rollout (RolloutClient)."""
        if not isinstance(response, RouteAnswer):
            await super().raise_from_native_response(response)

    async def from_native_response(self, response: Any) -> vf.Response:
        """verifiers' Response: made here from the route's lists, or by verifiers from a ChatCompletion
        (Chat Completions' fallback, and answers with tool calls, which verifiers parses)."""
        if not isinstance(response, RouteAnswer):
            return await super().from_native_response(response)
        if "tool_calls" in response.result or (response.result["finish_reason"] or "stop") not in FINISH_REASONS:
            return await super().from_native_response(self.to_chat_completion(response))
        return self.to_response(response)

    def to_response(self, answer: RouteAnswer) -> vf.Response:
        """What verifiers makes of the equivalent ChatCompletion (text decoded once, special tokens
        skipped; no text is None), without one: going through it built a dict per token for verifiers
        to read back, 262,144 for a batch of 256 x 1,024, where py-spy found the orchestrator's
        thread most often (benchmarks/orchestrator_batch_bench.py; tests/unit/test_tokens.py compares the two)."""
        result, completion = answer.result, answer.result["token_ids"]
        logprobs = result["logprobs"] if result["logprobs"] is not None else [0.0] * len(completion)
        finish = result["finish_reason"] or "stop"  # one of FINISH_REASONS (from_native_response)
        tokens = vf.ResponseTokens(prompt_ids=answer.prompt_ids, prompt_mask=[0] * len(answer.prompt_ids),
                                   completion_ids=completion, completion_mask=[1] * len(completion),
                                   completion_logprobs=logprobs, routed_experts=result.get("routed_experts"))
        message = vf.ResponseMessage(content=self.tokenizer.decode(completion, skip_special_tokens=True) or None,
                                     finish_reason=finish,
                                     is_truncated=finish == "length", tokens=tokens)
        usage = vf.Usage(prompt_tokens=len(answer.prompt_ids), reasoning_tokens=0, completion_tokens=len(completion),
                         total_tokens=len(answer.prompt_ids) + len(completion))
        return vf.Response(id="", created=0, model=answer.model, usage=usage, message=message)

    def to_chat_completion(self, answer: RouteAnswer) -> ChatCompletion:
        """The route's answer in the shape verifiers parses: content, finish reason, ids, logprobs."""
        result, prompt_ids, model = answer.result, answer.prompt_ids, answer.model
        completion = result["token_ids"]
        if "tool_calls" in result:  # the request had tools: the server's parser split the text
            message = {"role": "assistant", "content": result["content"], "tool_calls": result["tool_calls"] or None}
        else:
            message = {"role": "assistant", "content": self.tokenizer.decode(completion, skip_special_tokens=True)}
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion),
                 "total_tokens": len(prompt_ids) + len(completion)}
        response = ChatCompletion.model_validate({
            "id": "", "created": 0, "model": model, "object": "chat.completion", "usage": usage,
            "prompt_token_ids": prompt_ids,
            "choices": [{"index": 0, "message": message, "finish_reason": result["finish_reason"] or "stop",
                         "logprobs": None, "token_ids": completion,  # verifiers reads routed_experts from here
                         **({"routed_experts": result["routed_experts"]} if "routed_experts" in result else {})}],
        })
        # A plain {"content": [{"logprob": x}]}, which verifiers reads as such: no pydantic object per token.
        logprobs = result["logprobs"] if result["logprobs"] is not None else [0.0] * len(completion)
        response.choices[0].logprobs = {"content": [{"logprob": lp} for lp in logprobs]}
        return response


@dataclass(frozen=True)
class RouteAnswer:
    """/prl/generate's answer to one request (its JSON), with the request's prompt ids and model: the
    token route's native response (TokenClient.from_native_response)."""

    result: dict
    prompt_ids: list[int]
    model: str


@dataclass(frozen=True)
class Template:
    """What a rendering depends on besides the messages: the chat template's kwargs and the tools."""

    kwargs: dict
    tools: list | None


def stand_in_assistant(new: list) -> dict:
    """The assistant message the bridge renders before the environment's `new` messages: one that
    called the tools whose results lead `new` (templates may check that), else a one-letter answer."""
    calls = []
    for message in new:
        if _get(message, "role") != "tool":
            break
        calls.append({"id": _get(message, "tool_call_id") or "call_0", "type": "function",
                      "function": {"name": "f", "arguments": "{}"}})
    return {"role": "assistant", "content": None, "tool_calls": calls} if calls else {"role": "assistant", "content": "x"}


def _get(message: Any, key: str) -> Any:
    return message.get(key) if isinstance(message, dict) else getattr(message, key, None)


def _plain(message: Any) -> tuple:
    """(role, content) of a native message, "" and None alike (tool-call-only assistants)."""
    return _get(message, "role"), _get(message, "content") or None
