"""The defaults the docs quote are prl/config's dataclass defaults (STYLE.md 19), in every doc test_docs.py
reads (its readers of markdown serve here):

    pytest tests/unit/test_docs_defaults.py

- a table with a `key` and a `default` column (its section a config path in backticks in the key
  header, else in the nearest heading above);
- prose of the forms "`a.b` (default X", "default is `a.b: X`" and "`a.b: X`, the default".

Every failure names the doc, the line and what is wrong.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path

import pytest

from prl.config import Config
from test_docs import CODE_SPAN, DOCS, code_spans, doc_lines, headings, tables, where  # beside this file

CONFIG_PATH = re.compile(r"[a-z_]+(?:\.[a-z_]+)*")  # a section: `sft`, `orchestrator.eval`
VALUE = r"(`[^`]+`|[\w.+-]+)"
FIELD = r"(?P<path>[a-z_]+(?:\.[a-z_]+)+)"
PROSE_DEFAULTS = [
    # "`a.b` (default 8", "`a.b: N`, default none", "`a.b: 600` (the default 300"
    re.compile(rf"`{FIELD}(?::[^`]*)?`\s*[,(]\s*(?:the\s+)?default:?\s+(?P<value>{VALUE})"),
    re.compile(rf"[Dd]efault\s+is\s+`{FIELD}: (?P<yaml>[^`]+)`"),  # "default is `a.b: x`"
    re.compile(rf"`{FIELD}: (?P<yaml>[^`]+)`,\s+the\s+default(?=[).,;]|$)"),  # "`a.b: x`, the default"
]
REQUIRED = object()


def _dataclass_in(hint: object) -> type | None:
    """The dataclass a field's type holds: itself, X | None, list[X]."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType, list):
        return next(filter(None, map(_dataclass_in, typing.get_args(hint))), None)
    return None


def config_section(path: str) -> type | None:
    cls: type | None = Config
    for part in path.split("."):
        hints = typing.get_type_hints(cls)
        cls = _dataclass_in(hints[part]) if part in hints else None
        if cls is None:
            return None
    return cls


def config_default(section: type, key: str) -> object:
    field = {f.name: f for f in dataclasses.fields(section)}[key]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return REQUIRED


def parse_value(text: str) -> object:
    """A default as the docs write it: `yaml`, a number, none, true/false, required; other words
    describe what None stands for (`name`: "the module's last part")."""
    text = text.strip()
    code = re.fullmatch(r"`([^`]*)`", text)
    word = (code.group(1) if code else text).strip()
    if word.lower() in ("none", "null", "~"):
        return None
    if word.lower() in ("true", "false"):
        return word.lower() == "true"
    if word == "required":
        return REQUIRED
    for number in (int, float):
        try:
            return number(word)
        except ValueError:
            pass
    if code:
        import yaml

        return yaml.safe_load(word)
    return None


def same(said: object, real: object) -> bool:
    if isinstance(said, bool) or isinstance(real, bool):
        return said is real
    if isinstance(said, (int, float)) and isinstance(real, (int, float)):
        return float(said) == float(real)
    return said == real


def section_of_table(doc: Path, header_no: int, header: list[str]) -> str | None:
    """The config path a key table is about: in its key header, else in the nearest heading above."""
    candidates = code_spans(header[0]) + [s for no, h in reversed(headings(doc)) if no < header_no
                                          for s in code_spans(h)]
    return next((s for s in candidates if CONFIG_PATH.fullmatch(s) and config_section(s)), None)


def split_outside_code(cell: str) -> list[str]:
    """The comma-separated items of a cell; commas inside backticks do not split."""
    spans: list[str] = []
    masked = CODE_SPAN.sub(lambda m: spans.append(m.group(0)) or f"\0{len(spans) - 1}\0", cell)
    items = [re.sub(r"\0(\d+)\0", lambda m: spans[int(m.group(1))], item) for item in masked.split(",")]
    return [item.strip() for item in items if item.strip()]


def test_config_defaults_in_tables_are_the_dataclass_defaults():
    wrong, checked = [], 0
    for doc in DOCS:
        for header_no, header, body in tables(doc):
            column = next((i for i, h in enumerate(header) if "default" in h.lower()), None)
            if not header[0].lower().startswith("key") or column is None:
                continue
            section = section_of_table(doc, header_no, header)
            if section is None:
                wrong.append(f"{where(doc, header_no)}: a table of defaults without its config section (a path "
                             "in backticks in its key header or in the heading above it)")
                continue
            cls = config_section(section)
            for no, cells in body:
                keys, values = code_spans(cells[0]), [parse_value(v) for v in split_outside_code(cells[column])]
                if len(values) not in (1, len(keys)):
                    wrong.append(f"{where(doc, no)}: {len(keys)} keys but {len(values)} defaults")
                    continue
                for key, said in zip(keys, values * len(keys) if len(values) == 1 else values):
                    if key not in {f.name for f in dataclasses.fields(cls)}:
                        wrong.append(f"{where(doc, no)}: {section}.{key} is not a config field")
                        continue
                    real = config_default(cls, key)
                    checked += 1
                    if not same(said, real):
                        wrong.append(f"{where(doc, no)}: says {section}.{key} defaults to {cells[column]!r}; "
                                     f"the dataclass: {'required' if real is REQUIRED else repr(real)}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 10, f"only {checked} table defaults checked: has the tables' form changed?"


def test_config_defaults_in_prose_are_the_dataclass_defaults():
    wrong, checked = [], 0
    for doc in DOCS:
        text = "\n".join(doc_lines(doc))
        # Lines joined (a newline becomes a space, so offsets stay): a phrase may wrap.
        for m in (m for pattern in PROSE_DEFAULTS for m in pattern.finditer(text.replace("\n", " "))):
            section, _, key = m.group("path").rpartition(".")
            value = m.groupdict().get("value") or f"`{m.group('yaml')}`"
            cls = config_section(section)
            said = parse_value(value)
            if cls is None or key not in {f.name for f in dataclasses.fields(cls)}:
                continue
            if said is None and not re.fullmatch(r"`?(none|null)`?", value, re.IGNORECASE):
                continue  # words, not a value: "(default: the one that ran prl submit)"
            checked += 1
            real = config_default(cls, key)
            if not same(said, real):
                wrong.append(f"{where(doc, text.count(chr(10), 0, m.start()) + 1)}: says {m.group('path')} "
                             f"defaults to {value}; the dataclass: {'required' if real is REQUIRED else repr(real)}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 5, f"only {checked} prose defaults checked: has their form changed?"


@pytest.mark.parametrize("text, value", [("`clip`", "clip"), ("0.28", 0.28), ("none", None), ("`{}`", {}),
                                         ("required", REQUIRED), ("true", True), ("the module's last part", None)])
def test_parse_value(text, value):
    assert same(parse_value(text), value)
