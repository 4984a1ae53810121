"""The tiers (a folder each, its conftest marks its tests: tier_problem keeps folder and markers in
agreement) and what they share: the tiny offline model, real inference servers (started and stopped by
PID), and the expensive runs several test files assert on, each made once per session: one CPU vLLM
server (cpu_server) and one toy RL run on the Slurm test cluster (cluster_reference).

    pytest tests/unit -n 2                      # before every commit: no torchrun, vLLM or cluster
    pytest tests/integration/test_inference.py  # a layer that uses the server
    bash tools/test.sh                          # every tier (as root with the Slurm test cluster): CI
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import ROOT, SFT, SFT_COMMON, final_state, losses, prl, submit_rl, tiny_model_dir
from inference_helpers import API_KEY

from prl.control import slurm

TESTS = ROOT / "tests"
REPORT = "report_at_end"
"""user_properties name of the (title, text) sections tests leave for the end of pytest's output
(report_at_end); properties travel from xdist's workers to the process that prints the summary."""

SHARED_RUNS = ("cluster_reference", "cpu_server", "sft_run")
"""Session fixtures too expensive to make twice: under xdist (tools/test.sh runs pytest -n N
--dist loadgroup) every test that uses one runs on the same worker, so each is made once."""


def xdist_group(item: pytest.Item) -> str | None:
    """The worker group of a test: the shared session run it uses, else its module when it uses a
    fixture the module shares between its tests (made once per worker that runs them), else none."""
    names = item.fixturenames
    for shared in SHARED_RUNS:
        if shared in names:
            return shared
    defs = getattr(item, "_fixtureinfo", None)
    for name in names:
        for fixturedef in (defs.name2fixturedefs.get(name, ()) if defs else ()):
            if fixturedef.scope in ("module", "class") and fixturedef.baseid:
                return item.nodeid.split("::")[0]
    return None


TIERS = {"unit": "unit", "integration": "integration", "cluster": "cluster", "gpu": "gpu", "bench": "bench"}
"""tests/<folder> -> the marker its conftest gives each of its tests: the folder is the tier."""
RESOURCES = {"vllm": "starts a vLLM server", "slurm": "needs the Slurm test cluster", "slow": "takes a minute or more",
             "gpu": "needs a CUDA GPU"}
"""Markers that say what a test needs: none of them in the unit tier, which a contributor runs before every commit."""
RESOURCE_HOMES = {"slurm": ("cluster", "gpu"), "gpu": ("gpu",)}
"""Where a test that needs the resource may live (the unit tier never)."""


def tier_problem(item: pytest.Item) -> str | None:
    """Why a test's folder and markers disagree, or None: a test outside a tier folder, a tier marker
    set by hand that is not its folder's, a resource marker where that tier cannot have it."""
    folder = Path(item.path).relative_to(TESTS).parts[0]
    if folder not in TIERS:
        return f"{item.nodeid}: a test lives in a tier folder of tests/ ({', '.join(TIERS)})"
    marks = {mark.name for mark in item.iter_markers()}
    if others := sorted(marks & set(TIERS.values()) - {TIERS[folder]}):
        return f"{item.nodeid}: marked {', '.join(others)} in tests/{folder}: the folder is the tier"
    if folder == "unit" and (needs := sorted(marks & set(RESOURCES))):
        return f"{item.nodeid}: a unit test {RESOURCES[needs[0]]} ({needs[0]}): it belongs in tests/integration or beyond"
    for mark, homes in RESOURCE_HOMES.items():
        if mark in marks and folder not in homes:
            return f"{item.nodeid}: marked {mark} in tests/{folder}: such tests live in tests/{' or tests/'.join(homes)}"
    return None


def heavy(item: pytest.Item) -> bool:
    return not item.get_closest_marker("unit")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test is in the tier its folder says (tier_problem, a usage error otherwise). Benchmark runs
    marked slow run only when the -m expression names `bench` or `slow`.

    Every test gets its xdist group (xdist_group), and the heavy ones come first, the groups among
    them before the single tests: workers start on the long work, and the short tests fill the end."""
    if problems := [p for item in items if (p := tier_problem(item)) is not None]:
        raise pytest.UsageError("\n".join(problems))
    if not {"bench", "slow"} & set(re.findall(r"\w+", config.getoption("markexpr") or "")):
        # CI's budget (25 minutes on 2 cores): the benchmarks' own minute-long runs (gpu_exactness's CPU
        # run, the loss options) run when asked for, `pytest -m bench tests/bench`, as before the tiers.
        if long_runs := [item for item in items if item.get_closest_marker("bench") and item.get_closest_marker("slow")]:
            config.hook.pytest_deselected(items=long_runs)
            items[:] = [item for item in items if item not in long_runs]
    for item in items:
        if (group := xdist_group(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: (not heavy(item), xdist_group(item) is None))


WORKERS: dict[str, list[float]] = {}
"""xdist worker -> [seconds spent in tests, when its last test ended (monotonic)], in the process that
prints the summary: how evenly the workers shared the session (workers_line)."""
SESSION_START = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)
    if worker is not None:
        busy = WORKERS.setdefault(worker, [0.0, 0.0])
        busy[0] += report.duration
        busy[1] = time.monotonic()


def workers_line() -> str | None:
    """`gw0 busy 1500s, done at 1590s; gw1 ...`: with several workers, where the session's end waited."""
    if not WORKERS:
        return None
    return "; ".join(f"{w} busy {busy:.0f}s, done at {end - SESSION_START:.0f}s"
                     for w, (busy, end) in sorted(WORKERS.items()))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if (line := workers_line()) is not None:
        terminalreporter.write_sep("=", "xdist workers")
        terminalreporter.write_line(line)
    seen = set()
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "teardown":
                continue
            for name, value in getattr(report, "user_properties", ()):
                if name == REPORT and (report.nodeid, *value) not in seen:
                    seen.add((report.nodeid, *value))
                    terminalreporter.write_sep("=", value[0])
                    terminalreporter.write_line(value[1].rstrip("\n"))


