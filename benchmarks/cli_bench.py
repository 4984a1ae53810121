"""Cold start of `prl submit CONFIG --dry-run` with every pre-submit check, against the import floor.

    python benchmarks/cli_bench.py [--runs 9] [CONFIG] [key=value ...]

Each run is a fresh process (nothing cached in memory but the OS page cache; one unmeasured warm-up
each) writing into a new output dir. A and B alternate, so a machine whose speed drifts moves both:
A = `python -m prl.control.cli submit CONFIG --dry-run run.output_dir=... [overrides]`,
B = `python -c "import prl.control.cli, prl.control.submit"` (what every control-plane command pays before any work).
Prints the machine, whether `sbatch --test-only` took part (sbatch on PATH), and min/median/max.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if r.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return elapsed


def summary(name: str, xs: list[float]) -> str:
    return f"{name}: median {statistics.median(xs):.3f} s (min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("config", nargs="?", default=str(ROOT / "configs/hendrycks_math.yaml"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="prl-cli-bench-"))
    floor = [sys.executable, "-c", "import prl.control.cli, prl.control.submit"]

    def dry_run(i: int) -> list[str]:
        return [sys.executable, "-m", "prl.control.cli", "submit", args.config, "--dry-run",
                f"run.output_dir={out / str(i)}", *args.overrides]

    timed(dry_run(-1)), timed(floor)  # warm-up: page cache, .pyc files
    a, b = [], []
    for i in range(args.runs):
        a.append(timed(dry_run(i)))
        b.append(timed(floor))
    shutil.rmtree(out, ignore_errors=True)
    print(f"machine: {os.cpu_count()} CPUs, {cpu_model()}, Python {platform.python_version()}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"sbatch --test-only: {'included (' + shutil.which('sbatch') + ')' if shutil.which('sbatch') else 'skipped, no sbatch on PATH'}")
    print(summary("A  prl submit --dry-run, all checks", a))
    print(summary("B  import prl.control.cli, prl.control.submit     ", b))
    print(f"A - B (the work itself): median {statistics.median(x - y for x, y in zip(a, b)):.3f} s")


if __name__ == "__main__":
    main()
