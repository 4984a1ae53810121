"""The progress watchdog and readiness deadlines (prl.run.watchdog): a stall is a stack dump, a
`stalled` line naming the component, and exit status 16; never a silent hang.

    pytest tests/unit/test_watchdog.py        # a few seconds (real processes, tiny deadlines)
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from prl.config import Config, EnvironmentConfig, ModelConfig, OrchestratorConfig, RunConfig, WatchdogConfig, to_yaml
from prl.run.ports import free_port
from prl.run.protocol import EXIT_STALLED, STALLED
from prl.run.watchdog import Watchdog, write_once

REPO = Path(__file__).resolve().parents[2]


def test_window_is_the_larger_of_the_floor_and_k_median_steps():
    watchdog = Watchdog("trainer", 0, stall_s=10, stall_factor=3)
    assert watchdog.window() == 10
    watchdog.durations = [1, 5, 4]
    assert watchdog.window() == 12
    assert Watchdog("trainer", 0, stall_s=0, stall_factor=3).window() == math.inf  # 0 disables


def test_write_once_keeps_the_first_cause(tmp_path):
    assert write_once(tmp_path / STALLED, "trainer rank 1: first\n")
    assert not write_once(tmp_path / STALLED, "trainer rank 0: second\n")
    assert (tmp_path / STALLED).read_text() == "trainer rank 1: first\n"
    assert [p.name for p in tmp_path.iterdir()] == [STALLED]


def run_hang(tmp_path: Path, component: str, body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A process with a started watchdog (stall floor 1 s) that then runs `body`."""
    script = textwrap.dedent(f"""
        import threading, time
        from pathlib import Path
        from prl.config import WatchdogConfig
        from prl.run.watchdog import Watchdog
        watchdog = Watchdog.start(WatchdogConfig(stall_minutes=1 / 60), {component!r}, 3, dump_to=Path("rank.log"))
        def waiting_for_godot():
            threading.Event().wait()
    """) + textwrap.dedent(body)
    env = os.environ | {"PRL_LOG_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_no_progress_dumps_every_stack_writes_stalled_and_exits_16(tmp_path):
    proc = run_hang(tmp_path, "trainer", """
        watchdog.progress("batch 7")
        waiting_for_godot()
    """)
    assert proc.returncode == EXIT_STALLED, proc.stderr
    assert (tmp_path / STALLED).read_text().startswith("trainer rank 3: batch 7: nothing for ")
    dump = (tmp_path / "rank.log").read_text()
    assert "waiting_for_godot" in dump
    assert "most recent call first" in dump


def test_a_peers_stalled_file_ends_the_other_ranks_too(tmp_path):
    (tmp_path / STALLED).write_text("trainer rank 0: batch 2: nothing for 9s (limit 9s)\n")
    proc = run_hang(tmp_path, "trainer", "waiting_for_godot()")
    assert proc.returncode == EXIT_STALLED
    assert (tmp_path / STALLED).read_text().startswith("trainer rank 0")  # the first cause stays
    assert "waiting_for_godot" in (tmp_path / "rank.log").read_text()


def test_another_components_stall_is_not_this_ones(tmp_path):
    (tmp_path / STALLED).write_text("orchestrator rank 0: batch 2: nothing for 9s (limit 9s)\n")
    proc = run_hang(tmp_path, "trainer", "time.sleep(3)")
    assert proc.returncode == 0, proc.stderr


def test_orchestrator_ends_as_stalled_when_the_servers_never_answer(tmp_path):
    port = free_port()  # a port nobody listens on
    cfg = Config(
        run=RunConfig(name="r", output_dir=str(tmp_path)),
        model=ModelConfig(name="m"),
        # Chat Completions: model "m" has no tokenizer, which the token route loads before it waits
        # for its servers (prl.orchestrator.tokens.load_tokenizer).
        orchestrator=OrchestratorConfig(environment=EnvironmentConfig(id="prl.envs.toy"), batch_size=16,
                                        rollouts_per_example=4, rollout_route="chat"),
        watchdog=WatchdogConfig(ready_timeout_s=2),
    )
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    logs = tmp_path / "logs"
    env = os.environ | {"PRL_LOG_DIR": str(logs), "PRL_RUN_DIR": str(tmp_path / "run"), "PYTHONPATH": str(REPO),
                        "PRL_INFERENCE_URLS": f"http://127.0.0.1:{port}/v1"}
    proc = subprocess.run([sys.executable, str(REPO / "jobs/orchestrator.py"), str(tmp_path / "config.yaml")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_STALLED, proc.stderr
    stalled = (logs / STALLED).read_text()
    assert stalled.startswith(f"orchestrator rank 0: inference servers answering /health (http://127.0.0.1:{port}/v1)")
    assert "most recent call first" in (logs / "orchestrator/rank_0.log").read_text()