@pytest.fixture(autouse=True)
def umask_kept() -> Iterator[None]:
    """prl's commands set their process's umask (077: a run is its owner's alone); one called in-process
    by a test must not hand it to the next test of the worker."""
    mask = os.umask(0o077)
    os.umask(mask)
    yield
    os.umask(mask)


@pytest.fixture
def report_at_end(request: pytest.FixtureRequest) -> Callable[[str, str], None]:
    """report(title, text): `text` in the terminal summary at the end of pytest's output, whether the
    test passes or fails, without -s and under xdist (call it by the test's teardown at the latest)."""
    return lambda title, text: request.node.user_properties.append((REPORT, (title, text)))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tools/make_tiny_model.py built into a fresh directory (a few seconds, no network)."""
    out = tmp_path_factory.mktemp("models") / "tiny-qwen2"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--out", str(out)], check=True)
    return out


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE (tools/make_tiny_model.py --family qwen3_moe: 2 layers, 8 experts, top-2, the
    tiny model's tokenizer) built into a fresh directory."""
    out = tmp_path_factory.mktemp("models") / "tiny-qwen3-moe"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--family", "qwen3_moe",
                    "--out", str(out)], check=True)
    return out


@pytest.fixture(scope="session")
def start_inference_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable]:
    """start(config_yaml, overrides, env) -> a healthy LocalServer on a free port, logging under a
    fresh PRL_LOG_DIR; every server still running is stopped, by PID, at the end of the session."""
    from prl.inference.standalone import start_server

    started = []

    def start(config: Path, overrides: Sequence[str] = (), env: dict[str, str] | None = None):
        work = tmp_path_factory.mktemp("inference")
        server = start_server(config, overrides, output=work / "server.out", log_dir=work / "logs", env=env)
        started.append(server)
        try:
            server.wait_healthy(timeout_s=600)
        except RuntimeError as e:
            pytest.fail(str(e))
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def cpu_server(tiny_model: Path, start_inference_server, tmp_path_factory):
    """The one vLLM server (CPU build, tiny model, float32, the hermes tool-call parser) of tests/integration/test_inference.py,
    test_orchestrator_vllm.py and test_determinism.py, guarded by inference_helpers.API_KEY (clients
    name it with `api_key_env: PRL_TEST_API_KEY`). A token budget of 512 per engine step splits
    batches' prefills over many differently composed steps, and blocks of 32 tokens let the ~70-token
    prompts fill cache blocks: what test_determinism.py needs; the other tests are indifferent to both."""
    config = tmp_path_factory.mktemp("cpu_server") / "inference.yaml"
    config.write_text(
        f"run: {{name: cpu-server, output_dir: {config.parent}/out}}\n"
        f"model: {{name: {tiny_model}, dtype: float32, max_model_len: 512}}\n"
        "inference: {gpus_per_node: 0, enforce_eager: true, api_key_env: PRL_TEST_API_KEY, tool_call_parser: hermes,\n"
        "            env: {VLLM_CPU_KVCACHE_SPACE: '1'},\n"
        # It serves the versions of many tests' runs, all under the session's temp directory.
        f"            weights_root: {tmp_path_factory.getbasetemp()},\n"
        "            extra_args: [--max-num-batched-tokens, '512', --block-size, '32']}\n"
        "orchestrator: {environment: {id: prl.envs.toy}}\n"
    )
    server = start_inference_server(config, env={"PRL_TEST_API_KEY": API_KEY})
    yield server
    server.stop()
    # A requested shutdown ends without a traceback (vLLM's spurious EngineDeadError is filtered).
    shutdown = server.output.read_text().split("[shutdown] API server: shutdown triggered", 1)
    assert len(shutdown) == 2 and "Traceback" not in shutdown[1]


