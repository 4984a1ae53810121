"""What the model wrote, as JSON: the messages verifiers hands back, an error as one line.

RUN/rollouts/step_N.completions.jsonl (prl.orchestrator.rollouts.completion_records) and
RUN/evals/step_V.completions.jsonl (prl.orchestrator.evals.eval_completions) are made of these.
"""

from __future__ import annotations

import json
from typing import Any


def error_text(error: Any) -> str:
    """verifiers' ErrorData ({"error": type name, "message": ..., "error_chain_repr": ...}) as one line.
    A wrapper without a message of its own (verifiers' ModelError around a server's HTTP error) is
    shown with the errors it wraps: the server's status and message, not a bare "ModelError"."""
    if not isinstance(error, dict):
        return str(error)
    kind, message, chain = error.get("error", "error"), error.get("message") or "", error.get("error_chain_repr") or ""
    if message in ("", kind) and " -> " in chain:
        message = chain.split(" -> ", 1)[1]
    return f"{kind}: {message}".strip()


def plain(value: Any) -> Any:
    """JSON-able messages: verifiers hands some back as pydantic models (unset fields left out), and
    an assistant's tool calls as JSON strings (recorded as the objects they encode)."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, dict):
        return {key: plain(decoded(v) if key == "tool_calls" else v) for key, v in value.items()}
    return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def decoded(calls: Any) -> Any:
    """Each JSON string of a list as the object it encodes; anything else as it is."""
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        try:
            out.append(json.loads(call) if isinstance(call, str) else call)
        except ValueError:
            out.append(call)
    return out
