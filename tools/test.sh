#!/usr/bin/env bash
# The test command: sets up what is missing, starts the test Slurm cluster, runs every test layer
# (unit, slurm, vllm, slow) and stops the cluster again, also when tests fail.
#
#   bash tools/test.sh                 # everything (needs root for the cluster)
#   bash tools/test.sh -m "not slurm"  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
cluster_started=0
if [ "$(id -u)" = 0 ]; then
    bash tools/slurm_cluster.sh up
    cluster_started=1
    export PRL_SLURM_REQUIRED=1
else
    echo "not root: the slurm-marked tests will be skipped (the test cluster needs root)" >&2
fi
cleanup() { [ "$cluster_started" = 1 ] && bash tools/slurm_cluster.sh down || true; }
trap cleanup EXIT
.venv/bin/python -m pytest "$@"
