"""Pre-submit checks of a verifiers v1 environment (`api: v1`), made where its worker will run: in the
environment's own Python (`orchestrator.environment.python`), which has verifiers 0.4; the run's has not.

    from prl.control.v1checks import check_v1_environment
    check_v1_environment(env, timeout_s, "orchestrator.environment", run_env={"PRIME_API_KEY"})

A probe (PROBE, run by that Python) reports what it finds as one JSON line per entry, every entry of one
Python in one interpreter (v1_problems); the rules are applied here. Refused, each in one line naming the key:
- a package, `env` module or renderer config that Python does not find or accept, a package that
  does not import, `args` its taskset config refuses;
- a harness that installs its program at first use (its `setup()`: verifiers' `null` harness runs uv
  against the network) or needs a container: compute nodes run offline, and prl runs every seat in the
  worker's process;
- a toolset that runs in a remote sandbox service (SANDBOX_SERVICES) unless the run's env names the
  service's key, and one in a container runtime (verifiers installs the toolset's package into it
  with uv at first use).
Importing verifiers v1 takes 3 s of CPU (5-9 s on a loaded 2-core VM): a v1 run's submit waits for it once
per worker Python, whatever its number of v1 entries.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Collection

from prl.config import ConfigError, EnvironmentConfig, envref
from prl.run.home import env_worker_python

SANDBOX_SERVICES = {"prime": ("PRIME_API_KEY",), "e2b": ("E2B_API_KEY",), "modal": ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET")}
"""verifiers v1's remote runtimes (their `is_local` is False) and the variables their SDKs read their keys from."""
CONTAINER_RUNTIMES = ("docker", "podman", "apptainer")
"""verifiers v1's local container runtimes: a toolset in one is installed there with uv at first use."""


def check_v1_environment(env: EnvironmentConfig, timeout_s: float, path: str, run_env: Collection[str] = ()) -> None:
    """`path` names the entry; `run_env`: the variables the run's config sets for the orchestrator (`env`,
    `orchestrator.env`), which its environment workers inherit."""
    if (problem := v1_problems([(env, path)], timeout_s, run_env)[0]) is not None:
        raise problem


def v1_problems(entries: list[tuple[EnvironmentConfig, str]], timeout_s: float,
                run_env: Collection[str] = ()) -> list[ConfigError | None]:
    """What refuses each (entry, path), or None: every entry probed at once, one interpreter per worker
    Python, which imports verifiers once for all of its entries (3 entries of one Python: 5 CPU-s instead of
    15, tests/unit/test_v1checks.py)."""
    problems: list[ConfigError | None] = [None] * len(entries)
    batches: dict[str, list[int]] = {}
    payloads: dict[int, dict] = {}
    for i, (env, path) in enumerate(entries):
        python = env_worker_python(env.python)
        try:
            if not os.access(python, os.X_OK):
                raise ConfigError(f"{path}.python: {python} is not an executable Python (bash tools/setup.sh makes .venv-v1)")
            # The args go by stdin: a resolved reference (a secret) never sits on a command line.
            payloads[i] = {"id": env.id, "renderer": env.renderer, "env": env.env or "", "harness": env.harness,
                           "args": envref.resolve_args(env.args, os.environ, f"{path}.args")}
        except ConfigError as e:
            problems[i] = e
            continue
        batches.setdefault(python, []).append(i)
    found = _probe_all(batches, payloads, timeout_s)
    for python, indices in batches.items():
        results, failure = found[python]
        for k, i in enumerate(indices):
            env, path = entries[i]
            try:
                if k >= len(results):  # the interpreter stopped (or hung) before this entry's line
                    raise ConfigError(f"{path}.python: {python} {failure}")
                judge(results[k], env, path, python, run_env)
            except ConfigError as e:
                problems[i] = e
    return problems


