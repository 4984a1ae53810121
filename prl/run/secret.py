"""The run's secret: what every request to its inference servers must carry.

Made once per run directory, at `prl submit` (or by the first component that needs it, for a server
started by hand from a config): `RUN/secret`, mode 0600, never in config.yaml, job.sbatch, a log, the
environment of the job or a command line. Components read it from the run directory; the server gets it
as VLLM_API_KEY (environment, not argv) and checks it on every route but /health (routes.py).

A secret file that others could read, or that is not this user's, is refused: anyone who read it could
drive the run's servers.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from prl.config import Config
from prl.run.rundir import RunDir

NAME = "secret"


def path_of(run_dir: Path) -> Path:
    return run_dir / NAME


def ensure(run_dir: Path) -> str:
    """The run's secret, made now (0600, created exclusively) if the run has none yet."""
    path = path_of(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return read(run_dir)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return read(run_dir)


def read(run_dir: Path) -> str:
    """The run's secret; SystemExit naming the file if it is missing, shared or not this user's."""
    path = path_of(run_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SystemExit(f"{path}: the run's secret is missing (prl submit makes it)") from None
    except OSError as e:  # a symlink planted in its place: ELOOP
        raise SystemExit(f"{path}: not a plain file of this user ({e.strerror})") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise SystemExit(f"{path}: the run's secret must be a file of this user that only it can read "
                             f"(mode 0600; it is {stat.filemode(st.st_mode)}, uid {st.st_uid})")
        value = f.read().strip()
    if len(value) < 32:
        raise SystemExit(f"{path}: the run's secret is too short ({len(value)} characters)")
    return value


def server_key(cfg: Config, environ: Mapping[str, str] = os.environ) -> str:
    """The key the run's servers take and its clients send: the variable that inference.api_key_env
    names (SystemExit if it is empty), else the run's secret."""
    if (name := cfg.inference.api_key_env) is not None:
        if not environ.get(name):
            raise SystemExit(f"inference.api_key_env: environment variable {name} is empty or unset")
        return environ[name]
    return ensure(RunDir.of(cfg, environ).path)
