#!/usr/bin/env bash
# The test command: sets up what is missing, starts the test Slurm cluster, runs every test layer
# (unit, slurm, vllm, slow) and stops the cluster again, also when tests fail.
#
#   bash tools/test.sh                 # everything (needs root for the cluster)
#   bash tools/test.sh -m "not slurm"  # extra arguments go to pytest
#   PRL_TEST_WORKERS=4 bash tools/test.sh   # 4 xdist workers (default 1; tests/conftest.py groups them)
#
# One process by default: on CI's 2 cores the runs are CPU-bound, and 4 workers made every run ~4x
# slower and missed the tests' deadlines (a requeued job must start within 180 s). On a machine with
# cores to spare, workers share the session's runs correctly (xdist_group, the reference's lock).
# Nor did the unit layer in a second pytest beside the heavy ones help on 2 cores (3512 s against 3743 s,
# with ~340 s of runs merged away in between; benchmarks/results/cpu-2026-11-26/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
cluster_started=0
if [ "$(id -u)" = 0 ]; then
    # 9 nodes (8 with fake GPUs, 1 CPU-only): with several workers, their RL jobs (up to 4 nodes each)
    # run side by side instead of queueing behind one another.
    PRL_SLURM_NODES=9 bash tools/slurm_cluster.sh up
    cluster_started=1
    export PRL_SLURM_REQUIRED=1
else
    echo "not root: the slurm-marked tests will be skipped (the test cluster needs root)" >&2
fi
cleanup() { [ "$cluster_started" = 1 ] && bash tools/slurm_cluster.sh down || true; }
trap cleanup EXIT
workers=${PRL_TEST_WORKERS:-1}
if [ "$workers" -gt 1 ]; then set -- -n "$workers" --dist loadgroup "$@"; fi
rc=0
.venv/bin/python -m pytest "$@" || rc=$?
exit "$rc"  # through the EXIT trap: the cluster goes down
