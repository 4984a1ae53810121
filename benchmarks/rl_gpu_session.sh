#!/usr/bin/env bash
# The GPU measurements of docs/performance.md ("The whole RL loop on GPU"), in priority order, on a
# machine with 2 GPUs; each step logs to OUT/NAME.log, is cut at its own time limit, and the run
# ends with OUT/ALL_DONE.
#
#   bash benchmarks/rl_gpu_session.sh /tmp/gpu-out &     # then collect OUT while it runs
#
# Needs vLLM 0.26 importable (tools/setup.sh on a GPU machine, or the gpu-vllm bundle's env.sh).
set -uo pipefail
out=${1:?usage: rl_gpu_session.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
step() {  # step NAME LIMIT_S COMMAND...: run, log, record the exit status; later steps run either way
    local name=$1 limit=$2; shift 2
    echo "== $(date -u +%T) $name: $*" | tee -a "$out/steps.log"
    timeout --kill-after=20 "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $(date -u +%T) $name exit $?" | tee -a "$out/steps.log"
}
bench=(python3 benchmarks/rl_bench.py --preset qwen2-1.5b --gpus 2 --steps 5 --skip 2 --run-timeout 420)

# The loop with the token route (/prl/generate), inference on GPU 0 and the trainer on GPU 1.
step rl_2gpu_1.5b_tokens_async1 720 "${bench[@]}" --async-levels 1 --routes tokens \
    --work /tmp/rlb1 --json "$out/rl_2gpu_1.5b_tokens_async1.json"
# The GPU tests on GPU 0 while GPU 1 measures /update_weights of a 7B model from local disk.
step gpu_tests_and_7b 600 bash -c "
    CUDA_VISIBLE_DEVICES=0 python3 -m pytest -m gpu tests/test_gpu_rl.py tests/test_trainer_gpu.py -v \
        > '$out/gpu_tests.log' 2>&1 &
    tests=\$!
    CUDA_VISIBLE_DEVICES=1 python3 benchmarks/bench_model.py --preset qwen2-7b --out /tmp/m7 &&
    CUDA_VISIBLE_DEVICES=1 python3 benchmarks/inference_bench.py configs/toy.yaml model.name=/tmp/m7 \
        model.dtype=bfloat16 model.max_model_len=2048 inference.gpus_per_node=1 --requests 16 --tokens 64 --updates 5
    wait \$tests; echo tests exit \$?"
# Before/after at loop level: the same run through Chat Completions.
step rl_2gpu_1.5b_chat_async1 720 "${bench[@]}" --async-levels 1 --routes chat \
    --work /tmp/rlb2 --json "$out/rl_2gpu_1.5b_chat_async1.json"
step rl_2gpu_1.5b_tokens_async02 1200 "${bench[@]}" --async-levels 0,2 --routes tokens \
    --work /tmp/rlb3 --json "$out/rl_2gpu_1.5b_tokens_async02.json"
touch "$out/ALL_DONE"
