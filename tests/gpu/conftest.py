"""The GPU tier: what only a CUDA GPU can show (the loop at 1.5B, the trainer's compiled kernels, SLURM
on GPUs). Every test in this folder is marked `gpu` and skips without the GPUs it needs.

    pytest tests/gpu          # on a GPU machine (see docs/gpu.md)
"""

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    """Called through this folder's hooks only (an item's ihook is its path's): its tests alone."""
    item.add_marker(pytest.mark.gpu)
