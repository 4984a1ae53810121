"""`inference.tool_call_parser: auto`: vLLM's parser of the model's family, resolved at submit.

    prl submit configs/calculator.yaml inference.tool_call_parser=auto   # Qwen2.5 -> hermes in RUN/config.yaml

The model's config.json (model_type) and chat template (tokenizer_config.json's, or chat_template.jinja)
are read from its directory, or from the newest snapshot of a hub id in the Hugging Face cache; the
mapping is prl.inference.toolcalls.auto_parser's. A model without a known parser, or whose files are
not here to read, is refused naming the key: a wrong parser fails silently (calls arrive as text).
"""

from __future__ import annotations

import json
from pathlib import Path

from prl.config import ConfigError, ModelConfig
from prl.control.modelfiles import hf_cache, model_files
from prl.inference.toolcalls import auto_parser

AUTO = "auto"


def chat_template(files: Path) -> str:
    """The chat template: chat_template.jinja, else tokenizer_config.json's (a string, or named templates)."""
    jinja = files / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    try:
        template = json.loads((files / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return ""
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template or ""


def resolve_parser(model: ModelConfig, environ: dict[str, str]) -> str:
    """The parser `auto` stands for with this model; ConfigError naming the key where none is known."""
    files = model_files(model.name, hf_cache(environ))
    if files is None:
        raise ConfigError(f"inference.tool_call_parser: auto reads the model's config.json, and {model.name} is "
                          "neither a directory nor in the Hugging Face cache here; name vLLM's parser (e.g. hermes)")
    try:
        model_type = json.loads((files / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise ConfigError(f"inference.tool_call_parser: auto cannot read {files / 'config.json'} ({e})") from None
    parser = auto_parser(model_type, chat_template(files))
    if parser is None:
        raise ConfigError(f"inference.tool_call_parser: auto knows no tool-call parser for model_type "
                          f"{model_type!r} ({model.name}); name vLLM's parser of its family")
    return parser
