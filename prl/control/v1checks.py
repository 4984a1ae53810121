"""Pre-submit checks of a verifiers v1 environment (`api: v1`), made where its worker will run: in the
environment's own Python (`orchestrator.environment.python`), which has verifiers 0.4; the run's has not.

    from prl.control.v1checks import check_v1_environment
    check_v1_environment(env, timeout_s, "orchestrator.environment", run_env={"PRIME_API_KEY"})

A probe (PROBE, run by that Python) reports what it finds as one JSON line; the rules are applied
here. Refused, each in one line naming the key:
- a package, `env` module or renderer config that Python does not find or accept, a package that
  does not import, `args` its taskset config refuses;
- a harness that installs its program at first use (its `setup()`: verifiers' `null` harness runs uv
  against the network) or needs a container: compute nodes run offline, and prl runs every seat in the
  worker's process;
- a toolset that runs in a remote sandbox service (SANDBOX_SERVICES) unless the run's env names the
  service's key, and one in a container runtime (verifiers installs the toolset's package into it
  with uv at first use).
Importing verifiers v1 takes 3 s of CPU (5-9 s on a loaded 2-core VM): a v1 environment's submit waits for it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Collection

from prl.config import ConfigError, EnvironmentConfig, envref
from prl.run.home import env_worker_python

SANDBOX_SERVICES = {"prime": ("PRIME_API_KEY",), "e2b": ("E2B_API_KEY",), "modal": ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET")}
"""verifiers v1's remote runtimes (their `is_local` is False) and the variables their SDKs read their keys from."""
CONTAINER_RUNTIMES = ("docker", "podman", "apptainer")
"""verifiers v1's local container runtimes: a toolset in one is installed there with uv at first use."""
EXITS = {3: "id", 4: "renderer", 5: "env"}
"""PROBE's early exits (before verifiers is imported) -> the entry's key at fault."""


def check_v1_environment(env: EnvironmentConfig, timeout_s: float, path: str, run_env: Collection[str] = ()) -> None:
    """`path` names the entry; `run_env`: the variables the run's config sets for the orchestrator (`env`,
    `orchestrator.env`), which its environment workers inherit."""
    python = env_worker_python(env.python)
    if not os.access(python, os.X_OK):
        raise ConfigError(f"{path}.python: {python} is not an executable Python (bash tools/setup.sh makes .venv-v1)")
    # The args go by stdin: a resolved reference (a secret) never sits on a command line.
    args = envref.resolve_args(env.args, os.environ, f"{path}.args")
    try:
        probe = subprocess.run([python, "-c", PROBE, env.id, json.dumps(env.renderer), env.env or "", env.harness],
                               input=json.dumps(args), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{path}.python: {python} did not answer within {timeout_s:.0f} s") from None
    said = (probe.stdout.strip().splitlines() or [""])[-1]
    if probe.returncode in EXITS:
        key = EXITS[probe.returncode]
        raise ConfigError(f"{path}.{key}: " + {
            "id": f"no package {env.id!r} in {python}: install it there ({python} -m pip install YOUR_PACKAGE)",
            "env": f"no module {env.env!r} in {python}: install the package that has it there",
            "renderer": said}[key])
    if probe.returncode != 0 or not said.startswith("{"):
        raise ConfigError(f"{path}.python: {python} could not check the environment: "
                          f"{(probe.stderr.strip().splitlines() or ['exit %d' % probe.returncode])[-1]}")
    found = json.loads(said)
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
if importlib.util.find_spec(sys.argv[1]) is None:
    sys.exit(3)
try:
    if sys.argv[3] and importlib.util.find_spec(sys.argv[3]) is None:
        sys.exit(5)
except ModuleNotFoundError:  # its parent package is missing
    sys.exit(5)
renderer = json.loads(sys.argv[2])
if renderer:
    import pydantic
    from renderers.configs import RendererConfig
    try:
        pydantic.TypeAdapter(RendererConfig).validate_python(renderer)
    except pydantic.ValidationError as e:
        print(" ".join(str(e.errors()[0]["msg"]).split())[:300])
        sys.exit(4)

def refuse(key, message):
    print(json.dumps({"refused": {"key": key, "message": " ".join(str(message).split())[:400]}}))
    sys.exit()

import pydantic
from verifiers.v1.harness import Harness
from verifiers.v1.utils import loaders
try:
    taskset = loaders.taskset_class(sys.argv[1])
except Exception as e:
    refuse("id", f"{sys.argv[1]} does not import in {sys.executable}: {type(e).__name__}: {e}")
try:
    config = loaders.taskset_config_type(sys.argv[1]).model_validate({**json.load(sys.stdin), "id": sys.argv[1]})
except pydantic.ValidationError as e:
    error = e.errors()[0]
    refuse("args" + "".join(f".{part}" for part in error["loc"]), error["msg"])
try:
    harness = loaders.harness_class(sys.argv[4])
except Exception as e:
    refuse("harness", f"{sys.argv[4]!r} is no harness in {sys.executable}: {type(e).__name__}: {e}")
toolsets = [*taskset.toolsets(config), *taskset.task_type().toolsets(config.task)]
print(json.dumps({
    "harness": {"class": harness.__name__, "installs": harness.setup is not Harness.setup,
                "needs_container": harness.NEEDS_CONTAINER},
    "toolsets": [{"name": t.server_name or type(t).__name__, "runtime": t.config.runtime.type}
                 for t in toolsets if not getattr(t.config, "url", None)],
}))
"""
"""Run by the environment worker's Python: argv id, renderer (JSON), env, harness; stdin the args (JSON).
Found before anything is imported (exits 3-5); then the taskset, its config and the harness are
loaded and the facts printed as JSON: a toolset with a `url` is a server that already runs (nothing
is started for it) and is left out."""
