"""Helpers every config section uses for its per-field checks: each raises ConfigError naming the field path."""

from __future__ import annotations

from prl.config.validate import ConfigError


def _check(ok: bool, path: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{path}: {message}")


def _positive(value: int | float, path: str) -> None:
    _check(value > 0, path, f"must be > 0, got {value}")


def _one_of(value: str, allowed: tuple[str, ...], path: str) -> None:
    _check(value in allowed, path, f"must be one of {', '.join(allowed)}; got {value!r}")


def _single_line(value: str | None, path: str) -> None:
    _check(value is None or "\n" not in value, path, "must be a single line (no newline)")

