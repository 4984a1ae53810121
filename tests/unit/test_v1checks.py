"""`prl submit`'s checks of a verifiers v1 environment (prl.control.v1checks), made in the environment
worker's real Python (.venv-v1, verifiers 0.4) on real v1 objects: prl_calc_v1's taskset with its
toolset placed by `args`, verifiers' own harnesses, a package that does not import.

    pytest tests/unit/test_v1checks.py
"""

import os

import pytest
from helpers import ROOT

from prl.config import ConfigError, EnvironmentConfig
from prl.control.v1checks import check_harness, check_toolset, check_v1_environment, v1_problems

V1_PYTHON = ROOT / ".venv-v1/bin/python"
pytestmark = pytest.mark.skipif(not V1_PYTHON.exists() and os.environ.get("CI") != "true",
                                reason="needs .venv-v1 (tools/setup.sh)")
ENTRY = "orchestrator.environment"


def refusal(run_env=(), **env) -> str:
    """The one line `prl submit` refuses the entry with."""
    cfg = EnvironmentConfig(api="v1", python=str(V1_PYTHON), **env)
    with pytest.raises(ConfigError) as e:
        check_v1_environment(cfg, 120, ENTRY, run_env)
    assert "\n" not in str(e.value)
    return str(e.value)


CASES = [
    ({"id": "prl_toy_v1", "renderer": {"name": "qwen33"}}, ".renderer:", "'qwen3'"),
    ({"id": "prl_toy_v1", "renderer": {"name": "qwen3", "thinking": True}}, ".renderer:", "Extra"),
    ({"id": "no_such_taskset"}, ".id:", "no package 'no_such_taskset'"),
    ({"id": "prl_calc_v1", "args": {"num_examples": "many"}}, ".args.num_examples:", "valid integer"),
    ({"id": "prl_calc_v1"}, None, None),
]


def test_submit_checks_the_package_renderer_and_args_in_the_workers_python(monkeypatch):
    """Checked where the worker will run (the run's Python has neither verifiers v1 nor renderers): every
    entry of one Python in one interpreter, each refused (or not) on its own, in order."""
    import subprocess

    started = []
    popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda args, **kw: started.append(args[0]) or popen(args, **kw))
    entries = [(EnvironmentConfig(api="v1", python=str(V1_PYTHON), **env), f"orchestrator.environments[{i}]")
               for i, (env, _, _) in enumerate(CASES)]
    problems = v1_problems(entries, 120)
    assert started == [str(V1_PYTHON)]
    for i, ((_, key, says), problem) in enumerate(zip(CASES, problems, strict=True)):
        if key is None:
            assert problem is None
            continue
        line = str(problem)
        assert line.startswith(f"orchestrator.environments[{i}]{key}") and says in line and "\n" not in line, line


def test_a_package_that_does_not_import_is_refused(tmp_path, monkeypatch):
    """Refused for what it raised; what it printed first (a line like the probe's own) is not taken for a
    result: the entry after it in the same interpreter is judged on its own line."""
    (tmp_path / "broken_v1.py").write_text("import verifiers.v1 as vf\nprint('{\"refused\": 1}')\n"
                                           "raise RuntimeError('no dataset here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    entries = [(EnvironmentConfig(api="v1", python=str(V1_PYTHON), id=name), f"orchestrator.environments[{i}]")
               for i, name in enumerate(("broken_v1", "prl_calc_v1"))]
    broken, calc = v1_problems(entries, 120)
    line = str(broken)
    assert line.startswith("orchestrator.environments[0].id: broken_v1 does not import") and "no dataset here" in line
    assert calc is None


def test_a_harness_that_installs_at_first_use_or_needs_a_container_is_refused():
    """verifiers' null harness (its setup runs uv against the network) as the probe finds it; a harness
    that needs a container, from the facts the probe reports (each probe imports verifiers: 3 s of CPU)."""
    line = refusal(id="prl_toy_v1", harness="null")
    assert line.startswith(f"{ENTRY}.harness: 'null' (NullHarness) installs its program at first use") and \
        "use prl_chat" in line, line
    with pytest.raises(ConfigError, match=rf"^{ENTRY}\.harness: 'box' \(BoxHarness\) needs a container runtime"):
        check_harness({"class": "BoxHarness", "installs": False, "needs_container": True}, "box", ENTRY)


def test_a_toolset_in_a_remote_sandbox_needs_the_services_key_in_the_runs_env():
    """prl_calc_v1's toolset moved by `args` into Prime's sandboxes (a remote service) or a local docker
    runtime (installed with uv at first use) is refused; with the key named, the remote one passes; in the
    worker (subprocess, the default) it passes."""
    prime = {"id": "prl_calc_v1", "args": {"tools": {"runtime": {"type": "prime"}}}}
    line = refusal(**prime)
    assert line.startswith("env.PRIME_API_KEY: prl_calc_v1's toolset 'calc' (orchestrator.environment) runs in a "
                           "prime runtime, a remote sandbox service"), line
    check_v1_environment(EnvironmentConfig(api="v1", python=str(V1_PYTHON), **prime), 120, ENTRY, {"PRIME_API_KEY"})
    # The other runtimes, from the facts the probe reports: modal needs both of its variables.
    with pytest.raises(ConfigError, match=r"^env\.MODAL_TOKEN_SECRET: x's toolset 'calc'"):
        check_toolset({"name": "calc", "runtime": "modal"}, "x", ENTRY, {"MODAL_TOKEN_ID"})
    with pytest.raises(ConfigError, match=rf"^{ENTRY}\.args: x's toolset 'calc' runs in a docker runtime, into which "
                       "verifiers installs its package with uv"):
        check_toolset({"name": "calc", "runtime": "docker"}, "x", ENTRY, ())
    check_toolset({"name": "calc", "runtime": "subprocess"}, "x", ENTRY, ())


@pytest.mark.parametrize("body, says", [
    ("echo 'this is not python' >&2; exit 7", "could not check the environment: this is not python"),
    ("exec sleep 30", "did not answer within 1 s"),
])
def test_a_worker_python_that_fails_or_hangs_is_named_for_each_of_its_entries(tmp_path, body, says):
    """An interpreter that exits without a line, or hangs past the timeout: each of its entries is refused
    naming its `python` key; an entry of another (missing) Python is refused for its own reason."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n{body}\n")
    fake.chmod(0o755)
    entries = [(EnvironmentConfig(api="v1", id="prl_calc_v1", python=str(fake)), "orchestrator.environments[0]"),
               (EnvironmentConfig(api="v1", id="prl_toy_v1", python=str(fake)), "orchestrator.environments[1]"),
               (EnvironmentConfig(api="v1", id="prl_toy_v1", python=str(tmp_path / "none")), "orchestrator.environments[2]")]
    first, second, third = map(str, v1_problems(entries, 1))
    assert first == f"orchestrator.environments[0].python: {fake} {says}"
    assert second == f"orchestrator.environments[1].python: {fake} {says}"
    assert third.startswith(f"orchestrator.environments[2].python: {tmp_path / 'none'} is not an executable Python")
