"""`pip install .` (not editable) gives a working `prl` from any directory: templates, job programs and
shipped configs are package data, and the generated script names only installed paths."""

import os
import subprocess
import sys
import tomllib

from helpers import ROOT, fake_commands


def test_every_subpackage_is_listed_for_installation():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "prl").rglob("__init__.py")}
    assert found <= listed


def test_pip_install_gives_a_working_prl_anywhere(tmp_path):
    target = tmp_path / "site"
    # --no-deps/--no-build-isolation: offline, and this venv already has the dependencies and setuptools.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True)
    bin_dir = fake_commands(tmp_path / "bin", sbatch="exit 0")  # its --test-only agrees: no real cluster decides
    env = {**os.environ, "PYTHONPATH": str(target), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    work = tmp_path / "elsewhere"
    work.mkdir()

    def prl(*args):
        return subprocess.run([str(target / "bin" / "prl"), *args], cwd=work, env=env, capture_output=True, text=True)

    r = prl("--version")
    assert r.returncode == 0 and r.stdout.startswith("prl 0."), r.stderr
    r = prl("submit", "hendrycks_math.yaml", "--dry-run", f"run.output_dir={tmp_path / 'out'}")
    assert r.returncode == 0, r.stderr
    shipped = target / "prl/_home/configs/hendrycks_math.yaml"
    assert r.stderr.startswith(f"config: hendrycks_math.yaml is not in {work}; using the shipped {shipped}")
    script = (tmp_path / "out/hendrycks-math-1.5b/job.sbatch").read_text()
    assert f"export PRL_HOME={target / 'prl/_home'}\n" in script
    assert str(ROOT) not in script.replace(sys.executable, "")  # the interpreter is the submitting one
    for job in ("inference", "trainer", "orchestrator", "probe"):
        assert (target / f"prl/_home/jobs/{job}.py").is_file()


def test_a_file_in_the_current_directory_wins_over_a_shipped_config(tmp_path, monkeypatch, capsys):
    from prl.run.home import PRL_HOME, find_config

    monkeypatch.chdir(tmp_path)
    assert find_config("toy.yaml") == str(PRL_HOME / "configs/toy.yaml")
    assert "using the shipped" in capsys.readouterr().err
    (tmp_path / "toy.yaml").write_text("run: {}\n")
    assert find_config("toy.yaml") == "toy.yaml" and capsys.readouterr().err == ""
    assert find_config("elsewhere/toy.yaml") == "elsewhere/toy.yaml"  # only bare or configs/ names
