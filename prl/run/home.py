"""Where prl's shipped files live: jobs/ (the programs the batch script starts), templates/ and configs/.

    from prl.run.home import PRL_HOME, find_config
    PRL_HOME / "jobs" / "trainer.py"

In a source checkout (and an editable install) they are the repository's top-level directories.
`pip install .` copies them into the package as prl/_home/{jobs,templates,configs} (package-dir in
pyproject.toml), so a generated script names only installed paths and works from any directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent  # the prl package (this file is prl/run/home.py)
PRL_HOME = _PACKAGE / "_home" if (_PACKAGE / "_home" / "jobs").is_dir() else _PACKAGE.parent
"""The directory holding jobs/, templates/ and configs/ (exported to the job as PRL_HOME)."""


def find_config(arg: str) -> str:
    """`arg` if such a file exists; else a shipped config of that name (`hendrycks_math.yaml` or
    `configs/hendrycks_math.yaml` from any directory), saying so on stderr; else `arg` unchanged
    (the loader then reports it missing)."""
    path = Path(arg)
    if path.exists() or str(path.parent) not in (".", "configs"):
        return arg
    shipped = PRL_HOME / "configs" / path.name
    if shipped.is_file():
        print(f"config: {arg} is not in {Path.cwd()}; using the shipped {shipped}", file=sys.stderr)
        return str(shipped)
    return arg


def env_worker_python(python: str) -> str:
    """An `api: v1` environment's worker Python (orchestrator.environment.python): relative to the
    checkout (.venv-v1 is tools/setup.sh's), absolute as given."""
    path = Path(python)
    return str(path if path.is_absolute() else _PACKAGE.parent / path)
