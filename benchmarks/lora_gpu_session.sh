#!/usr/bin/env bash
# LoRA against full fine-tuning on 2 GPUs of one host (issue: LoRA figures), trainer side and the
# servers' fold; what each command printed goes to $OUT (the device tool's output folder).
#
#   bash benchmarks/lora_gpu_session.sh 1.5b     # fold costs at 1.5B and 7B, then the 1.5B trainer
#   bash benchmarks/lora_gpu_session.sh 7b       # the 7B trainer (activation checkpointing on)
#
# Needs torch and transformers (the GPU image's) and, on PYTHONPATH, omegaconf, loguru, peft and
# accelerate (.gpu-mini, built by tools/make_gpu_mini.sh, carried with the call).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/.gpu-mini:$PWD
OUT=${OUT:-/tmp/lora-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt"
tb() { torchrun --standalone --nproc-per-node 2 benchmarks/trainer_bench.py --skip-baseline --steps 5 --warmup 2 "$@"; }
case "$1" in
1.5b)
    python3 benchmarks/lora_fold_bench.py --preset qwen2-1.5b --rank 16 > "$OUT/fold_qwen2-1.5b.txt" 2>&1
    python3 benchmarks/lora_fold_bench.py --preset qwen2-7b --rank 16 > "$OUT/fold_qwen2-7b.txt" 2>&1
    common=(--model-preset qwen2-1.5b --seq-len 2048 --micro-batch 8 --micro-batches 8)
    tb "${common[@]}" --variants compile,compile+lora --io-dir /tmp/io-lora > "$OUT/trainer_qwen2-1.5b.txt" 2>&1
    tb "${common[@]}" --variants compile --io-dir /tmp/io-full > "$OUT/trainer_qwen2-1.5b_full_io.txt" 2>&1
    ;;
7b)
    common=(--model-preset qwen2-7b --seq-len 2048 --micro-batch 4 --micro-batches 8)
    tb "${common[@]}" --variants compile+ac,compile+ac+lora --io-dir /tmp/io-lora > "$OUT/trainer_qwen2-7b.txt" 2>&1
    ;;
esac
