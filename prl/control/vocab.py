"""Whether a teacher's tokenizer gives the student's tokens the same ids, read from the two models'
tokenizer files on the login node (JSON only: no transformers, no torch).

    from prl.control import vocab
    vocab.mismatch(".cache/tiny-qwen2", "outputs/sft-toy/weights/step_20", hf_cache)   # None: same ids

On-policy distillation sends the student's token ids to the teacher as its own (prl.orchestrator.distill):
a teacher of another vocabulary would score other strings, silently. The embedding's size
(config.json's vocab_size) may differ between models of one tokenizer (padding): it is not compared.
"""

from __future__ import annotations

import json
from pathlib import Path

from prl.control.modelfiles import model_files


def token_ids(directory: Path) -> dict[str, int] | None:
    """token -> id of a model directory's tokenizer (tokenizer.json's vocabulary and added tokens, or
    vocab.json and added_tokens.json); None where neither can be read."""
    try:
        if (directory / "tokenizer.json").is_file():
            tokenizer = json.loads((directory / "tokenizer.json").read_text())
            table = tokenizer.get("model", {}).get("vocab")
            ids = dict(table) if isinstance(table, dict) else (
                {entry[0]: i for i, entry in enumerate(table)} if isinstance(table, list) else None)
            if ids is None:
                return None
            return ids | {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
        if (directory / "vocab.json").is_file():
            ids = json.loads((directory / "vocab.json").read_text())
            added = directory / "added_tokens.json"
            return ids | (json.loads(added.read_text()) if added.is_file() else {})
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return None


def mismatch(student: str, teacher: str, cache: Path) -> str | None:
    """Why the teacher's tokenizer does not fit the student's (one line), or None: the same ids, or
    not checkable here (a model neither local nor in the Hugging Face cache `cache`: then a warning)."""
    dirs = [model_files(name, cache) for name in (student, teacher)]
    tables = [token_ids(d) if d is not None else None for d in dirs]
    if tables[0] is None or tables[1] is None:
        which = student if tables[0] is None else teacher
        print(f"prl: warning: teacher.model: the tokenizer of {which} could not be read here; its vocabulary "
              "was not compared with the student's", flush=True)
        return None
    a, b = tables
    if a == b:
        return None
    differ = sorted(t for t in set(a) | set(b) if a.get(t) != b.get(t))
    return (f"its tokenizer gives {len(differ)} token(s) other ids than the student's (model.name {student}), "
            f"e.g. {', '.join(repr(t) for t in differ[:3])}: the teacher must share the student's vocabulary")
