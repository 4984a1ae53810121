#!/usr/bin/env bash
# prl under a real SLURM on a GPU machine of 2 or 4 GPUs (nvidia-h100-x2/-x4, -h200-x2/-x4), in priority order:
# the test cluster with GRES bound to the real GPUs, every layout (tests/test_gpu_slurm.py), the
# one-node layout on nodes of 2 GPUs, then the 1.5B preemption measurements
# (benchmarks/gpu_slurm_preemption.py). Each step logs to OUT/NAME.log and is cut at its own limit;
# the run ends with OUT/ALL_DONE.
#
#   bash benchmarks/gpu_slurm_session.sh /tmp/gpu-out &            # everything
#   bash benchmarks/gpu_slurm_session.sh /tmp/gpu-out layouts &    # the binding and the layouts only
#
# Needs, carried: the gpu-vllm bundle unpacked (/tmp/prl-gpu-site), Debian's Slurm packages in
# .gpu-slurm/debs (tools/fetch_slurm_debs.sh) and the tiny model in .cache/tiny-qwen2.
set -uo pipefail
out=${1:?usage: gpu_slurm_session.sh OUT_DIR [layouts]}
only=${2:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
. benchmarks/session_step.sh  # step NAME LIMIT_S COMMAND...; gpu_test_cluster_env
gpu_test_cluster_env
pytest=(python3 -m pytest -m "gpu and slurm" tests/test_gpu_slurm.py -v -p no:cacheprovider)

# One node per GPU. First the binding check and the 1.5B preemption figures (item 5, never measured
# yet), then every layout: the het job, two inference nodes, the trainer on two nodes.
step cluster_1gpu_nodes 180 env PRL_SLURM_NODES="$gpus" bash tools/slurm_cluster.sh up
step binding_1gpu_nodes 120 "${pytest[@]}" -k binds
keep_runs() { tar -czf "$out/$1-runs.tgz" --exclude=checkpoints --exclude=weights --exclude='*.pt' /tmp/pytest-of-root 2>/dev/null; }
# 1.5B: USR1 and scontrol requeue, weights by NCCL broadcast between the het groups; then local mode.
[ "$only" = layouts ] || step model_1.5b 300 python3 benchmarks/bench_model.py --preset qwen2-1.5b --out /tmp/m15
[ "$only" = layouts ] || step preemption_1.5b 900 python3 benchmarks/gpu_slurm_preemption.py --model /tmp/m15 --work /tmp/preempt \
    --json "$out/preemption_1.5b.json"
for run in /tmp/preempt/slurm/toy /tmp/preempt/local/toy; do
    [ -d "$run/logs" ] && tar -czf "$out/preempt-$(basename "$(dirname "$run")")-logs.tgz" -C "$run" logs 2>/dev/null
done
step layouts_1gpu_nodes 900 "${pytest[@]}" -k "not one_node and not binds"
keep_runs layouts_1gpu_nodes
# Nodes of 2 GPUs: the one-node layout (vLLM on one, the trainer on the other).
step cluster_2gpu_nodes 180 env PRL_SLURM_NODES=$(( gpus / 2 )) bash tools/slurm_cluster.sh up
step layout_one_node 600 "${pytest[@]}" -k "one_node or binds"
keep_runs layout_one_node
cp -r /var/lib/prl-slurm/log "$out/slurm-log" 2>/dev/null
step cluster_down 60 bash tools/slurm_cluster.sh down
touch "$out/ALL_DONE"
