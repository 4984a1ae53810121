"""`prl watch RUN`: the inference, trainer and orchestrator logs side by side (or stacked), following
new attempts as the run is requeued or resumed.

    prl watch RUN              # tmux: one pane per component, each `prl logs RUN -c NAME -f`
    prl watch RUN --stacked    # panes above each other (narrow terminals)
    prl watch RUN --plain      # no tmux: this terminal is redrawn every second; --once: one frame

Inside tmux the panes open in a new window of the current session; outside, in a session named
prl-RUNNAME that this command attaches to (detach with C-b d; `prl watch` again re-attaches).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time

from prl.config import ConfigError, load_config
from prl.control.logview import log_files, prefix
from prl.run.protocol import RL_NAMES
from prl.run.rundir import RunDir


def components(rd: RunDir) -> tuple[str, ...]:
    """The run's components, a pane each (an SFT job: the trainer alone); all three if its config
    cannot be read."""
    try:
        return load_config(rd.config).components
    except (ConfigError, OSError):
        return RL_NAMES


def pane_command(rd: RunDir, component: str, lines: int = 200) -> str:
    """What a pane runs: `prl logs -f` of one component (newest attempt, then every later one)."""
    argv = [sys.executable, "-m", "prl.control.cli", "logs", str(rd.path), "-c", component, "-f", "-n", str(lines)]
    # A tmux server started earlier does not have this shell's environment: carry prl's import path.
    env = [f"PYTHONPATH={os.environ['PYTHONPATH']}"] if os.environ.get("PYTHONPATH") else []
    return shlex.join(["env", *env, *argv])


def tmux_commands(rd: RunDir, stacked: bool, inside: bool) -> list[list[str]]:
    """The tmux calls that build the view: one window, a pane per component with its name on top."""
    session = session_name(rd)
    first, *rest = components(rd)
    if inside:
        calls = [["tmux", "new-window", "-n", session, pane_command(rd, first)]]
        target = ""
    else:
        calls = [["tmux", "new-session", "-d", "-s", session, "-n", "logs", pane_command(rd, first)]]
        target = f"{session}:logs"
    t = ["-t", target] if target else []
    calls.append(["tmux", "select-pane", *t, "-T", first])
    for name in rest:
        calls.append(["tmux", "split-window", *t, "-v" if stacked else "-h", pane_command(rd, name)])
        calls.append(["tmux", "select-pane", *t, "-T", name])
    calls.append(["tmux", "select-layout", *t, "even-vertical" if stacked else "even-horizontal"])
    calls.append(["tmux", "set-option", "-w", *t, "pane-border-status", "top"])
    calls.append(["tmux", "set-option", "-w", *t, "pane-border-format", " #{pane_title} "])
    return calls


def session_name(rd: RunDir) -> str:
    """tmux takes '.' and ':' in a name as window and pane separators."""
    return "prl-" + re.sub(r"[^A-Za-z0-9_-]", "_", rd.path.name)


def watch_tmux(rd: RunDir, stacked: bool) -> int:
    inside, session = bool(os.environ.get("TMUX")), session_name(rd)
    exists = subprocess.run(["tmux", "has-session", "-t", f"={session}"], capture_output=True).returncode == 0
    if inside or not exists:  # outside tmux, a session built earlier is re-attached as it is
        for argv in tmux_commands(rd, stacked, inside):
            subprocess.run(argv, check=True, capture_output=True)
    return 0 if inside else subprocess.call(["tmux", "attach-session", "-t", session])


def newest_lines(rd: RunDir, component: str, n: int) -> tuple[str, list[str]]:
    """(label, last n lines) of the component's most recently written log of the newest attempt."""
    files = [p for p in log_files(rd, component, None, None) if p.is_file()]
    if not files:
        return f"{component}: no log yet", []
    newest = max(files, key=lambda p: p.stat().st_mtime)
    text = newest.read_bytes().decode(errors="replace").splitlines()
    return prefix(rd, newest), text[-n:] if n else []


def frame(rd: RunDir, width: int, height: int, stacked: bool) -> str:
    """One screenful: the components' newest lines, in columns or stacked sections."""
    names = components(rd)
    if stacked:
        per = max(1, height // len(names) - 1)
        out = []
        for name in names:
            label, lines = newest_lines(rd, name, per)
            out += [f"── {label} ".ljust(width, "─")] + [line[:width] for line in lines]
        return "\n".join(out)
    col = max(10, (width - len(names) + 1) // len(names))
    panes = [newest_lines(rd, name, height - 1) for name in names]
    rows = [" ".join(f"── {label} "[:col].ljust(col, "─") for label, _ in panes)]
    for i in range(max(len(lines) for _, lines in panes)):
        rows.append(" ".join((lines[i] if i < len(lines) else "")[:col].ljust(col) for _, lines in panes).rstrip())
    return "\n".join(rows)


def watch_plain(rd: RunDir, stacked: bool, once: bool = False, every_s: float = 1.0) -> int:
    try:
        while True:
            size = shutil.get_terminal_size()
            text = frame(rd, size.columns, size.lines - 1, stacked)
            sys.stdout.write(text + "\n" if once else "\x1b[H\x1b[2J" + text)
            sys.stdout.flush()
            if once:
                return 0
            time.sleep(every_s)
    except KeyboardInterrupt:
        return 0


def watch(rd: RunDir, stacked: bool = False, plain: bool = False, once: bool = False) -> int:
    if not plain and not once and shutil.which("tmux"):
        return watch_tmux(rd, stacked)
    return watch_plain(rd, stacked, once)

