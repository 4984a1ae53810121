"""YAML files (with their `defaults:`) + dotted `key=value` overrides -> a checked Config, and back."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from prl.config.envref import check_positions, keep_references
from prl.config.root import Config
from prl.config.trainer import _move_keys
from prl.config.validate import ConfigError, check_override, check_shape


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> list[Any]:
    """The YAML at `path` preceded by the files its `defaults:` list names (relative to it), each
    checked for the schema's shape."""
    if path in seen:
        raise ConfigError(f"{path}: defaults form a cycle")
    node = _load_mapping(path)
    bases = node.pop("defaults", [])
    if not (isinstance(bases, list) and all(isinstance(b, str) and b for b in bases)):
        raise ConfigError(f"{path}: defaults: must be a list of config file names, got {bases!r}")
    try:
        check_shape(node, Config, "")
    except ConfigError as e:
        raise ConfigError(f"{e} (in {path})") from None
    _move_keys(node, f" (in {path})")
    keep_references(node)
    layers: list[Any] = []
    for base in bases:
        layers += _read_yaml((path.parent / base).resolve(), (*seen, path))
    return [*layers, node]


def _load_mapping(path: Path) -> dict:
    """One YAML file as a plain dict; ConfigError naming the file for anything else."""
    try:
        text = _read_regular(path)
        # OmegaConf's loader reads `1e-6` as a float (PyYAML: a string), but it takes a file holding
        # one plain word for a mapping {word: None}; safe_load tells what the top level really is.
        if not isinstance(yaml.safe_load(text), (dict, type(None))):
            raise ConfigError(f"{path}: top level must be a mapping (key: value lines)")
        node = OmegaConf.load(io.StringIO(text))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, OmegaConfBaseException, UnicodeError, ValueError, yaml.YAMLError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{path}: cannot read config: {str(e).splitlines()[0]}") from None
    return OmegaConf.to_container(node) if OmegaConf.is_dict(node) else {}


def _read_regular(path: Path) -> str:
    """The text of a regular file. Opened without blocking and checked on the open descriptor: a FIFO
    (or a device) would hang the reader until someone writes, and a stat() before open() could be
    answered by another file than the one opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket"}
        kind = next((name for test, name in kinds.items() if test(mode)), "a device")
        raise ConfigError(f"{path}: is {kind}, not a config file")
    with open(fd, "rb") as f:
        return f.read().decode("utf-8")


def _override_layer(item: str) -> dict:
    """One `key=value` override as a nested dict, checked for the schema's shape."""
    check_override(item)
    try:
        layer = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
    except (OmegaConfBaseException, ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"override {item!r}: {str(e).splitlines()[0]}") from None
    check_shape(layer, Config, "")
    _move_keys(layer)
    return keep_references(layer)


def _one_line(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    if "issing mandatory value" in msg:
        msg = "missing required value"
    return f"{key}: {msg}" if key else msg


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    """YAML (with its defaults) + `key=value` overrides (later wins) -> validated Config."""
    layers = _read_yaml(Path(path).resolve()) + [_override_layer(item) for item in overrides]
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), *layers))
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e)) from None
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as e:
        # Not expected after check_shape; still one line rather than a traceback.
        raise ConfigError(f"config: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    check_positions(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    """The config as YAML that `load_config` reads back to an equal Config."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
