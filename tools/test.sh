#!/usr/bin/env bash
# The test command: sets up what is missing, starts the test Slurm cluster, runs every test layer
# (tests/unit, integration, cluster, gpu, bench) and stops the cluster again, also when tests fail.
#
#   bash tools/test.sh                 # everything (needs root for the cluster)
#   bash tools/test.sh tests/unit     # one tier; extra arguments go to pytest
#   PRL_TEST_WORKERS=1 bash tools/test.sh   # one pytest process (default 2 xdist workers; tests/conftest.py groups them)
#
# Two workers by default: on CI's 2 cores the whole suite of ef1ba7e took 38:59 with 1 worker, and
# 29:39 and 36:41 with 2 (the chaos draw varies; fresh clones,
# benchmarks/reports/ci-setup-new-user_cpu2_2026-11-27.md): a run
# waits for SLURM, for a process to start or for a signal's grace period while the other worker
# computes. With 2 the cores are now idle 6 % of the time, so a third has nothing to use. Four workers made every run
# ~4x slower and missed the tests' deadlines (a requeued job must start within 180 s). Workers share
# the session's runs correctly (xdist_group, the reference's lock); the summary's "xdist workers" line
# says how evenly they were loaded.
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
workers=${PRL_TEST_WORKERS:-2}
if [ "$workers" -gt 1 ]; then set -- -n "$workers" --dist loadgroup "$@"; fi
rc=0
.venv/bin/python -m pytest "$@" || rc=$?
exit "$rc"  # through the EXIT trap: the cluster goes down