@pytest.fixture
def vllm_server(cpu_server, tiny_model: Path):
    """cpu_server serving the tiny model's own weights: a test before may have loaded others."""
    import httpx

    response = httpx.post(f"{cpu_server.url}/update_weights", json={"path": str(tiny_model)},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert response.status_code == 200, response.text
    return cpu_server


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """The test cluster (tools/slurm_cluster.sh up) must answer; without one the slurm tests are
    skipped, unless PRL_SLURM_REQUIRED=1 (tools/test.sh as root, CI), where that is a failure."""
    ok = shutil.which("sinfo") and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0
    if not ok:
        if os.environ.get("PRL_SLURM_REQUIRED") == "1":
            pytest.fail("PRL_SLURM_REQUIRED=1 but no Slurm cluster answers: run tools/slurm_cluster.sh up")
        pytest.skip("no Slurm cluster: run `tools/slurm_cluster.sh up` (root) to run these tests")


PARTITIONS = [
    "inference.slurm.partition=gpu", "inference.slurm.gres=gpu:2", "inference.cpus_per_node=2",
    "inference.slurm.mem=2G",
    "trainer.slurm.partition=gpu", "trainer.slurm.gres=gpu:1", "trainer.cpus_per_node=3", "trainer.slurm.mem=3G",
    "orchestrator.slurm.partition=cpu", "orchestrator.cpus=1", "orchestrator.slurm.mem=512M",
    "orchestrator.slurm.exclusive=false",
    # Output of both kinds of setup lands in the attempt's logs: the batch script's in job.log,
    # a component's in its <node>.out.
    "slurm.setup=[scontrol show job $SLURM_JOB_ID]",
    "orchestrator.slurm.setup=[echo orchestrator setup on $(hostname)]",
]
"""The reference run's het groups on different partitions (tools/slurm_cluster.sh: `gpu` = the nodes
with fake GPUs, `cpu` = the last node, without), each with resources of its own (tests/cluster/test_slurm_resources.py)."""


@dataclass(frozen=True)
class ClusterReference:
    run: Path
    job_id: str
    state: slurm.JobState
    losses: dict[int, float]
    """Per-step losses of its first (uninterrupted) attempt, read when it ended: tests may resume it."""
    seconds: float
    """Submit to the end of the job."""


def shared_reference(tmp_path_factory: pytest.TempPathFactory, family: str) -> ClusterReference:
    """The reference run of the tiny model of `family` (tiny_model_dir), made once per session by the first
    worker that asks (under a lock in the session's temp directory, which xdist's workers share) and read from
    its record by the others."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    name = f"cluster_reference_{family}"
    record = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the run fails
        if not record.exists():
            t0 = time.monotonic()
            (root / name).mkdir(exist_ok=True)
            # W&B offline (helpers.NO_WANDB): test_resume_step_after_completion checks that its id carries over.
            run, job_id = submit_rl(root / name, f"model.name={tiny_model_dir(family)}", *PARTITIONS,
                                    "run.wandb.mode=offline")
            st = final_state(job_id)
            record.write_text(json.dumps({"run": str(run), "job_id": job_id, "state": dataclasses.asdict(st),
                                          "losses": losses(run), "seconds": time.monotonic() - t0}))
    data = json.loads(record.read_text())
    return ClusterReference(Path(data["run"]), data["job_id"], slurm.JobState(**data["state"]),
                            {int(k): v for k, v in data["losses"].items()}, data["seconds"])


@pytest.fixture(scope="session")
def cluster_reference(slurm_cluster, tmp_path_factory) -> ClusterReference:
    """One uninterrupted toy RL run of the tiny Qwen3-MoE on the test cluster (helpers.RL, het groups on
    partitions of their own: PARTITIONS), for the tests that use its directory: test_slurm_resources.py checks
    its placement, later tests evaluate and finally resume it, so they all run on one xdist worker."""
    return shared_reference(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="session")
def reference_record(slurm_cluster, tmp_path_factory) -> ClusterReference:
    """The same run's record only (state, per-step losses): the reference whose losses every interrupted
    MoE run must reproduce (test_slurm_rl.py's one-node layout, test_chaos.py). Its tests need not share a
    worker: the run is made once per session whichever worker asks first."""
    return shared_reference(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="session")
def dense_reference_record(slurm_cluster, tmp_path_factory) -> ClusterReference:
    """The same run with the tiny dense model: the reference of the data-parallel layout
    (test_slurm_rl.py's preemption run), which vLLM 0.32's CPU build cannot run for an MoE (its MoE layers
    gather the data-parallel ranks' tokens with all_gatherv, which its CPU communicator lacks)."""
    return shared_reference(tmp_path_factory, "qwen2")


@pytest.fixture
def process_group(monkeypatch):
    """A one-rank gloo group in this process, as torchrun gives each trainer rank."""
    import torch.distributed as dist

    monkeypatch.delenv("PRL_LOG_DIR", raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory) -> Path:
    """configs/sft_toy.yaml for 12 steps on the tiny model (--local): the toy prompts answered in vowels.
    The SFT tests of tests/integration/test_e2e_local.py and the reference of the same job preempted on
    the cluster (tests/cluster/test_sft_cluster.py), so they all run on one xdist worker (SHARED_RUNS)."""
    base = tmp_path_factory.mktemp("sft")
    r = prl("submit", str(SFT), "--local", f"run.output_dir={base}", f"model.name={tiny_model_dir()}", *SFT_COMMON,
            cwd=base, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return base / "sft-toy"
