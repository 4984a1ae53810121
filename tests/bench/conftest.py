"""The bench tier: every test in this folder is marked `bench` as it is collected, before
tests/conftest.py leaves such tests out unless the -m expression names the marker:

    pytest -m bench tests/bench
"""

from __future__ import annotations

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    """Called through this folder's hooks only (a node's ihook is its path's), so for its tests alone."""
    item.add_marker(pytest.mark.bench)