def _probe_all(batches: dict[str, list[int]], payloads: dict[int, dict], timeout_s: float) -> dict[str, tuple[list, str]]:
    """PROBE run by each Python on its entries, side by side: {python: (one result per entry it got to,
    why it got no further)}."""
    procs = {}
    for python, indices in batches.items():
        # A pipe of our own: the input goes in before any probe is waited for (communicate's input would
        # serialize them), and never through a file (the args hold resolved secrets).
        read, write = os.pipe()
        procs[python] = subprocess.Popen([python, "-c", PROBE], stdin=read, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
        os.close(read)
        try:
            with open(write, "w") as pipe:  # read whole at the child's start
                pipe.write(json.dumps([payloads[i] for i in indices]))
        except BrokenPipeError:  # it ended first: what it said, or its exit status, names the failure below
            pass
    deadline, found = time.monotonic() + timeout_s, {}
    for python, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            failure = ("could not check the environment: "
                       f"{(err.strip().splitlines() or ['exit %d' % proc.returncode])[-1]}")
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            failure = f"did not answer within {timeout_s:.0f} s"
        found[python] = ([json.loads(line) for line in out.splitlines() if line.startswith("{")], failure)
    return found


def judge(found: dict, env: EnvironmentConfig, path: str, python: str, run_env: Collection[str]) -> None:
    """PROBE's result for one entry -> ConfigError naming its key, or nothing."""
    if "missing" in found:
        key = found["missing"]
        raise ConfigError(f"{path}.{key}: " + {
            "id": f"no package {env.id!r} in {python}: install it there ({python} -m pip install YOUR_PACKAGE)",
            "env": f"no module {env.env!r} in {python}: install the package that has it there",
            "renderer": found.get("said", "")}[key])
    if "refused" in found:
        raise ConfigError(f"{path}.{found['refused']['key']}: {found['refused']['message']}")
    check_harness(found["harness"], env.harness, path)
    for toolset in found["toolsets"]:
        check_toolset(toolset, env.id, path, run_env)


def check_harness(harness: dict, harness_id: str, path: str) -> None:
    """The harness runs in the worker's process and installs nothing (prl_chat, the default, does so)."""
    what = f"{harness_id!r} ({harness['class']})"
    if harness["installs"]:
        raise ConfigError(f"{path}.harness: {what} installs its program at first use ({harness['class']}.setup; "
                          "verifiers' null harness runs uv against the network), and compute nodes run offline: "
                          "use prl_chat (the default), the null harness's chat loop in the worker's process")
    if harness["needs_container"]:
        raise ConfigError(f"{path}.harness: {what} needs a container runtime (NEEDS_CONTAINER), and prl runs every "
                          "seat in the worker's process: use prl_chat (the default)")


def check_toolset(toolset: dict, env_id: str, path: str, run_env: Collection[str]) -> None:
    """A toolset served where the worker runs, or in a remote service whose key the run names."""
    runtime, name = toolset["runtime"], toolset["name"]
    if runtime in CONTAINER_RUNTIMES:
        raise ConfigError(f"{path}.args: {env_id}'s toolset {name!r} runs in a {runtime} runtime, into which verifiers "
                          "installs its package with uv at first use (compute nodes run offline): run it in the "
                          "worker, runtime: {type: subprocess}")
    missing = [var for var in SANDBOX_SERVICES.get(runtime, ()) if var not in run_env]
    if missing:
        raise ConfigError(f"env.{missing[0]}: {env_id}'s toolset {name!r} ({path}) runs in a {runtime} runtime, a "
                          f"remote sandbox service, and the run's env names no {' or '.join(missing)} for it: set "
                          f"env.{missing[0]} (e.g. '${{oc.env:{missing[0]}}}'), or run the toolset in the worker, "
                          "runtime: {type: subprocess}")


PROBE = """import importlib.util, json, sys

def refuse(key, message):
    return {"refused": {"key": key, "message": " ".join(str(message).split())[:400]}}

def probe(entry):
    if importlib.util.find_spec(entry["id"]) is None:
        return {"missing": "id"}
    try:
        if entry["env"] and importlib.util.find_spec(entry["env"]) is None:
            return {"missing": "env"}
    except ModuleNotFoundError:  # its parent package is missing
        return {"missing": "env"}
    import pydantic
    if entry["renderer"]:
        from renderers.configs import RendererConfig
        try:
            pydantic.TypeAdapter(RendererConfig).validate_python(entry["renderer"])
        except pydantic.ValidationError as e:
            return {"missing": "renderer", "said": " ".join(str(e.errors()[0]["msg"]).split())[:300]}
    from verifiers.v1.harness import Harness
    from verifiers.v1.utils import loaders
    try:
        taskset = loaders.taskset_class(entry["id"])
    except Exception as e:
        return refuse("id", f"{entry['id']} does not import in {sys.executable}: {type(e).__name__}: {e}")
    try:
        config = loaders.taskset_config_type(entry["id"]).model_validate({**entry["args"], "id": entry["id"]})
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        return refuse("args" + "".join(f".{part}" for part in error["loc"]), error["msg"])
    try:
        harness = loaders.harness_class(entry["harness"])
    except Exception as e:
        return refuse("harness", f"{entry['harness']!r} is no harness in {sys.executable}: {type(e).__name__}: {e}")
    toolsets = [*taskset.toolsets(config), *taskset.task_type().toolsets(config.task)]
    return {
        "harness": {"class": harness.__name__, "installs": harness.setup is not Harness.setup,
                    "needs_container": harness.NEEDS_CONTAINER},
        "toolsets": [{"name": t.server_name or type(t).__name__, "runtime": t.config.runtime.type}
                     for t in toolsets if not getattr(t.config, "url", None)],
    }

results, sys.stdout = sys.stdout, sys.stderr  # what a package prints as it loads is not a result line
for entry in json.load(sys.stdin):
    results.write(json.dumps(probe(entry)) + "\\n")
    results.flush()
"""
"""Run by the environment worker's Python on its entries (stdin: a JSON list of id, renderer, env, harness
and args each), one JSON line per entry, in order. What is missing (the package, the `env` module, a
valid renderer config) is found before verifiers is imported; then the taskset, its config and the
harness are loaded and the facts printed: a toolset with a `url` is a server that already runs (nothing
is started for it) and is left out. An entry whose check raises ends the interpreter: the entries from
it on get no line, and the caller names the first of them with the interpreter's last error line."""
