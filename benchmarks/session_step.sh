# Sourced by the GPU session scripts (benchmarks/*_session.sh), after they set $out:
#   step NAME LIMIT_S COMMAND...   run COMMAND into $out/NAME.log, cut at LIMIT_S, its start, end and
#                                  exit status in $out/steps.log; later steps run either way.
#   gpu_test_cluster_env           the gpu-vllm bundle's environment (.gpu-mini too, if carried), NVLink
#                                  multicast off (the jobs inherit it), Python's bytecode kept as an
#                                  installed environment keeps it (the image sets PYTHONDONTWRITEBYTECODE
#                                  and ships none: every start compiled the sources, h200-2026-11-28c),
#                                  and tools/slurm_cluster.sh's settings for GRES bound to
#                                  the real GPUs: $gpus GPUs, one node's share of cores and memory each.
step() {
    local name=$1 limit=$2; shift 2
    echo "== $(date -u +%T) $name: $*" | tee -a "$out/steps.log"
    timeout --kill-after=20 "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $(date -u +%T) $name exit $?" | tee -a "$out/steps.log"
}

gpu_test_cluster_env() {
    . /tmp/prl-gpu-site/env.sh
    export PYTHONPATH=$PYTHONPATH:$PWD
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    unset PYTHONDONTWRITEBYTECODE
    export PYTHONPYCACHEPREFIX=/tmp/pycache
    [ -d .gpu-mini ] && export PYTHONPATH=$PYTHONPATH:$PWD/.gpu-mini  # tools/make_gpu_mini.sh: what the bundle lacks
    gpus=$(nvidia-smi -L | tee "$out/gpus.txt" | wc -l)
    export PRL_SLURM_DEBS=.gpu-slurm/debs PRL_SLURM_GPUS=real PRL_SLURM_CPU_NODES=0
    export PRL_SLURM_CPUS=$(( $(nproc) / gpus )) PRL_SLURM_MEM_MB=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 / gpus - 2048 ))
}
