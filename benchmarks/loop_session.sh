#!/usr/bin/env bash
# Issue 24 on one machine of 4 GPUs (1.5B, token route, 1-3 vLLM replicas + the trainer), in priority
# order; each step logs to OUT/NAME.log, is cut at its own limit, and the run ends with OUT/ALL_DONE.
#
#   bash benchmarks/loop_session.sh /tmp/gpu-out &
#
# Four phases of about 5.5 minutes each (a loop is ~110 s of server start, 6 steps and a checkpoint), two
# of them with two benchmarks side by side on GPUs of their own (rl_bench reads CUDA_VISIBLE_DEVICES):
# 1. rl_bench's offline baseline on GPU 3 (one engine: every ratio's denominator) beside the loop at 2 + 1
#    on GPUs 0-2 (async 2: the k = 2 row, 3 GPUs), which reads the baseline once it is written;
# 2. the loop at 3 + 1, async 2 (the chain from a step to the next batch off the path; k = 3, 4 GPUs);
# 3. the loop at 1 + 1 on GPUs 0-1 (k = 1, 2 GPUs) beside the same with weights by NCCL broadcast on GPUs 2-3;
# 4. 2. with a server per replica (inference.replica_servers);
# 5. 2. at async 1 (the issue's layout as it was measured), then server start-up, if the lease lasts.
# At most one benchmark at a time runs data-parallel vLLM (its coordinator's ports are its own choice).
# Needs, carried: the gpu-vllm bundle unpacked (/tmp/prl-gpu-site), .gpu-mini on PYTHONPATH.
# Earlier runs (h200x4-2026-11-27c, -d) lost their last steps when the machine was given back between two
# polls: poll in calls that follow each other at once, and fetch OUT after each phase.
set -uo pipefail
out=${1:?usage: loop_session.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
. benchmarks/session_step.sh  # step NAME LIMIT_S COMMAND...; gpu_test_cluster_env
gpu_test_cluster_env
work=/tmp/loop-session  # w1 and w2: two benchmarks side by side need their own (run names are per setting)
loop() {  # NAME VISIBLE GPUS WORK PORT RUN_SPEC; the run's logs (each server's start, line by line) kept beside its figures
    step "$1" 480 env CUDA_VISIBLE_DEVICES="$2" python3 benchmarks/rl_bench.py --preset qwen2-1.5b --gpus "$3" \
        --steps 6 --skip 2 --routes tokens --work "$work/$4" --port "$5" --offline-json "$out/offline.json" \
        --runs "$6" --json "$out/$1.json"
    tar czf "$out/$1-logs.tgz" -C "$work/$4" runs --exclude='*.pt' --exclude='*.safetensors' --exclude='*.bin' \
        --exclude=checkpoints --exclude=weights 2>/dev/null
    rm -rf "$work/$4/runs"
}
# The baseline with the multi-GPU memory settings (--gpus 4) on GPU 3, the first of those it is shown.
step offline 420 env CUDA_VISIBLE_DEVICES=3,0,1,2 python3 benchmarks/rl_bench.py --preset qwen2-1.5b --gpus 4 \
    --steps 6 --skip 2 --routes tokens --work "$work/w2" --skip-loop --json "$out/offline.json" &
loop loop_3gpu_async2 0,1,2 3 w1 18100 "2:inference"
wait
loop loop_4gpu_async2 0,1,2,3 4 w1 18100 "2:inference"
loop loop_2gpu_async2 0,1 2 w1 18100 "2:inference" &
loop loop_2gpu_async2_broadcast 2,3 2 w2 18200 "2:inference::inference.weight_transfer=broadcast"
wait
loop loop_4gpu_async2_servers 0,1,2,3 4 w1 18100 "2:inference::inference.replica_servers=true"
loop loop_4gpu_async1 0,1,2,3 4 w1 18100 "1:inference"
step start_bench 420 python3 benchmarks/server_start_bench.py --model "$work/w1/models/qwen2-1.5b" \
    --gpus $(( gpus - 1 )) --variants dp,servers --work "$work/start" --json "$out/start_bench.json"
touch "$out/ALL_DONE"
