#!/usr/bin/env bash
# The GPU measurements of docs/performance.md ("The whole RL loop on GPU"), in priority order, on a
# machine with 2 GPUs (or 1: second argument); each step logs to OUT/NAME.log, is cut at its own time limit, and the run
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
step() {  # step NAME LIMIT_S COMMAND...: run, log, record the exit status; later steps run either way
    local name=$1 limit=$2; shift 2
    echo "== $(date -u +%T) $name: $*" | tee -a "$out/steps.log"
    timeout --kill-after=20 "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $(date -u +%T) $name exit $?" | tee -a "$out/steps.log"
}
bench=(python3 benchmarks/rl_bench.py --steps 5 --skip 2 --run-timeout 420 --engine-timeout 420 --routes tokens)

if [ "${2:-2}" = 1 ]; then  # one GPU: what the 2-GPU sessions could not measure, most wanted first
    # The GPU tests first: they also show the token route (flat logprobs) works under vLLM 0.26.
    step gpu_tests 420 python3 -m pytest -m gpu tests/test_gpu_rl.py tests/test_trainer_gpu.py -v
    python3 benchmarks/bench_model.py --preset qwen2-1.5b --out /tmp/m15 > "$out/model_1.5b.log" 2>&1
    model15=(configs/toy.yaml model.name=/tmp/m15 model.dtype=bfloat16 model.max_model_len=2048
             inference.gpus_per_node=1 inference.enforce_eager=false inference.gpu_memory_utilization=0.5)
    step weights_1.5b 300 python3 benchmarks/weight_transfer_bench.py "${model15[@]}" --updates 5
    step exactness_0.5b 420 python3 benchmarks/gpu_exactness.py --preset qwen2-0.5b --work /tmp/exactness \
        --json "$out/exactness_0.5b.json"
    step rl_1gpu_1.5b 900 "${bench[@]}" --preset qwen2-1.5b --gpus 1 --async-levels 1,0,2 \
        --work /tmp/rlb1 --json "$out/rl_1gpu_1.5b.json"
    step weights_7b 420 bash -c "python3 benchmarks/bench_model.py --preset qwen2-7b --out /tmp/m7 && \
        python3 benchmarks/weight_transfer_bench.py ${model15[*]} model.name=/tmp/m7 inference.gpu_memory_utilization=0.6 --updates 4"
    touch "$out/ALL_DONE"
    exit 0
fi

# What benchmarks/results/h200x2-2026-11-23b/ lacks, most wanted first; the token route everywhere.
step rl_2gpu_1.5b_async02 1200 "${bench[@]}" --preset qwen2-1.5b --gpus 2 --async-levels 0,2 \
    --work /tmp/rlb1 --json "$out/rl_2gpu_1.5b_async02.json"
step rl_1gpu_1.5b_async1 720 "${bench[@]}" --preset qwen2-1.5b --gpus 1 --async-levels 1 \
    --work /tmp/rlb2 --json "$out/rl_1gpu_1.5b_async1.json"
step rl_2gpu_0.5b_async1 720 "${bench[@]}" --preset qwen2-0.5b --gpus 2 --async-levels 1 \
    --work /tmp/rlb3 --json "$out/rl_2gpu_0.5b_async1.json"
# The GPU tests (the loop, /update_weights against transformers, the trainer's kernels).
step gpu_tests 600 python3 -m pytest -m gpu tests/test_gpu_rl.py tests/test_trainer_gpu.py -v
touch "$out/ALL_DONE"
