#!/usr/bin/env bash
# The test command: sets up what is missing, starts the test Slurm cluster, runs every test layer
# (unit, slurm, vllm, slow) and stops the cluster again, also when tests fail.
#
#   bash tools/test.sh                 # everything (needs root for the cluster)
#   bash tools/test.sh -m "not slurm"  # extra arguments go to pytest
#   PRL_TEST_WORKERS=1 bash tools/test.sh   # one process (default 4 xdist workers; see tests/conftest.py)
#
# The runs are CPU-bound only in part (vLLM's start, Slurm's scheduling, signal waits), so 4 workers on
# 2 cores finish well before 1; tests that share a session run stay on one worker (xdist_group).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
cluster_started=0
if [ "$(id -u)" = 0 ]; then
    # 9 nodes (8 with fake GPUs, 1 CPU-only): the workers' RL jobs, up to 4 nodes each, run side by side
    # instead of queueing behind one another (a requeued job must start within the tests' deadlines).
    PRL_SLURM_NODES=9 bash tools/slurm_cluster.sh up
    cluster_started=1
    export PRL_SLURM_REQUIRED=1
else
    echo "not root: the slurm-marked tests will be skipped (the test cluster needs root)" >&2
fi
cleanup() { [ "$cluster_started" = 1 ] && bash tools/slurm_cluster.sh down || true; }
trap cleanup EXIT
workers=${PRL_TEST_WORKERS:-4}
if [ "$workers" -gt 1 ]; then set -- -n "$workers" --dist loadgroup "$@"; fi
.venv/bin/python -m pytest "$@"
