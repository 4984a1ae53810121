"""The unit tier, what a contributor runs before every commit: no torchrun, no vLLM server, no
Slurm cluster, no process group of several processes (tests/conftest.py refuses a test here that
carries the vllm, slurm, slow or gpu marker). Every test in this folder is marked `unit`.

    pytest tests/unit -n 2          # about a minute and a half on 2 cores
"""

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    """Called through this folder's hooks only (an item's ihook is its path's): its tests alone."""
    item.add_marker(pytest.mark.unit)
