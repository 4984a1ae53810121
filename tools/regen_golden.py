"""Rewrites tests/golden/*.sbatch (the batch scripts) and *.launch (the supervisor's srun steps) from
tests/render_cases.py. Run only for an intended script change,
and read the diff before committing it.

    python tools/regen_golden.py
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from render_cases import CASES, render_case, render_launch  # noqa: E402

for name in CASES:
    path = ROOT / "tests" / "golden" / f"{name}.sbatch"
    path.write_text(render_case(name))
    print(f"wrote {path.relative_to(ROOT)}")
    path = path.with_suffix(".launch")
    path.write_text(render_launch(name))
    print(f"wrote {path.relative_to(ROOT)}")
