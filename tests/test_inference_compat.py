"""prl.inference.compat picks vLLM 0.32's or 0.26's API; both are faked here, except where the worker
module's wrap of the real vllm.envs is checked.

    pytest tests/test_inference_compat.py
"""

from __future__ import annotations

import sys
import types

import pytest

from prl.inference import compat
from prl.inference.server import _QuietShutdown, quiet_shutdown_logs


def fake_vllm(monkeypatch: pytest.MonkeyPatch, modules: dict[str, dict | None]) -> None:
    """Install fake vLLM modules (name -> attributes; None: the module does not exist)."""
    for name in ("vllm", "vllm.entrypoints", "vllm.entrypoints.launchers", "vllm.entrypoints.openai"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for name, attrs in modules.items():
        module = None if attrs is None else types.SimpleNamespace(**attrs)
        monkeypatch.setitem(sys.modules, name, module)


def parser_from(where: str):
    return lambda parser: (where, parser)


def test_vllm_032_locations(monkeypatch):
    calls = []
    fake_vllm(monkeypatch, {
        "vllm.entrypoints.launchers.cli_args": {"make_arg_parser": parser_from("launchers")},
        "vllm.entrypoints.openai.cli_args": {"make_arg_parser": parser_from("openai")},
        "vllm.logger": {"configure_logging_from_args": calls.append},
    })
    assert compat.make_arg_parser("p") == ("launchers", "p")
    compat.configure_logging("args")
    assert calls == ["args"]


def test_vllm_026_fallbacks(monkeypatch):
    fake_vllm(monkeypatch, {
        "vllm.entrypoints.launchers.cli_args": None,  # no launchers package in 0.26
        "vllm.entrypoints.openai.cli_args": {"make_arg_parser": parser_from("openai")},
        "vllm.logger": {"init_logger": print},  # logging is configured at import; nothing to call
    })
    assert compat.make_arg_parser("p") == ("openai", "p")
    compat.configure_logging("args")  # a no-op, not an ImportError


def test_quiet_shutdown_filter_sits_on_both_launcher_loggers():
    import logging

    quiet_shutdown_logs()
    for name in ("vllm.entrypoints.launchers.launcher", "vllm.entrypoints.launcher", "vllm.v1.engine.async_llm"):
        filters = logging.getLogger(name).filters
        assert any(isinstance(f, _QuietShutdown) for f in filters), name
        for f in [f for f in filters if isinstance(f, _QuietShutdown)]:
            logging.getLogger(name).removeFilter(f)


def test_the_servers_key_names_no_compile_cache():
    """vLLM 0.26 hashed VLLM_API_KEY, a run's own secret, into its compile cache's directory and wrote
    it into that directory's cache_key_factors.json: every new run compiled again. Left out, once."""
    envs = types.SimpleNamespace(compile_factors=lambda: {"VLLM_API_KEY": "s3cret", "VLLM_USE_V2_MODEL_RUNNER": True})
    compat.keep_key_out_of_compile_cache(envs)
    wrapped = envs.compile_factors
    compat.keep_key_out_of_compile_cache(envs)
    assert envs.compile_factors is wrapped and wrapped() == {"VLLM_USE_V2_MODEL_RUNNER": True}


def test_the_worker_module_leaves_the_key_out_of_the_real_vllms_factors(monkeypatch):
    """vLLM imports prl.inference.worker in each worker process before it compiles: that import is
    what wraps the real vllm.envs.compile_factors; two runs' keys then give the same factors."""
    import importlib

    import vllm.envs

    importlib.import_module("prl.inference.worker")
    assert getattr(vllm.envs.compile_factors, "without_key", False)
    monkeypatch.setenv("VLLM_API_KEY", "one run's key")
    first = vllm.envs.compile_factors()
    monkeypatch.setenv("VLLM_API_KEY", "another run's key")
    assert vllm.envs.compile_factors() == first and "VLLM_API_KEY" not in first
