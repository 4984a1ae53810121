#!/usr/bin/env bash
# Downloads Debian 12's Slurm 22.05 and munge packages (about 8 MiB) into OUT_DIR, on a machine that
# reaches the Debian registry, for a machine that does not (the GPU machines). There:
#   PRL_SLURM_DEBS=OUT_DIR PRL_SLURM_GPUS=real tools/slurm_cluster.sh up
# (docs/slurm-test-cluster.md, "On a GPU machine").
#   tools/fetch_slurm_debs.sh .gpu-slurm/debs
set -euo pipefail
out=${1:?usage: tools/fetch_slurm_debs.sh OUT_DIR}
packages=(slurmd slurmctld slurm-client slurm-wlm-basic-plugins munge libmunge2 libdbus-1-3)  # libdbus: slurmd's cgroup/v2 plugin
mkdir -p "$out"
cd "$out"
apt-get download "${packages[@]}" >/dev/null || { apt-get update -qq && apt-get download "${packages[@]}"; }
# `ip` for the nodes' network namespaces, used only where the machine has none (its libraries stay
# out of what the jobs load: tools/slurm_cluster.sh unpacks them apart)
mkdir -p iproute2
(cd iproute2 && apt-get download iproute2 libbpf1 libmnl0 libelf1 >/dev/null)
ls -1 ./*.deb iproute2/*.deb
