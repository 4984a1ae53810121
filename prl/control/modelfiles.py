"""A model's files as the login node sees them, read as JSON (no transformers, no torch): the Hugging Face
cache's place, a model's directory (its own, or the newest cached snapshot of a hub id), its config.

    from prl.control.modelfiles import hf_cache, model_files, model_experts
    model_files("Qwen/Qwen3-30B-A3B", hf_cache(os.environ))   # the snapshot directory, or None
"""

from __future__ import annotations

import json
import os
from pathlib import Path

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""config.json keys that give an MoE's expert count (Qwen2/3-MoE and OLMoE; Mixtral; DeepSeek)."""


def hf_cache(environ: dict[str, str]) -> Path:
    """huggingface_hub's cache directory, by its own rules (importing it costs ~0.3 s)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if environ.get(var):
            return Path(os.path.expanduser(environ[var]))
    xdg = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.path.expanduser(environ.get("HF_HOME") or os.path.join(xdg, "huggingface"))) / "hub"


def model_files(name: str, cache: Path) -> Path | None:
    """The directory holding a model's config.json and tokenizer: `name` itself, or its newest snapshot in
    the Hugging Face cache `cache`; None where neither is here."""
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        return path
    snapshots = cache / f"models--{name.replace('/', '--')}" / "snapshots"
    found = sorted((s for s in snapshots.glob("*") if (s / "config.json").is_file()), key=lambda s: s.stat().st_mtime)
    return found[-1] if found else None


def model_experts(name: str, cache: Path) -> int | None:
    """The expert count in a model's config.json: 0 for a dense model, None where there is no config here to
    read (a hub id not in the cache: unknown, not dense)."""
    files = model_files(name, cache)
    try:
        config = json.loads((files / "config.json").read_text()) if files is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return max((v for k in EXPERT_COUNT_KEYS if isinstance(v := text.get(k), int)), default=0)
