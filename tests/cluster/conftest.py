"""The cluster tier: jobs on the real multi-node Slurm test cluster (tools/slurm_cluster.sh up, as
root; tools/test.sh brings it up and down). Every test in this folder is marked `cluster`; without a
cluster they skip, unless PRL_SLURM_REQUIRED=1 (CI), where that fails.

    bash tools/test.sh tests/cluster
"""

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    """Called through this folder's hooks only (an item's ihook is its path's): its tests alone."""
    item.add_marker(pytest.mark.cluster)
