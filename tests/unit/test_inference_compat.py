"""prl.inference.compat picks vLLM 0.32's or 0.26's API; both are faked here, except where the worker
module's wrap of the real vllm.envs is checked.

    pytest tests/unit/test_inference_compat.py
"""

from __future__ import annotations

import os
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


def test_keys_that_vllm_026_wrote_into_its_compile_cache_are_taken_out(tmp_path, monkeypatch):
    """A resumed run keeps its key: the servers' start takes it out of every cache_key_factors.json an
    earlier start left it in (under VLLM_CACHE_ROOT, else XDG_CACHE_HOME/vllm), keeping the other
    factors, leaving files without one, malformed ones and other files as they are, and naming what
    it could not rewrite."""
    import json

    from loguru import logger

    from prl.inference import server

    root = tmp_path / "vllm" / "torch_compile_cache"
    factors = {"env": {"VLLM_API_KEY": "s3cret", "VLLM_USE_V2_MODEL_RUNNER": True}, "config_hash": "c"}
    leaked = [root / "a1/rank_0_0/backbone/cache_key_factors.json", root / "b2/rank_1_0/cache_key_factors.json",
              root / "c3/rank_0_0/backbone/cache_key_factors.json"]
    clean = root / "d4/rank_0_0/backbone/cache_key_factors.json"
    other = root / "e5/rank_0_0/backbone/computation_graph.py"
    for path in leaked:
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(factors))
    clean.parent.mkdir(parents=True)
    clean.write_text(json.dumps({"env": {"VLLM_API_KEY": None}}))
    other.parent.mkdir(parents=True)
    other.write_text("VLLM_API_KEY")
    (root / "f6/rank_0_0").mkdir(parents=True)
    (root / "f6/rank_0_0/cache_key_factors.json").write_text("{not json")
    unchanged = {p: p.read_text() for p in (clean, other, root / "f6/rank_0_0/cache_key_factors.json")}
    rewrite = compat.write_atomic

    def refused(path, data):  # another user's file in a shared cache (root writes anything: so, faked)
        if path == leaked[2]:
            raise PermissionError(13, "Permission denied")
        rewrite(path, data)
    monkeypatch.setattr(compat, "write_atomic", refused)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    messages: list[str] = []
    sink = logger.add(messages.append, level="WARNING")
    try:
        server.warn_of_keys_in_compile_cache()
    finally:
        logger.remove(sink)
    for path in leaked[:2]:
        assert json.loads(path.read_text()) == {"env": {"VLLM_USE_V2_MODEL_RUNNER": True}, "config_hash": "c"}
    assert "s3cret" in leaked[2].read_text() and {p: p.read_text() for p in unchanged} == unchanged
    assert len(messages) == 2 and "out of 2 file(s)" in messages[0] and str(root) in messages[0]
    assert str(leaked[2]) in messages[1] and "s3cret" not in "".join(messages)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "elsewhere"))
    assert compat.scrub_key_from_compile_cache(os.environ) == ([], [])
    assert compat.compile_cache_root(os.environ) == tmp_path / "elsewhere" / "torch_compile_cache"


def test_the_server_reads_a_model_class_without_a_child_interpreter(tmp_path, monkeypatch):
    """With vLLM's model-info cache empty, the server imports the model's class itself (no child
    interpreter that imports torch and vLLM again: 10-12 s of a cold start on an H200), gives vLLM
    the same answer a child would, keeps it where the next start finds it, and leaves CUDA alone."""
    import subprocess

    from vllm.model_executor.models import registry

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(registry, "_run_in_subprocess", registry._run_in_subprocess)  # put back after the test

    class ChildInterpreter(Exception):
        pass

    def no_child(argv, run=subprocess.run, **kwargs):  # other commands (`file -b python` by the import) go on
        if registry._SUBPROCESS_COMMAND[-1] in argv:
            raise ChildInterpreter(argv)
        return run(argv, **kwargs)
    monkeypatch.setattr(subprocess, "run", no_child)
    qwen2 = registry._LazyRegisteredModel("vllm.model_executor.models.qwen2", "Qwen2ForCausalLM")
    with pytest.raises(ChildInterpreter, match="registry"):  # vLLM's own way, stopped here
        qwen2.inspect_model_cls()
    compat.inspect_models_here()
    info = qwen2.inspect_model_cls()
    assert (info.supports_pp, info.supports_multimodal, info.is_pooling_model) == (True, False, False)
    assert info == registry._ModelInfo.from_model_cls(qwen2.load_model_cls())
    assert (tmp_path / "modelinfos" / "vllm-model_executor-models-qwen2-Qwen2ForCausalLM.json").is_file()
    assert not sys.modules["torch"].cuda.is_initialized()


def test_a_model_class_whose_import_initializes_cuda_is_named(monkeypatch):
    """Were the class's import to initialize CUDA in the server, vLLM would spawn its engine instead of
    forking it: the server says so. A registry without the hook is left as it is."""
    import torch
    from loguru import logger

    registry = types.SimpleNamespace(_run_in_subprocess=None)
    compat.inspect_models_here(registry)
    messages: list[str] = []
    sink = logger.add(messages.append, level="WARNING")
    try:
        assert registry._run_in_subprocess(lambda: "info") == "info" and messages == []
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        assert registry._run_in_subprocess(lambda: "info") == "info"
    finally:
        logger.remove(sink)
    assert len(messages) == 1 and "initialized CUDA" in messages[0] and "spawn" in messages[0]
    bare = types.SimpleNamespace()
    compat.inspect_models_here(bare)
    assert vars(bare) == {}


def test_the_server_keeps_an_idle_connection_longer_than_its_clients(tmp_path, monkeypatch):
    """vLLM's uvicorn closes an idle connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds; httpx's pools
    (the orchestrator's client, verifiers v1's TrainClient) drop theirs after keepalive_expiry. The server's
    must be the longer, or a request sent as the server closes its connection fails (verifiers v1 does not
    retry). What the run's env sets wins."""
    import httpx
    import vllm.envs

    from prl.config import load_config
    from prl.inference.server import KEEP_ALIVE_ENV, export_environment

    (tmp_path / "c.yaml").write_text("run: {name: r, output_dir: /tmp}\nmodel: {name: /models/m}\n"
                                     "inference: {api_key_env: K}\norchestrator: {environment: {id: e}}\n")
    environ = {"K": "k" * 32}
    export_environment(load_config(tmp_path / "c.yaml", []), environ)
    monkeypatch.setenv(KEEP_ALIVE_ENV, environ[KEEP_ALIVE_ENV])
    assert vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE > httpx.Limits().keepalive_expiry
    environ = {"K": "k" * 32}
    export_environment(load_config(tmp_path / "c.yaml", [f"inference.env.{KEEP_ALIVE_ENV}=3"]), environ)
    assert environ[KEEP_ALIVE_ENV] == "3"
