#!/usr/bin/env bash
# Issue 24 on one machine of 4 GPUs (3 vLLM replicas + the trainer, 1.5B, async 1, token route), in
# priority order; each step logs to OUT/NAME.log, is cut at its own limit, and the run ends with OUT/ALL_DONE.
#
#   bash benchmarks/loop_session.sh /tmp/gpu-out &
#
# 1. rl_bench's offline baseline on GPU 0 (one engine: every ratio's denominator), and meanwhile on the
#    last GPU the trainer's first step with and without trainer.prewarm (benchmarks/first_step_bench.py);
# 2. the loop at async_level 2 (the chain from a step to the next batch off the path);
# 3. the loop at async_level 1 (versions without fsync, batches polled every 0.1 s: the defaults now);
# 4. 3. with weights by NCCL broadcast;
# 5. start-up and generation of 3 servers against 3-way data parallelism, both with warm compile caches
#    (benchmarks/server_start_bench.py);
# 6. 3. with a server per replica (inference.replica_servers).
# Needs, carried: the gpu-vllm bundle unpacked (/tmp/prl-gpu-site), .gpu-mini on PYTHONPATH.
# The first run (benchmarks/results/h200x4-2026-11-27c) lost its last steps when the machine was given
# back between two polls: poll in calls that follow each other at once, and fetch OUT after each long step.
set -uo pipefail
out=${1:?usage: loop_session.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
. benchmarks/session_step.sh  # step NAME LIMIT_S COMMAND...; gpu_test_cluster_env
gpu_test_cluster_env
work=/tmp/loop-session
bench=(python3 benchmarks/rl_bench.py --preset qwen2-1.5b --gpus "$gpus" --steps 6 --skip 2 --routes tokens --work "$work/rlb")
step first_step 480 env CUDA_VISIBLE_DEVICES=$(( gpus - 1 )) python3 benchmarks/first_step_bench.py \
    --preset qwen2-1.5b --work "$work/first" --json "$out/first_step.json" &
step offline 400 "${bench[@]}" --skip-loop --json "$out/offline.json"
wait
loop() {  # NAME RUN_SPEC; the run's logs (each server's start, line by line) kept beside its figures
    step "$1" 480 "${bench[@]}" --offline-json "$out/offline.json" --runs "$2" --json "$out/$1.json"
    tar czf "$out/$1-logs.tgz" -C "$work/rlb" runs --exclude='*.pt' --exclude='*.safetensors' --exclude='*.bin' \
        --exclude=checkpoints --exclude=weights 2>/dev/null
    rm -rf "$work/rlb/runs"
}
loop loop_async2 "2:inference"
loop loop_async1 "1:inference"
loop loop_broadcast "1:inference::inference.weight_transfer=broadcast"
step start_bench 420 python3 benchmarks/server_start_bench.py --model "$work/rlb/models/qwen2-1.5b" \
    --gpus $(( gpus - 1 )) --variants dp,servers --work "$work/start" --json "$out/start_bench.json"
loop loop_servers "1:inference::inference.replica_servers=true"
touch "$out/ALL_DONE"
