#!/usr/bin/env bash
# inference.multi_node=data_parallel on a real SLURM on a 4-GPU machine (nvidia-h100-x4/-h200-x4): the
# test cluster with one node per GPU, GRES bound to the real GPUs; the two layouts of two inference
# nodes (tests/test_gpu_slurm.py, tiny model); then the loop at 1.5B, independent servers against one
# server over both nodes (benchmarks/gpu_dp_loop.py). Each step logs to OUT/NAME.log; OUT/ALL_DONE last.
#
#   bash benchmarks/gpu_dp_session.sh /tmp/gpu-out &
#
# Needs, carried: the gpu-vllm bundle unpacked (/tmp/prl-gpu-site), Debian's Slurm packages in
# .gpu-slurm/debs (tools/fetch_slurm_debs.sh) and the tiny model in .cache/tiny-qwen2.
set -uo pipefail
out=${1:?usage: gpu_dp_session.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
. benchmarks/session_step.sh  # step NAME LIMIT_S COMMAND...; gpu_test_cluster_env
gpu_test_cluster_env
step cluster 180 env PRL_SLURM_NODES="$gpus" bash tools/slurm_cluster.sh up
step model_1.5b 300 python3 benchmarks/bench_model.py --preset qwen2-1.5b --out /tmp/m15
step layouts_two_inference_nodes 600 python3 -m pytest -m "gpu and slurm" tests/test_gpu_slurm.py -v -s \
    -p no:cacheprovider -k "two_inference_nodes or binds"
tar -czf "$out/layouts-runs.tgz" --exclude=checkpoints --exclude=weights --exclude='*.pt' /tmp/pytest-of-root 2>/dev/null
step dp_loop_1.5b 1500 python3 benchmarks/gpu_dp_loop.py --model /tmp/m15 --work /tmp/dp-loop
tar -czf "$out/dp-loop-logs.tgz" --exclude=checkpoints --exclude=weights --exclude='*.pt' /tmp/dp-loop 2>/dev/null
cp -r /var/lib/prl-slurm/log "$out/slurm-log" 2>/dev/null
step cluster_down 60 bash tools/slurm_cluster.sh down
touch "$out/ALL_DONE"
