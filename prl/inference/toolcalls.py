"""The tool calls in a completion of /prl/generate, found by the server's own tool-call parser.

    POST /prl/generate {"token_ids": [...], "sampling_params": {...}, "tools": [OpenAI tool, ...]}
    # 200 {..., "content": "text before the calls" | null, "tool_calls": [{"id", "type": "function",
    #      "function": {"name", "arguments": "<JSON>"}}], "finish_reason": "tool_calls"}

The parser is vLLM's, the one `--tool-call-parser` names (inference.tool_call_parser), run over the
completion's text as Chat Completions runs it (non-streaming, tool_choice "auto"): the parser adjusts
the request (hermes keeps special tokens in the text), the text is decoded once, and the parser's
content and calls come back. The token ids stay the sampled ones: the orchestrator continues the next
turn from them, never from a re-rendering of the parsed calls (prl/orchestrator/tokens.py).

`inference.tool_call_parser: auto` takes the parser from the model's family (`auto_parser`; prl submit
resolves it from the model's config.json and chat template, prl.control.toolparser).

Not applied here: vLLM's strict tool calling (structural tags from a tool's `strict`): the trainer's
logprobs are the unconstrained model's. An environment that wants its output constrained says so in its
own sampling args (`structured_outputs`).
"""

from __future__ import annotations

import uuid
from typing import Any


FAMILY_PARSERS = {
    "qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
    "mistral": "mistral", "mixtral": "mistral", "llama4": "llama4_pythonic", "granite": "granite",
    "internlm2": "internlm", "deepseek_v3": "deepseek_v3", "gpt_oss": "openai", "glm4_moe": "glm45",
    "kimi_k2": "kimi_k2",
}
"""vLLM's tool-call parser per model family (config.json's model_type), for inference.tool_call_parser: auto."""

TEMPLATE_PARSERS = (("<function=", "qwen3_coder"), ("<|python_tag|>", "llama3_json"))
"""Chat-template markers that decide within a family: Qwen3-Coder writes XML calls (<function=...>),
a Llama 3.x template (model_type llama, as Llama 2's) has the <|python_tag|> of its JSON calls."""


def auto_parser(model_type: str | None, chat_template: str | None) -> str | None:
    """vLLM's parser for a model with this model_type and chat template; None where none is known
    (Llama without the Llama 3 template, a family not mapped)."""
    template = chat_template or ""
    for marker, parser in TEMPLATE_PARSERS:
        if marker in template and (model_type or "").startswith(("qwen", "llama")):
            return parser
    return FAMILY_PARSERS.get(model_type or "")


class NoParser(ValueError):
    """Tools in a request to a server started without a tool-call parser."""


def parser_name(args: Any) -> str | None:
    """The parser the server runs with (vLLM's parsed serve args), None without auto tool choice."""
    if not getattr(args, "enable_auto_tool_choice", False):
        return None
    return getattr(args, "tool_call_parser", None)


class ToolCalls:
    """One server's parser class and tokenizer; a parser object per completion (parsers keep state)."""

    def __init__(self, name: str | None, tokenizer: Any):
        self.name, self.tokenizer = name, tokenizer
        self._cls: Any = None

    def parser_class(self) -> Any:
        if self.name is None:
            raise NoParser("tools given, and this server has no tool-call parser: start it with "
                           "inference.tool_call_parser set (vLLM's --enable-auto-tool-choice --tool-call-parser)")
        if self._cls is None:
            from vllm.tool_parsers import ToolParserManager

            self._cls = ToolParserManager.get_tool_parser(self.name)
        return self._cls

    def request(self, tools: Any) -> Any:
        """The Chat Completions request the parser reads (its tools and tool choice; no messages)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            return ChatCompletionRequest(model="prl", messages=[], tools=tools)
        except ValueError as e:  # pydantic's ValidationError: a malformed tool
            raise ValueError(f"tools: {e}") from None

    def extract(self, request: Any, ids: list[int], eos: bool) -> dict:
        """{"content", "tool_calls"} of the completion `ids`; `eos`: its last id is the stop token,
        which Chat Completions' text leaves out."""
        parser = self.parser_class()(self.tokenizer, request.tools)
        request = parser.adjust_request(request)
        text = self.tokenizer.decode(ids[:-1] if eos and ids else ids,
                                     skip_special_tokens=request.skip_special_tokens)
        found = parser.extract_tool_calls(text, request)
        if not found.tools_called:
            return {"content": text, "tool_calls": []}
        calls = [{"id": call.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": call.function.name, "arguments": call.function.arguments}}
                 for call in found.tool_calls]
        return {"content": found.content, "tool_calls": calls}
