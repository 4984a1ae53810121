"""`prl submit NEW.yaml --from RUN[:STEP]` (prl.control.fork): the checkpoint linked in as the new run's
own, fork.json, `prl status`; bad input refused naming `--from`, nothing written.

    pytest tests/unit/test_fork.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import TOY, prl, tiny_model_dir

from prl.config import ConfigError, load_config, to_yaml
from prl.control.status import status_lines
from prl.control.fork import parse_from, plan
from prl.run.rundir import RunDir


def source_run(tmp_path):
    """A run directory with complete checkpoints 2 and 4 (files as the trainer leaves them) and an incomplete 6."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.yaml").write_text(to_yaml(load_config(TOY, [f"run.output_dir={tmp_path}", "run.name=src"])))
    for step in (2, 4, 6):
        ckpt = src / f"checkpoints/step_{step}"
        (ckpt / "trainer").mkdir(parents=True)
        (ckpt / "trainer/__0_0.distcp").write_bytes(b"weights and optimizer %d" % step)
        (ckpt / "data_order.json").write_text(json.dumps({"step": step}))
        if step != 6:
            (ckpt / "COMPLETE").touch()
    return src


def fork(tmp_path, *args):
    return prl("submit", TOY, f"run.output_dir={tmp_path}", "run.name=new", f"model.name={tiny_model_dir()}",
               "--local", "--dry-run", *args, cwd=tmp_path)


def test_a_fork_starts_from_the_source_checkpoint_and_says_so(tmp_path):
    src = source_run(tmp_path)
    r = fork(tmp_path, "--from", f"{src}:2")
    assert r.returncode == 0, r.stderr
    new = tmp_path / "new"
    linked = new / "checkpoints/step_2/trainer/__0_0.distcp"
    assert linked.read_bytes() == b"weights and optimizer 2" and (new / "checkpoints/step_2/COMPLETE").is_file()
    assert linked.stat().st_ino == (src / "checkpoints/step_2/trainer/__0_0.distcp").stat().st_ino  # a hard link
    assert sorted(p.name for p in (new / "checkpoints").iterdir()) == ["step_2"]
    assert json.loads((new / "fork.json").read_text())["from"] == str(src)
    assert f"forked from: {src} at step 2" in status_lines(RunDir(new))
    # Without a step: the newest complete checkpoint (4; 6 has no COMPLETE).
    assert plan(str(src), load_config(src / "config.yaml"), RunDir(tmp_path / "newest")).step == 4


def test_a_fork_of_a_checkpoint_that_is_not_there_is_refused_naming_from(tmp_path):
    src = source_run(tmp_path)
    r = fork(tmp_path, "--from", f"{src}:6")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"prl: error: --from: {src} has no complete checkpoint 6 (it has: 2, 4)"], r.stderr
    assert not (tmp_path / "new").exists()
    cfg, target = load_config(src / "config.yaml", ["run.max_steps=4"]), RunDir(tmp_path / "new")
    for text, message in [(str(tmp_path / "nowhere"), f"{tmp_path / 'nowhere'} is not a run directory (no config.yaml)"),
                          (f"{src}:4", "step 4 is not below run.max_steps=4: nothing left to train"),
                          (str(src), f"{src} is the new run's own directory")]:
        with pytest.raises(ConfigError, match=re.escape(f"--from: {message}")):
            plan(text, cfg, target if text != str(src) else RunDir(src))
    assert parse_from("/a:b/run:12") == (Path("/a:b/run"), 12) and parse_from("/a:b/run") == (Path("/a:b/run"), None)
