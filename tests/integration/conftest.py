"""The integration tier: the programs for real on this machine: torchrun trainers, CPU vLLM servers,
weight broadcasts between processes, whole local RL runs. Every test in this folder is marked
`integration`; `vllm` and `slow` say which need a server or take a minute or more.

    pytest tests/integration -n 2
"""

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    """Called through this folder's hooks only (an item's ihook is its path's): its tests alone."""
    item.add_marker(pytest.mark.integration)
