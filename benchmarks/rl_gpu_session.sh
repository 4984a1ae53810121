#!/usr/bin/env bash
# The GPU measurements of docs/performance.md ("The whole RL loop on GPU"), in priority order, on a
# machine with 2 GPUs, or 3+ (or 1: second argument); each step logs to OUT/NAME.log, is cut at its own time limit, and the run
# ends with OUT/ALL_DONE.
#
#   bash benchmarks/rl_gpu_session.sh /tmp/gpu-out &     # then collect OUT while it runs
#   bash benchmarks/rl_gpu_session.sh /tmp/gpu-out 1 &   # the one-GPU plan
#
# Needs vLLM 0.26 importable (tools/setup.sh on a GPU machine, or the gpu-vllm bundle's env.sh).
set -uo pipefail
out=${1:?usage: rl_gpu_session.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
. benchmarks/session_step.sh  # step NAME LIMIT_S COMMAND...
bench=(python3 benchmarks/rl_bench.py --steps 5 --skip 2 --run-timeout 420 --engine-timeout 420 --routes tokens)

if [ "${2:-2}" = 1 ]; then  # one GPU: what earlier sessions could not measure, most wanted first
    # (benchmarks/results/h100-2026-11-23e/ and -23f/ have this plan's previous versions.)
    # /update_weights against transformers, and in flight (orchestrator.continuous) with CUDA graphs.
    step gpu_update_tests 300 python3 -m pytest -m gpu tests/test_gpu_rl.py -k update_weights -v -s
    # orchestrator.continuous against batch by batch at async 2 and 1, completions of varying length
    # (300 stop tokens); 10 steps, the first 4 left out (compilation, the pipeline filling up).
    step rl_1gpu_1.5b_continuous 1500 "${bench[@]}" --preset qwen2-1.5b --gpus 1 --stop-tokens 300 --steps 10 --skip 4 \
        --runs 2:inference,2:inference::orchestrator.continuous=true,1:inference,1:inference::orchestrator.continuous=true \
        --work /tmp/rlb1 --json "$out/rl_1gpu_1.5b_continuous.json"
    touch "$out/ALL_DONE"
    exit 0
fi

# 2 GPUs: what no session has measured yet (only one-GPU kinds were lent since
# benchmarks/results/h200x2-2026-11-23b/), most wanted first; the token route everywhere.
# vLLM on its own GPU without its logprob path (the trainer recomputes them), against with it: the 0.80 goal.
step rl_2gpu_1.5b_behaviour 1200 "${bench[@]}" --preset qwen2-1.5b --gpus 2 \
    --runs 1:recompute,1:inference,2:recompute,0:inference --work /tmp/rlb1 --json "$out/rl_2gpu_1.5b_behaviour.json"
# Continuous mode where it is meant to help: vLLM on its own GPU, completions of varying length.
step rl_2gpu_1.5b_continuous 1200 "${bench[@]}" --preset qwen2-1.5b --gpus 2 --stop-tokens 300 --steps 10 --skip 4 \
    --runs 1:inference,1:inference::orchestrator.continuous=true --work /tmp/rlb2 --json "$out/rl_2gpu_1.5b_continuous.json"
# With 3 or more GPUs: 2 vLLM replicas for one trainer GPU, the layout docs/gpu.md estimates from figures.
if [ "$(nvidia-smi -L | wc -l)" -ge 3 ]; then
    step rl_3gpu_1.5b 900 "${bench[@]}" --preset qwen2-1.5b --gpus 3 --runs 1:inference,1:recompute \
        --work /tmp/rlb3 --json "$out/rl_3gpu_1.5b.json"
fi
# NCCL broadcast (server on GPU 0, sender on GPU 1) against the file path, 1.5B and 7B.
python3 benchmarks/bench_model.py --preset qwen2-1.5b --out /tmp/m15 > "$out/model_1.5b.log" 2>&1
step weights_nccl_1.5b 300 python3 benchmarks/weight_transfer_bench.py configs/toy.yaml model.name=/tmp/m15 \
    model.dtype=bfloat16 model.max_model_len=2048 inference.gpus_per_node=1 --sender-device cuda:1
python3 benchmarks/bench_model.py --preset qwen2-7b --out /tmp/m7 > "$out/model_7b.log" 2>&1
step weights_nccl_7b 420 python3 benchmarks/weight_transfer_bench.py configs/toy.yaml model.name=/tmp/m7 \
    model.dtype=bfloat16 model.max_model_len=2048 inference.gpus_per_node=1 --sender-device cuda:1
# The GPU tests (the loop, /update_weights against transformers, the trainer's kernels).
step gpu_tests 600 python3 -m pytest -m gpu tests/test_gpu_rl.py tests/test_trainer_gpu.py -v
touch "$out/ALL_DONE"
