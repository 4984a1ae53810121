"""A verifiers v1 harness: the null harness's chat loop run inside the environment worker.

    orchestrator.environment: {id: prl_toy_v1, api: v1, harness: prl_chat}    # the default for api v1

verifiers' own `null` harness runs its chat program as a PEP 723 script, which `uv sync` installs from
the network before every first launch (UV_OFFLINE forced off): compute nodes have no network, and a
process per episode costs more than a tiny model's whole turn. This harness talks to the same
interception endpoint with the same secret, from the worker's event loop, and sends the model's reply
back nowhere: the interception server records the turn (token ids, logprobs) on the trace as it would
for the program. Tools (MCP) are not handled yet: a task with toolsets is refused.
"""

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire


class PrlChatConfig(vf.HarnessConfig):
    pass


class PrlChat(vf.Harness[PrlChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        if mcp_urls:
            raise vf.HarnessError("prl_chat does not run tools yet; this task has toolsets")
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["PrlChat"]
