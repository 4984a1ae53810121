"""Pre-submit checks of the modules a config names: each environment's, and a custom loss's (part of
prl.control.checks.check_before_submit).

    from prl.control.envchecks import check_environments
    check_environments(cfg)   # raises ConfigError naming the entry's key

They keep the control plane free of torch: a module is located without running any package's
__init__, and `load_environment`'s signature read from its source with `ast`; only when that cannot
decide is the module imported, in a subprocess with a time limit. A verifiers v1 environment is
checked in its worker's Python, which imports the package and verifiers (seconds; prl.control.v1checks).
A custom loss module is never imported here (it imports torch): located, and its source searched for
the function's name; the trainer imports it at start.
"""

from __future__ import annotations

import ast
import difflib
import json
import subprocess
import sys
from collections.abc import Collection
from dataclasses import dataclass
from importlib.machinery import ModuleSpec, PathFinder
from importlib.util import find_spec
from pathlib import Path

from prl.config import Config, EnvironmentConfig, LossConfig
from prl.config.validate import ConfigError, check, split_import_path, warn
from prl.control.v1checks import check_v1_environment, v1_problems

ENV_IMPORT_TIMEOUT_S = 60.0
"""Limit for importing an environment module whose signature the source does not show (verifiers
alone takes seconds); past it the check is skipped with a warning, the orchestrator checks at start."""


TOOL_ENVS = ("ToolEnv", "StatefulToolEnv", "SandboxEnv", "PythonEnv")
"""verifiers' environments that give the model tools, by the names a module's source would use."""


def check_tools_have_parser(cfg: Config) -> None:
    """An environment whose source builds one of TOOL_ENVS needs the servers' tool-call parser (without
    one they answer 400 to every request with tools). What the source does not show (tools built in an
    imported module) the orchestrator refuses at start (prl.orchestrator.dataset.require_tool_parser)."""
    if cfg.inference.parses_tool_calls:
        return
    orch = cfg.orchestrator
    evals = [(env, f"orchestrator.eval.environments[{i}]") for i, env in enumerate(orch.eval.environments)]
    for env, path in [*zip(orch.train_environments, orch.environment_paths), *evals]:
        spec = locate(env.id)
        used = tool_env_in_source(spec) if spec is not None else None
        check(used is None, "inference.tool_call_parser",
              f"{path} ({env.id}) gives the model tools ({used} in its source), and the servers have no parser "
              "of tool calls: set vLLM's parser of the model family (e.g. inference.tool_call_parser=hermes for Qwen2.5)")


def source_tree(spec: ModuleSpec) -> ast.Module | None:
    """The module's parsed source; None when it has no Python source, or one that cannot be read or parsed."""
    if not (spec.origin and spec.origin.endswith(".py")):
        return None
    try:
        return ast.parse(Path(spec.origin).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None


def tool_env_in_source(spec: ModuleSpec) -> str | None:
    """The first of TOOL_ENVS the module's source names (as a name or an attribute), None when it
    names none or there is no source to read."""
    tree = source_tree(spec)
    if tree is None:
        return None
    for node in ast.walk(tree):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name in TOOL_ENVS:
            return name
    return None


@dataclass(frozen=True)
class Signature:
    params: tuple[str, ...]
    """Names that can be passed by keyword."""
    required: tuple[str, ...]
    """Those without a default."""
    any_kwargs: bool
    """`**kwargs`: every name is accepted."""


def check_environments(cfg: Config) -> None:
    """Every training environment, and every eval environment of its own (one written as a training entry
    is that entry, checked once), refused in the config's order. The v1 entries are probed first, all at
    once (prl.control.v1checks.v1_problems: one interpreter per worker Python, each import of verifiers 3-9 s)."""
    orch, run_env = cfg.orchestrator, {*cfg.env, *cfg.orchestrator.env}  # what the v1 workers inherit
    entries = list(zip(orch.train_environments, orch.environment_paths))
    entries += [(env, f"orchestrator.eval.environments[{i}]") for i, env in enumerate(orch.eval.environments)
                if not any(env.loads_as(train) for train in orch.train_environments)]
    v1 = [(env, path) for env, path in entries if env.api == "v1"]
    problems = dict(zip((path for _, path in v1), v1_problems(v1, ENV_IMPORT_TIMEOUT_S, run_env)))
    for env, path in entries:
        if env.api != "v1":
            check_environment(env, path=path, run_env=run_env)
        elif problems[path] is not None:
            raise problems[path]


def check_environment(env: EnvironmentConfig, timeout_s: float = ENV_IMPORT_TIMEOUT_S,
                      path: str = "orchestrator.environment", run_env: Collection[str] = ()) -> None:
    """The module exists and its `load_environment` accepts `env.args`; `path` names the entry. An `api: v1`
    package is checked in its worker's Python (prl.control.v1checks); `run_env`: the variables its worker gets."""
    if env.api == "v1":
        return check_v1_environment(env, timeout_s, path, run_env)
    spec = locate(env.id)
    if spec is None and not _importable(env.id, timeout_s):
        raise ConfigError(f"{path}.id: no module named {env.id!r}{did_you_mean(env.id)}")
    sig = signature_from_source(spec) if spec is not None else None
    if sig is None:
        sig = signature_by_import(env.id, timeout_s, path)
    if sig is None:
        return
    where = f"{env.id}.load_environment"
    for key in env.args:
        check(sig.any_kwargs or key in sig.params, f"{path}.args.{key}",
              f"not a parameter of {where} (accepts: {', '.join(sig.params) or 'nothing'})")
    missing = [p for p in sig.required if p not in env.args]
    check(not missing, f"{path}.args", f"{where} needs {', '.join(missing)}")


def check_custom_loss(loss: LossConfig, timeout_s: float = ENV_IMPORT_TIMEOUT_S) -> None:
    """`trainer.loss.custom` names a module that exists and, as far as its source tells, the function."""
    if loss.type != "custom":
        return
    module, name = split_import_path(loss.custom, "trainer.loss.custom")
    spec = locate(module)
    if spec is None and not _importable(module, timeout_s):
        raise ConfigError(f"trainer.loss.custom: no module named {module!r} (the trainer imports it: installed, or "
                          "on PYTHONPATH through trainer.env)")
    check(spec is None or may_define(spec, name), "trainer.loss.custom", f"{module} ({spec and spec.origin}) defines no {name}")


def may_define(spec: ModuleSpec, name: str) -> bool:
    """False only when the module's source surely binds no `name` (no def, class, assignment or
    import of it, no `import *`, no module `__getattr__`); True when there is no source to read."""
    tree = source_tree(spec)
    if tree is None:
        return True
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.alias):
            bound.add(node.asname or node.name.split(".")[0])
    return bool({name, "*", "__getattr__"} & bound)


