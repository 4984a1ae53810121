"""Checks on raw and typed config values that every section shares; each names the key path.

    from prl.config.validate import check_shape, check_name, check_slurm_time
    check_shape({"env": ["A", "B"]}, Config, "")   # ConfigError: env: must be a mapping, got a list

Pure functions of their arguments (no file system, no imports of the RL stack): `prl.config` calls
them while loading, so they run on login nodes for every command. `warn` is the one line that says what
a check could not decide (the control plane's checks use it too).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from functools import lru_cache
from typing import Any


class ConfigError(ValueError):
    """A config that cannot run; the message names the key path (or the file)."""


def check(ok: bool, path: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{path}: {message}")


def warn(message: str) -> None:
    """One line on stderr that does not stop anything: what a check could not decide, said."""
    print(f"prl: warning: {message}", file=sys.stderr)


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"{type(value).__name__} {value!r}"


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_shape(node: Any, hint: Any, path: str) -> None:
    """Containers where the schema has sections, mappings and lists, single values elsewhere.

    Runs on each YAML file and override before OmegaConf merges them: its merge raises a bare
    TypeError ("Cannot merge incompatible container types") that names no key. Unknown keys and
    scalar conversions are left to OmegaConf, whose messages name the key already."""
    if node is None or hint is Any:
        return  # None: OmegaConf names a missing non-optional section itself
    if dataclasses.is_dataclass(hint):
        check(isinstance(node, dict), path, f"must be a mapping (a config section), got {_kind(node)}")
        for key, value in node.items():
            check_key(key, path)
            if key in _hints(hint):
                check_shape(value, _hints(hint)[key], _join(path, key))
            elif path.endswith("]"):  # OmegaConf names a list item's unknown key without the list's path
                close = difflib.get_close_matches(key, list(_hints(hint)), n=1)
                check(False, _join(path, key), "unknown key" + (f"; did you mean {close[0]}?" if close else ""))
        return
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is dict:
        check(isinstance(node, dict), path, f"must be a mapping, got {_kind(node)}")
        for key, value in node.items():
            check_key(key, path)
            check_shape(value, args[1], _join(path, key))
    elif origin is list:
        check(isinstance(node, list), path, f"must be a list, got {_kind(node)}")
        for i, item in enumerate(node):
            check_shape(item, args[0], f"{path}[{i}]")
    elif origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        check_shape(node, inner[0] if len(inner) == 1 else Any, path)  # X | None: as X
    else:
        check(not isinstance(node, (dict, list)), path, f"must be a single value, got {_kind(node)}")


def check_key(key: Any, parent: str) -> None:
    """A mapping key: a non-empty string (YAML also allows numbers, null and empty strings)."""
    check(isinstance(key, str) and key != "", _join(parent, repr(key)) if parent else repr(key),
          "keys must be non-empty names")


def check_override(item: str) -> None:
    """`a.b.c=value` with no empty segment: OmegaConf reports `=5` or `a..b=1` as "Key ''"."""
    check("=" in item, f"override {item!r}", "expected key=value")
    key = item.split("=", 1)[0]
    check(all(key.split(".")), f"override {item!r}", "the key has an empty part")


def check_finite(obj: Any, path: str) -> None:
    """Every float of a dataclass tree is finite: YAML reads `inf`/`.nan` as floats, and the
    `> 0` checks pass inf."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_finite(value, _join(path, f.name))
        elif isinstance(value, float):
            check(math.isfinite(value), _join(path, f.name), f"must be a finite number, got {value}")


MAX_NAME = 128
"""Longest run name: it becomes a directory and a job name (SLURM truncates, file systems stop at 255 bytes)."""


def check_name(value: str, path: str) -> None:
    """A name used as one path component: not '.'/'..', no '/', no NUL, no control character, at most
    MAX_NAME characters. Other characters (spaces, quotes, '$', ';') are fine: everything is quoted
    where it is used."""
    check(value not in ("", ".", ".."), path, f"must be a name, not {value!r}")
    check("/" not in value and "\0" not in value, path, "must not contain '/' or NUL")
    check_printable(value, path)
    check(len(value) <= MAX_NAME, path, f"must be at most {MAX_NAME} characters, got {len(value)}")


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""C0 controls, DEL and C1 controls: ESC, BEL and CR rewrite the terminal of whoever lists them."""


def check_printable(value: str | None, path: str) -> None:
    """No control character: a value that other users see (squeue's job name, a run directory's name)
    must not move their cursor, ring their bell or hide text with CR or ESC sequences."""
    m = _CONTROL.search(value or "")
    check(m is None, path, f"must not contain control characters, got {m.group()!r} at {m.start()}" if m else "")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_env_name(name: str, path: str) -> None:
    """POSIX (portable) variable names: bash's `export` refuses anything else, non-ASCII included."""
    check(bool(_ENV_NAME.fullmatch(name)), path, "is not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)")


