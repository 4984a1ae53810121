"""The bench tier: every benchmark in benchmarks/ run on the tiny model (CPU), asserting on the
figures it prints. Every test in this folder is marked `bench`. The three that take a minute or more
(marked `slow`: gpu_exactness's CPU run, the loss options, v1_env_server_bench) run only when -m names bench or slow
(tests/conftest.py), which CI's 25-minute budget leaves out.

    pytest tests/bench -n 2            # what CI runs
    pytest -m bench tests/bench -n 2   # all of it
"""

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    """Called through this folder's hooks only (an item's ihook is its path's): its tests alone."""
    item.add_marker(pytest.mark.bench)
