#!/usr/bin/env bash
# Issue 24 on one machine of 2 or 4 GPUs (1.5B, token route, vLLM replicas + the trainer), in priority
# order; each step logs to OUT/NAME.log, is cut at its own limit, and the run ends with OUT/ALL_DONE.
#
#   bash benchmarks/loop_session.sh /tmp/gpu-out &
#
# What h200x2-2026-11-28b left (its README), benchmarks side by side on GPUs of their own where they fit
# (rl_bench reads CUDA_VISIBLE_DEVICES); each plan is written out below. The trainer alone runs 10 steps
# with the recompile log (h200x2-2026-11-28: packed by tokens the loop lost 13-16 s in 2 of 6 steps,
# which 4 steps alone did not show), and every varied loop keeps that log.
# At most one benchmark at a time runs data-parallel vLLM: a precaution (on one node vLLM picks its
# ports itself; not tried side by side).
# Needs, carried: the gpu-vllm bundle unpacked (/tmp/prl-gpu-site), .gpu-mini on PYTHONPATH.
# Poll in calls that follow each other at once (a machine idle for 30 s is given back), each one
# `bash benchmarks/poll_session.sh OUT 540 outK`: it ends at once on a machine that was given back
# meanwhile (h100x4-2026-11-28 slept 560 s on one), and as soon as the session is done.
set -uo pipefail
out=${1:?usage: loop_session.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
. benchmarks/session_step.sh  # step NAME LIMIT_S COMMAND...; gpu_test_cluster_env
gpu_test_cluster_env
work=/tmp/loop-session  # w1-w3: benchmarks side by side need their own (run names are per setting)
loop() {  # NAME VISIBLE GPUS WORK PORT RUN_SPEC [RL_BENCH ARGS...]; the run's logs kept beside its figures
    local name=$1 visible=$2 n=$3 dir=$4 port=$5 spec=$6; shift 6
    step "$name" 540 env CUDA_VISIBLE_DEVICES="$visible" python3 benchmarks/rl_bench.py --preset qwen2-1.5b \
        --gpus "$n" --steps 6 --skip 2 --routes tokens --work "$work/$dir" --port "$port" \
        --offline-json "$out/offline.json" --runs "$spec" --json "$out/$name.json" "$@"
    # Options before the operands: GNU tar ignores an --exclude that follows them. The run's secret stays.
    tar czf "$out/$name-logs.tgz" --exclude='*.pt' --exclude='*.safetensors' --exclude='*.bin' --exclude=checkpoints \
        --exclude=weights --exclude=secret -C "$work/$dir" runs
    rm -rf "$work/$dir/runs"
}
offline() {  # NAME GPU WORK [RL_BENCH ARGS...]: one engine on GPU, the multi-GPU memory settings (--gpus $gpus)
    local name=$1 gpu=$2 dir=$3 others="" g; shift 3
    for (( g = 0; g < gpus; g++ )); do [ "$g" = "$gpu" ] || others+=",$g"; done
    step "$name" 480 env CUDA_VISIBLE_DEVICES="$gpu$others" python3 benchmarks/rl_bench.py --gpus "$gpus" \
        --routes tokens --work "$work/$dir" --skip-loop --json "$out/$name.json" "$@"
}
varied=(--stop-tokens 300 --offline-json "$out/offline_varied.json")
by_tokens="2:inference::trainer.micro_batch_tokens=12288"  # 8 x max_model_len (1536): the prewarm's size
first_step() {  # NAME GPU [FIRST_STEP_BENCH ARGS...]: the trainer alone on varied lengths, fresh compile caches,
    # 10 steps, what each step compiled and why (h200x2-2026-11-28: the loop packed by tokens lost 13-16 s in
    # 2 of 6 steps; the trainer alone showed none in 4); the model the w2 benchmarks wrote, or $model
    local name=$1 gpu=$2; shift 2
    step "$name" 420 env CUDA_VISIBLE_DEVICES="$gpu" TORCH_LOGS=recompiles,graph_breaks python3 \
        benchmarks/first_step_bench.py --model "${model:-$work/w2/models/qwen2-1.5b}" --variants prewarm --stop-tokens 300 \
        --steps 10 --json "$out/$name.json" "$@"
}
start_bench() {  # GPU: a 1.5B server started cold, then warm from the caches the first left (goal 5: a requeued
    # attempt's start), each its own process under py-spy (where .gpu-mini has it) with vLLM's debug log,
    # then where the warm start's time went against the cold one's (spy_diff.py), and the servers' logs
    local spy=.gpu-mini/bin/py-spy run wrap
    for run in cold warm; do
        wrap=(); [ -x "$spy" ] && wrap=("$spy" record --subprocesses --nonblocking --rate 50 --format raw
                                        -o "$out/start_profile_$run.txt" --)
        step "start_bench_$run" 300 env CUDA_VISIBLE_DEVICES="$1" VLLM_LOGGING_LEVEL=DEBUG "${wrap[@]}" python3 \
            benchmarks/server_start_bench.py --preset qwen2-1.5b --gpus 1 --variants servers --work "$work/w4" \
            --json "$out/start_bench_$run.json"
        tar czf "$out/start_bench_$run-logs.tgz" -C "$work/w4" --exclude=models --exclude=secret .
    done
    [ -x "$spy" ] && python3 benchmarks/spy_diff.py "$out/start_profile_cold.txt" "$out/start_profile_warm.txt" \
        > "$out/start_profile_diff.txt" 2>&1
}
warm_start() {  # NAME BATCH [ENV...]: one more 1.5B server start on GPU 0 from start_bench's caches, not profiled,
    # with ENV (vLLM's own start settings, which the server inherits); its log kept
    local name=$1 size=$2; shift 2
    step "$name" 300 env CUDA_VISIBLE_DEVICES=0 "$@" python3 benchmarks/server_start_bench.py --preset qwen2-1.5b \
        --gpus 1 --variants servers --batch-size "$size" --work "$work/w4" --json "$out/$name.json"
    tar czf "$out/$name-logs.tgz" -C "$work/w4" --exclude=models --exclude=secret .
}
if [ "$gpus" -eq 1 ]; then
    # On 1 GPU (the only kind lent in the session after h200x2-2026-11-28b): a server's cold then warm
    # start, profiled, logs kept (goal 5: where a requeued attempt's 95 s go); the trainer alone packed by
    # count on varied lengths, 10 steps with the recompile log (the non-strict mix-order reduction in
    # compile_layers); the trainer's GPU tests. Then more warm starts, one setting each, against a plain
    # one: vLLM's saved startup plan (VLLM_ENABLE_STARTUP_PLAN: the first start saves it, the next skips the
    # memory profiling) and the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0: the V2 runner's warm-up JIT
    # took 16 s of the cold start; the full batch, since its speed matters as much).
    start_bench 0
    model=$work/w4/models/qwen2-1.5b first_step first_step_varied 0
    step gpu_trainer_tests 300 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -m gpu tests/test_trainer_gpu.py -v \
        -p no:cacheprovider
    warm_start warm_plain 64
    warm_start warm_v1_runner 256 VLLM_USE_V2_MODEL_RUNNER=0
    warm_start warm_plan_save 64 VLLM_ENABLE_STARTUP_PLAN=1
    warm_start warm_plan_use 64 VLLM_ENABLE_STARTUP_PLAN=1
    touch "$out/ALL_DONE"
    exit 0
fi
if [ "$gpus" -lt 4 ]; then
    # On 2 GPUs, what h200x2-2026-11-28b left (its README): phase 1, side by side, GPU 0 a server's cold
    # then warm start, profiled, its logs kept this time; GPU 1 the varied baseline, then the trainer alone packed
    # by count, 10 steps with the recompile log (8 varied samples fill the 3,414-4,095-token band that
    # compiled there: mix-order reduction's strict mode, now off in compile_layers), then the trainer's
    # GPU tests (one per such threshold among them). Phase 2: the by-count varied loop.
    start_bench 0 &
    { offline offline_varied 1 w2 --preset qwen2-1.5b --stop-tokens 300; first_step first_step_varied 1
      step gpu_trainer_tests 240 env CUDA_VISIBLE_DEVICES=1 python3 -m pytest -m gpu tests/test_trainer_gpu.py -v \
          -p no:cacheprovider; } &
    wait
    TORCH_LOGS=recompiles,graph_breaks loop loop_2gpu_async2_varied 0,1 2 w2 18100 "2:inference" "${varied[@]}"
    touch "$out/ALL_DONE"
    exit 0
fi
# On 4 GPUs, what h200x2-2026-11-28b left, in phases, with the recompile log. Phase 1, side by side: a
# server's cold and warm start, profiled (GPU 3); the varied baseline, then the trainer alone packed by
# count, 10 steps (GPU 2; 8 varied samples fill the band that compiled there, now without a guard); the
# by-count varied loop at 1 + 1 (GPUs 0-1). Phase 2: varied lengths by tokens at 2 + 2 (vLLM data-
# parallel on GPUs 0-1, the trainer on 2-3): a rank short of micro-batches trains the one-token filler,
# which the prewarm of a several-rank trainer now meets first. Phase 3: the trainer's GPU tests, then
# the CPU benches.
{ start_bench 3; } &
{ offline offline_varied 2 w2 --preset qwen2-1.5b --stop-tokens 300; first_step first_step_varied 2; } &
TORCH_LOGS=recompiles,graph_breaks loop loop_2gpu_async2_varied 0,1 2 w1 18100 "2:inference" "${varied[@]}"
wait
TORCH_LOGS=recompiles,graph_breaks loop loop_2plus2_async2_varied_by_tokens 0,1,2,3 4 w2 18100 "$by_tokens" \
    "${varied[@]}" --trainer-gpus 2
step gpu_trainer_tests 240 env CUDA_VISIBLE_DEVICES=3 python3 -m pytest -m gpu tests/test_trainer_gpu.py -v \
    -p no:cacheprovider
step hash_bench 120 python3 benchmarks/hash_bench.py --rounds 3
step logprob_messages 120 python3 benchmarks/logprob_path_bench.py messages
touch "$out/ALL_DONE"