_TIME = re.compile(r"(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?")


def check_slurm_time(value: str, path: str) -> None:
    """sbatch --time syntax: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, UNLIMITED/INFINITE."""
    if value.upper() in ("UNLIMITED", "INFINITE"):
        return
    m = _TIME.fullmatch(value)
    check(m is not None, path, f"{value!r} is not a SLURM time (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM:SS)")
    check(any(int(g) for g in m.groups() if g), path, "must be longer than 0")


_MEMORY = re.compile(r"\d+[KMGT]?B?", re.IGNORECASE)
_MEMORY_FLAGS = ("--mem", "--mem-per-cpu", "--mem-per-gpu")
_TIME_FLAGS = ("--time", "-t", "--time-min")


def check_sbatch_option(line: str, path: str) -> None:
    """Values of the sbatch options whose syntax is cheap to know (time and memory); no working
    directory of the job's own (--chdir, -D)."""
    flag, _, value = line.partition("=")
    check_printable(line, path)  # --comment, --job-name: squeue shows them to every user
    check(not _changes_directory(line.split()[0] if line.split() else line), path,
          f"{line!r}: prl's programs run from the run directory (python -m puts the working directory first on "
          "sys.path); a --chdir/-D would choose another, where whoever can write could plant modules")
    if flag in _TIME_FLAGS and value:
        check_slurm_time(value, path)
    if flag in _MEMORY_FLAGS and value:
        check(bool(_MEMORY.fullmatch(value)), path, f"{value!r} is not a SLURM memory size (e.g. 64G, 500M)")


def _changes_directory(option: str) -> bool:
    """--chdir, an abbreviation of it that getopt_long takes (--chd=...), or -D alone or in a bundle (-vD/tmp)."""
    flag = option.partition("=")[0]
    if flag.startswith("--"):
        return len(flag) >= 4 and "--chdir".startswith(flag)
    return flag.startswith("-") and "D" in flag[1:]


_IMPORT_PATH = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?::|\.)([A-Za-z_]\w*)", re.ASCII)


def split_import_path(value: str, path: str) -> tuple[str, str]:
    """`package.module:function` or `package.module.function` -> (module, function)."""
    m = _IMPORT_PATH.fullmatch(value) if value.count(":") <= 1 else None
    check(m is not None, path, f"must be an import path such as my_pkg.losses:my_loss, got {value!r}")
    return m.group(1), m.group(2)


SAMPLING_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (1,), "top_k": (-1, 0), "min_p": (0,), "repetition_penalty": (1,), "presence_penalty": (0,),
    "frequency_penalty": (0,), "min_tokens": (0,), "logit_bias": ({},), "bad_words": ([],),
    "allowed_token_ids": ([],),
}
"""Request fields that change the distribution vLLM samples from, and their values that do not (None: unset)."""


def check_sampling(args: dict, path: str, temperature: float) -> None:
    """Refuse sampling fields under which the tokens are not drawn from softmax(logits / temperature):
    the trainer computes the log-probabilities of exactly that distribution, and the importance
    ratios of tokens drawn from another one are biased (docs/architecture.md, "Sampling")."""
    for key, neutral in SAMPLING_NEUTRAL.items():
        value = args.get(key)
        check(value is None or (not isinstance(value, bool) and value in neutral), f"{path}.{key}",
              f"must be {neutral[0]!r} or unset, got {value!r}: the trainer computes log-probabilities of the "
              f"full softmax at the sampling temperature, and tokens drawn from a distribution that {key} changes "
              "would give biased importance ratios")
    value = args.get("temperature")
    check(value is None or value == temperature, f"{path}.temperature",
          f"{value!r} differs from orchestrator.sampling.temperature={temperature}, the temperature the trainer uses")
