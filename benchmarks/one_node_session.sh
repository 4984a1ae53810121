#!/usr/bin/env bash
# One machine of 2, 4 or 8 GPUs as ONE SLURM node (issue 26; on 4 GPUs its fallback, the 8-GPU run scaled
# down) and the loop's rows for that many GPUs (issue 24), in priority order; each step logs to OUT/NAME.log, is cut
# at its own limit, and the run ends with OUT/ALL_DONE.
#
#   bash benchmarks/one_node_session.sh /tmp/gpu-out &
#   PRESET=qwen2-7b bash benchmarks/one_node_session.sh /tmp/gpu-out &   # 8 GPUs: issue 26's 6 + 2 at 7B
#
# 1. rl_bench's offline baseline on GPU 0 ($PRESET, default 1.5B), again beside a training step and beside matmuls on
#    the last GPU (what the engine loses to a trainer working on another GPU of the machine);
# 2. the test cluster as one node of every GPU, configs/one_node_<N>gpu.yaml submitted with
#    benchmarks/one_node_bench.py (vLLM's logprobs, weights by file; SIGUSR1 after step 3);
# 3. local mode, rl_bench's layout (N - 1 vLLM replicas, the trainer on the last GPU: the config's own
#    layout up to 4 GPUs), the trainer recomputing the logprobs, then async_level 2, then weights by
#    NCCL broadcast (the offline figures of step 1).
# Needs, carried: the gpu-vllm bundle unpacked (/tmp/prl-gpu-site), .gpu-mini on PYTHONPATH, Debian's
# Slurm packages in .gpu-slurm/debs (tools/fetch_slurm_debs.sh).
set -uo pipefail
out=${1:?usage: one_node_session.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
. benchmarks/session_step.sh  # step NAME LIMIT_S COMMAND...; gpu_test_cluster_env
gpu_test_cluster_env
work=/tmp/one-node-session
preset=${PRESET:-qwen2-1.5b}
model=$work/rlb/models/$preset
bench=(python3 benchmarks/rl_bench.py --preset "$preset" --gpus "$gpus" --steps 6 --skip 2 --routes tokens --work "$work/rlb")
step offline 600 "${bench[@]}" --skip-loop --interference --json "$out/offline.json"
step cluster_one_node 180 env PRL_SLURM_NODES=1 PRL_SLURM_CPUS=$(( $(nproc) - 2 )) \
    PRL_SLURM_MEM_MB=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 - 8192 )) bash tools/slurm_cluster.sh up
step one_node_usr1 1200 python3 benchmarks/one_node_bench.py "configs/one_node_${gpus}gpu.yaml" --model "$model" \
    --offline "$out/offline.json" --work "$work/slurm" --usr1-after 4 --json "$out/one_node_usr1.json"
tar -czf "$out/one_node_usr1-logs.tgz" -C "$work/slurm/one-node-bench" logs config.yaml job.sbatch 2>/dev/null
step cluster_down 60 bash tools/slurm_cluster.sh down
step loop_recompute 600 "${bench[@]}" --offline-json "$out/offline.json" --runs 1:recompute --json "$out/loop_recompute.json"
# async_level 2: batch k needs version k - 2, so no step waits on the publish -> load -> batch chain
# that bounds async 1 (docs/performance.md, "One node of 4 x H200").
step loop_async2 600 "${bench[@]}" --offline-json "$out/offline.json" --runs 2:inference --json "$out/loop_async2.json"
step loop_broadcast 600 "${bench[@]}" --offline-json "$out/offline.json" \
    --runs 1:inference::inference.weight_transfer=broadcast --json "$out/loop_broadcast.json"
touch "$out/ALL_DONE"
