#!/bin/bash
# The single-GPU figures of docs/performance.md (one H100 or H200), logs and JSON under OUT_DIR:
#     bash benchmarks/gpu_sweep.sh OUT_DIR
# Steps of the orchestrator's default shape (64 samples of <= 2048 tokens, 8 per packed micro-batch);
# 1.5B first (the goal), then 0.5B; each run bounded by `timeout` so one hang cannot eat the rest.
set -u
out=${1:-/tmp/prl-bench}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
bench="python3 benchmarks/trainer_bench.py --seq-len 2048 --micro-batch 8 --micro-batches 8 --steps 3 --warmup 2"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >"$out/gpu.txt" 2>&1
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_trainer_gpu.py 2>&1 | tail -3 | tee "$out/pytest_gpu.log"
timeout 400 $bench --model-preset qwen2-1.5b --variants compile+recompute,compile --baseline-micro-batch 4 \
    --profile-out "$out/profile_1.5b.txt" --io-dir /tmp/prl-io --json "$out/1.5b.json" 2>&1 | tee "$out/1.5b.log"
timeout 170 $bench --model-preset qwen2-0.5b --variants compile --baseline-micro-batch 8 \
    --json "$out/0.5b.json" 2>&1 | tee "$out/0.5b.log"