def locate(module: str) -> ModuleSpec | None:
    """The module's spec, found without running any package's __init__ (which may import torch)."""
    parts = module.split(".")
    spec = find_spec(parts[0]) if parts[0] not in sys.modules else sys.modules[parts[0]].__spec__
    for i in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = PathFinder.find_spec(".".join(parts[: i + 1]), list(spec.submodule_search_locations))
    return spec


def did_you_mean(module: str) -> str:
    """`; did you mean X?` over the shipped environments and the modules next to the named one."""
    parent = module.rpartition(".")[0]
    spec = locate(parent) if parent else None
    places = [(parent, d) for d in (spec.submodule_search_locations or [])] if spec else []
    places.append(("prl.envs", str(Path(__file__).parent.parent / "envs")))
    names = {f"{pkg}.{p.stem}" for pkg, d in places for p in Path(d).glob("*.py") if p.stem != "__init__"}
    close = difflib.get_close_matches(module, sorted(names), n=1)
    return f"; did you mean {close[0]}?" if close else ""


def signature_from_source(spec: ModuleSpec) -> Signature | None:
    """load_environment's parameters from a plain top-level `def`; None when the source cannot say
    (no source, imported or assigned, decorated)."""
    tree = source_tree(spec)
    if tree is None:
        return None
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "load_environment"]
    if not defs or defs[-1].decorator_list:
        return None
    a = defs[-1].args
    positional = [*a.posonlyargs, *a.args]
    required = [p.arg for p in positional[: len(positional) - len(a.defaults)]]
    required += [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    params = [p.arg for p in (*a.args, *a.kwonlyargs)]
    return Signature(tuple(params), tuple(r for r in required if r in params), a.kwarg is not None)


_PROBE = """
import importlib, inspect, json, sys
try:
    f = getattr(importlib.import_module(sys.argv[1]), "load_environment", None)
except Exception as e:
    print(json.dumps({"error": f"cannot import {sys.argv[1]}: {type(e).__name__}: {e}".splitlines()[0]})); sys.exit()
if not callable(f):
    print(json.dumps({"error": f"{sys.argv[1]} has no load_environment()"})); sys.exit()
ps = [p for p in inspect.signature(f).parameters.values() if p.kind not in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)]
print(json.dumps({"params": [p.name for p in ps if p.kind != p.VAR_KEYWORD],
                  "required": [p.name for p in ps if p.default is p.empty and p.kind != p.VAR_KEYWORD],
                  "any_kwargs": any(p.kind == p.VAR_KEYWORD for p in ps)}))
"""


def _python(code: str, *args: str, timeout_s: float) -> str | None:
    """Last stdout line of `python -c code args`; None (with a warning) when it takes too long."""
    try:
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        warn(f"importing {args[0]} took over {timeout_s:.0f}s; not checked here (the orchestrator checks at start)")
        return None
    lines = r.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def _importable(module: str, timeout_s: float) -> bool:
    """Finders other than the path finder (editable installs, zips) can still know it."""
    code = "import importlib.util as u, sys\ntry: print(u.find_spec(sys.argv[1]) is not None)\nexcept ImportError: print(False)"
    out = _python(code, module, timeout_s=timeout_s)
    return out != "False"


def signature_by_import(module: str, timeout_s: float,
                        path: str = "orchestrator.environment") -> Signature | None:
    out = _python(_PROBE, module, timeout_s=timeout_s)
    if out is None:
        return None
    try:
        info = json.loads(out)
    except json.JSONDecodeError:
        raise ConfigError(f"{path}.id: importing {module} failed") from None
    if "error" in info:
        raise ConfigError(f"{path}.id: {info['error']}")
    return Signature(tuple(info["params"]), tuple(info["required"]), info["any_kwargs"])


