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

if [ "${2:-2}" = 1 ]; then  # one GPU: what earlier sessions could not measure, most wanted first
    # (benchmarks/results/h200-2026-11-23c/ has this plan's previous version: GPU tests, file vs gloo
    # broadcast at 1.5B, trainer exactness, the loop at async 1 and 0.)
    # The rollout gap without vLLM's logprobs: the trainer recomputes them (trainer.behaviour_logprobs).
    step rl_1gpu_1.5b_behaviour 1020 "${bench[@]}" --preset qwen2-1.5b --gpus 1 \
        --runs 1:recompute,1:inference,2:recompute --work /tmp/rlb1 --json "$out/rl_1gpu_1.5b_behaviour.json"
    # vLLM's batch invariance and the vLLM-trainer logprob gap on GPU (the trainer part is in -23c).
    step exactness_0.5b 300 python3 benchmarks/gpu_exactness.py --preset qwen2-0.5b --work /tmp/exactness \
        --parts vllm,gap --json "$out/exactness_0.5b.json"
    step gpu_tests 420 python3 -m pytest -m gpu tests/test_gpu_rl.py tests/test_trainer_gpu.py -v
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
