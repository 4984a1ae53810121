"""Rewrites tests/golden/*.sbatch from tests/render_cases.py. Run only for an intended script change,
and read the diff before committing it.

    python tools/regen_golden.py
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from render_cases import CASES, render_case  # noqa: E402

for name in CASES:
    path = ROOT / "tests" / "golden" / f"{name}.sbatch"
    path.write_text(render_case(name))
    print(f"wrote {path.relative_to(ROOT)}")
