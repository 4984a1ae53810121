"""The orchestrator-trainer contract (prl.batch): the version arithmetic both sides use.

    pytest tests/test_batch.py        # a few seconds
"""

from __future__ import annotations

import subprocess
import sys

from prl.batch import past_versions, policy_version, versions_in_flight, weights_kept


def test_the_version_arithmetic_both_sides_use():
    assert [policy_version(n, 2) for n in range(6)] == [0, 0, 0, 1, 2, 3]
    assert list(past_versions(5, 2)) == [3, 4] and list(past_versions(1, 2)) == [0] and not past_versions(4, 0)
    # Trainer at step 4 has written version 5; batches 5, 6, ... need versions 3, 4, 5... at async_level 2.
    assert weights_kept(2) == 3 == len([*past_versions(5, 2), 5])
    assert versions_in_flight(2) == 4  # exporting 6 while batch 5 may still need 3


def test_the_batch_module_imports_no_torch():
    code = "import sys, prl.batch; print([m for m in ('torch', 'vllm') if m in sys.modules])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"
