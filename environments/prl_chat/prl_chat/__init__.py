"""A verifiers v1 harness: the null harness's chat loop run inside the environment worker.

    orchestrator.environment: {id: prl_toy_v1, api: v1, harness: prl_chat}    # the default for api v1

verifiers' own `null` harness runs its chat program as a PEP 723 script, which `uv sync` installs from
the network before every first launch (UV_OFFLINE forced off): compute nodes have no network, and a
process per episode costs more than a tiny model's whole turn. This harness talks to the same
interception endpoint with the same secret, from the worker's event loop, and sends the model's reply
back nowhere: the interception server records the turn (token ids, logprobs) on the trace as it would
for the program.

Tools: a task's toolsets (v1 `Toolset`s, MCP servers the worker starts) are listed once per launch and
sent with every turn, as the null harness's program does (verifiers.v1.harnesses.utils.core); a reply
with tool calls (parsed by the renderer from the sampled tokens) is answered by the tools' results and
the model speaks again, until a reply without calls or `max_turns` replies.
"""

import json
from contextlib import AsyncExitStack

import httpx
import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp


TIMEOUT = httpx.Timeout(600.0, connect=120.0)
"""The interception server answers from this process's own event loop, busy with every other episode:
on a loaded 2-core VM openai's 5 s connect limit failed whole groups (APITimeoutError) of a healthy run."""


class PrlChatConfig(vf.HarnessConfig):
    max_turns: int = 4
    """Replies per launch when the model calls tools: each reply with calls gets their results and
    another turn, up to this many replies (the null harness has no limit but the context)."""


class PrlChat(vf.Harness[PrlChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        async with AsyncExitStack() as stack:
            servers = {"mcpServers": {name: {"url": url} for name, url in mcp_urls.items()}}
            tools, dispatch, clients = await connect_mcp(servers, stack) if mcp_urls else ([], {}, {})
            client = await stack.enter_async_context(AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0,
                                                                 timeout=TIMEOUT))
            for turn in range(1, self.config.max_turns + 1):
                completion = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                                  **({"tools": tools} if tools else {}))
                message = completion.choices[0].message
                if not message.tool_calls or turn == self.config.max_turns:  # no turn left to show results to
                    break
                messages.append(message.model_dump(exclude_none=True))
                for call in message.tool_calls:
                    content = await run_tool(clients, dispatch, call.function.name, call.function.arguments)
                    messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                     "content": content})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


async def run_tool(clients: dict, dispatch: dict, name: str, arguments: str | None):
    """The tool's result, or the error the model is shown instead (the null harness's words)."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as e:
        return f"error: invalid JSON in tool arguments ({e}); resend the call with valid JSON"
    if not isinstance(args, dict):
        return f"error: tool arguments must be a JSON object, got {type(args).__name__}; resend as an object"
    if name not in dispatch:
        return f"error: unknown tool {name!r}"
    return await call_mcp(clients, dispatch, name, args)


__all__ = ["PrlChat"]
