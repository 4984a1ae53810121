#!/usr/bin/env bash
# Issue 24 on one machine of 4 GPUs (1.5B and 7B, token route, vLLM replicas + the trainer), in priority
# order; each step logs to OUT/NAME.log, is cut at its own limit, and the run ends with OUT/ALL_DONE.
#
#   bash benchmarks/loop_session.sh /tmp/gpu-out &
#
# On 4 GPUs, in phases (benchmarks side by side on GPUs of their own where they fit; rl_bench reads
# CUDA_VISIBLE_DEVICES): what h200x4-2026-11-28 fixed, checked (the prewarm's halving micro-batches, the
# broadcast's spare slot), and a server's warm start (goal 5); the plan is written out below.
# The trainer alone runs 10 steps each way with the recompile log (h200x2-2026-11-28: packed by tokens the
# loop lost 13-16 s in 2 of 6 steps, which 4 steps alone did not show), and every varied loop keeps that log.
# On a machine of 2 GPUs (the kinds lent change), what h200x2-2026-11-28b left, written out below.
# At most one benchmark at a time runs data-parallel vLLM: a precaution (on one node vLLM picks its
# ports itself; not tried side by side).
# Needs, carried: the gpu-vllm bundle unpacked (/tmp/prl-gpu-site), .gpu-mini on PYTHONPATH.
# Poll in calls that follow each other at once (a machine idle for 30 s is given back), each one
# `bash benchmarks/poll_session.sh OUT 540 outK`: it ends at once on a machine that was given back
# meanwhile (h100x4-2026-11-28 slept 560 s on one), and as soon as the session is done.
set -uo pipefail
out=${1:?usage: loop_session.sh OUT_DIR [OFFLINE_7B_JSON: the 7B baseline from an earlier machine of this kind]}
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
    # 2 of 6 steps; the trainer alone showed none in 4)
    local name=$1 gpu=$2; shift 2
    step "$name" 420 env CUDA_VISIBLE_DEVICES="$gpu" TORCH_LOGS=recompiles,graph_breaks python3 \
        benchmarks/first_step_bench.py --model "$work/w2/models/qwen2-1.5b" --variants prewarm --stop-tokens 300 \
        --steps 10 --json "$out/$name.json" "$@"
}
first_steps() {  # GPU: by count, then by tokens
    first_step first_step_varied "$1"
    first_step first_step_varied_by_tokens "$1" --micro-batch-tokens 12288
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
# What h200x4-2026-11-28 fixed, checked, and goal 5's warm start. Phase 1, side by side, with the
# recompile log: the trainer alone on varied lengths by count then by tokens, 10 steps each (GPU 2, after
# the varied baseline; the prewarm's halving micro-batches should leave every step without a compile);
# the by-tokens loop (GPUs 0-1; it compiled 17.2 s in step 2 at h200x4-2026-11-28); a 1.5B server
# started cold, then warm from the cache the first left, then the 7B baseline (GPU 3). Phase 2: 7B at
# 2 + 2 by broadcast (one export took 7.5 s there: a version not offered, now in a spare pinned slot).
# Phase 3: the trainer's GPU tests (GPU 3) beside the by-count loop (GPUs 0-1); the CPU benches.
# OFFLINE_7B_JSON: the 7B baseline from an earlier machine of this kind (this one then skips it).
# The 7B trainer on two cards: fp32 master weights and Adam are 57 GiB a card, so the kept logits are
# capped at 1 GiB (4 by default); it peaked at 66.8 GiB a card. 6 steps, means over 3-6.
seven_b=(--preset qwen2-7b --trainer-gpus 2 --steps 6 --run-timeout 510 --offline-json "$out/offline_7b.json")
seven_b_set="2:inference::trainer.activation_checkpointing=true:trainer.keep_logits_gib=1"
[ -n "${2:-}" ] && cp "$2" "$out/offline_7b.json"
{ start_bench 3
  [ -n "${2:-}" ] || offline offline_7b 3 w3 --preset qwen2-7b; } &
{ offline offline_varied 2 w2 --preset qwen2-1.5b --stop-tokens 300; first_steps 2; } &
TORCH_LOGS=recompiles,graph_breaks loop loop_2gpu_async2_varied_by_tokens 0,1 2 w1 18100 "$by_tokens" "${varied[@]}"
wait
loop loop_7b_2plus2_async2_broadcast 0,1,2,3 4 w3 18300 "$seven_b_set:inference.weight_transfer=broadcast" "${seven_b[@]}"
step gpu_trainer_tests 240 env CUDA_VISIBLE_DEVICES=3 python3 -m pytest -m gpu tests/test_trainer_gpu.py -v \
    -p no:cacheprovider &
TORCH_LOGS=recompiles,graph_breaks loop loop_2gpu_async2_varied 0,1 2 w1 18100 "2:inference" "${varied[@]}"
wait
step hash_bench 120 python3 benchmarks/hash_bench.py --rounds 3
step logprob_messages 120 python3 benchmarks/logprob_path_bench.py messages
touch "$out/ALL_DONE"
