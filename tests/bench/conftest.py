"""The bench tier: every benchmark in benchmarks/ run on the tiny model (CPU), asserting on the
figures it prints. Every test in this folder is marked `bench`.

    pytest tests/bench -n 2
"""

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    """Called through this folder's hooks only (an item's ihook is its path's): its tests alone."""
    item.add_marker(pytest.mark.bench)
