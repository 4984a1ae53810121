"""`prl plot` (the PNG opened and checked), `prl watch` (driven under a real tmux, and plain without
one) and `prl completion bash` (sourced into bash, its function called)."""

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from helpers import ROOT, fake_run, prl

from prl.run.rundir import RunDir


def test_plot_writes_a_png_with_four_panels_over_every_attempt(tmp_path):
    mpl = pytest.importorskip("matplotlib")
    mpl.use("Agg")
    import matplotlib.image

    rd = fake_run(tmp_path, steps=12, attempts=3)
    r = prl("plot", str(rd.path))
    assert r.returncode == 0, r.stderr
    png = rd.path / "metrics.png"
    assert r.stdout.strip() == f"wrote {png}" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(png)
    assert img.shape[0] >= 400 and img.shape[1] >= 700
    # Drawn on: the three attempts' default colours (tab:blue, orange, green) are there.
    rgb = (img[..., :3] * 255).round().astype(int).reshape(-1, 3)
    for colour in ((31, 119, 180), (255, 127, 14), (44, 160, 44)):
        assert (abs(rgb - colour).sum(axis=1) < 30).sum() > 50, colour


def test_plot_adds_the_evals_to_the_reward_panel(tmp_path):
    mpl = pytest.importorskip("matplotlib")
    mpl.use("Agg")
    import matplotlib.image

    def magenta_pixels(rd: RunDir) -> int:
        assert prl("plot", str(rd.path)).returncode == 0
        rgb = (matplotlib.image.imread(rd.path / "metrics.png")[..., :3] * 255).round().astype(int).reshape(-1, 3)
        return int((abs(rgb - (255, 0, 255)).sum(axis=1) < 30).sum())

    rd = fake_run(tmp_path, steps=12, attempts=1)
    assert magenta_pixels(rd) == 0
    rd.evals.mkdir()
    for version, reward in ((0, 0.1), (5, 0.3), (10, 0.6)):
        rd.eval_path(version).write_text(f'{{"reward_mean": {reward}, "rollouts": 64}}')
    (rd.evals / "step_12.json").write_text('{"reward_mean": 0.')  # being written: skipped
    assert magenta_pixels(rd) > 50


def test_plot_without_metrics_is_a_usage_error(tmp_path):
    rd = fake_run(tmp_path, steps=0, attempts=1)
    r = prl("plot", str(rd.path), "-o", str(tmp_path / "x.png"))
    assert r.returncode == 2 and "no step metrics yet" in r.stderr and not (tmp_path / "x.png").exists()


def component_logs(rd: RunDir, attempt: int, tag: str) -> None:
    for name in ("inference", "trainer", "orchestrator"):
        d = rd.logs / f"attempt_{attempt}/{name}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "rank_0.log").write_text(f"old {name} line\n{name} says {tag}\n")


def test_watch_plain_without_tmux_shows_each_components_newest_lines(tmp_path):
    rd = fake_run(tmp_path, attempts=2)
    component_logs(rd, 0, "attempt zero")
    component_logs(rd, 1, "attempt one")
    env = dict(os.environ, PATH=str(tmp_path), COLUMNS="180", LINES="20")  # no tmux on this PATH
    r = prl("watch", str(rd.path), "--once", env=env)
    assert r.returncode == 0, r.stderr
    for name in ("inference", "trainer", "orchestrator"):
        assert f"attempt_1/{name}/rank_0" in r.stdout and f"{name} says attempt one" in r.stdout
    assert "attempt zero" not in r.stdout
    row = r.stdout.splitlines()[2]
    assert row.index("trainer says") < row.index("orchestrator says")  # side by side
    stacked = prl("watch", str(rd.path), "--once", "--stacked", env=env).stdout.splitlines()
    assert stacked.index("inference says attempt one") < stacked.index("trainer says attempt one")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed (tools/setup.sh installs it as root)")
def test_watch_under_tmux_opens_three_panes_that_follow_new_attempts(tmp_path):
    rd = fake_run(tmp_path, attempts=1)
    component_logs(rd, 0, "attempt zero")
    session = f"prl-test-{uuid.uuid4().hex[:8]}"
    # A private tmux server (-L): the test never touches the user's sessions.
    tmux = ["tmux", "-L", session]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    watch = f"{sys.executable} -m prl.control.cli watch {rd.path}; sleep 60"
    subprocess.run([*tmux, "-f", "/dev/null", "new-session", "-d", "-s", session, "-x", "240", "-y", "40", watch],
                   env=env, check=True)
    try:
        panes = wait_for(lambda: panes_text(tmux, session), lambda t: len(t) == 4 and
                         all(any(f"{n} says attempt zero" in p for p in t.values()) for n in ("inference", "trainer", "orchestrator")))
        titles = subprocess.run([*tmux, "list-panes", "-t", f"{session}:prl-r", "-F", "#{pane_title}"],
                                capture_output=True, text=True).stdout.split()
        assert titles == ["inference", "trainer", "orchestrator"]
        # A new attempt starts (a requeue): every pane moves on to it.
        component_logs(rd, 1, "attempt one")
        wait_for(lambda: panes_text(tmux, session), lambda t: all(
            any(f"{n} says attempt one" in p for p in t.values()) for n in ("inference", "trainer", "orchestrator")))
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def panes_text(tmux: list[str], session: str) -> dict[str, str]:
    ids = subprocess.run([*tmux, "list-panes", "-s", "-t", session, "-F", "#{pane_id}"],
                         capture_output=True, text=True).stdout.split()
    return {p: subprocess.run([*tmux, "capture-pane", "-p", "-t", p], capture_output=True, text=True).stdout for p in ids}


def wait_for(get, ok, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while True:
        value = get()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out; last seen: {value}")
        time.sleep(0.3)


def test_bash_completion_offers_commands_options_and_choices(tmp_path):
    script = prl("completion", "bash").stdout
    assert "complete -o filenames -F _prl prl" in script

    def complete(*words: str) -> list[str]:
        line = " ".join(["prl", *words])
        cmd = (f"source <({sys.executable} -m prl.control.cli completion bash); COMP_WORDS=(prl {' '.join(words)}); "
               f"COMP_CWORD={len(words)}; _prl; printf '%s\\n' \"${{COMPREPLY[@]}}\"")
        r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert r.returncode == 0, (line, r.stderr)
        return r.stdout.split()

    assert complete("st") == ["status"]
    assert set(complete("")) >= {"submit", "status", "runs", "plot", "watch", "completion", "--version"}
    assert complete("status", "--j") == ["--json"]
    assert complete("logs", "-c", "tr") == ["trainer"]
    (tmp_path / "myrun").mkdir()
    assert complete("status", "my") == ["myrun"]
