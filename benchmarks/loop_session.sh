#!/usr/bin/env bash
# Issue 24 on one machine of 1, 2 or 4 GPUs (1.5B, token route, vLLM replicas + the trainer), in
# priority order; each step logs to OUT/NAME.log, is cut at its own limit, and the run ends with
# OUT/ALL_DONE.
#
#   bash benchmarks/loop_session.sh /tmp/gpu-out &
#   bash benchmarks/loop_session.sh /tmp/gpu-out benchmarks/results/h200x2-2026-11-28d/first_step_1plus1_1.json &
#       (the first-step series alone: see given_baseline below)
#
# What h200x2-2026-11-28b to -28g and h200-2026-11-28c left (their READMEs), benchmarks
# side by side on GPUs of their own where they fit (rl_bench reads CUDA_VISIBLE_DEVICES); each plan is
# written out below.
# Every varied loop keeps the recompile log (h200x2-2026-11-28: packed by tokens the loop lost 13-16 s
# in 2 of 6 steps).
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
first_step_series() {  # NAME VISIBLE GPUS PORT [RL_BENCH ARGS...]: the 1.5B loop launched $launches times in a
    # row on the caches the one before left, $series_steps steps each (goal 5): a run's first attempt (after the
    # offline baseline's engine, unless one was given), then runs that start from what it compiled; each
    # run's logs kept
    local name=$1 visible=$2 n=$3 port=$4 i; shift 4
    for (( i = 1; i <= launches; i++ )); do
        local baseline=(--offline-json "${given_baseline:-$out/${name}_1.json}") resumed=()
        [ "$i" = 1 ] && [ -z "$given_baseline" ] && baseline=()
        [ "$i" = "$launches" ] && [ -n "$resume_last" ] && resumed=(--resume-steps 1)
        step "${name}_$i" 540 env CUDA_VISIBLE_DEVICES="$visible" python3 benchmarks/rl_bench.py --preset qwen2-1.5b \
            --gpus "$n" --steps "$series_steps" --skip 1 --routes tokens --work "$work/fs" --port "$port" \
            --runs 2:inference --json "$out/${name}_$i.json" "${baseline[@]}" "${resumed[@]}" "$@"
        tar czf "$out/${name}_$i-logs.tgz" --exclude='*.pt' --exclude='*.safetensors' --exclude='*.bin' \
            --exclude=checkpoints --exclude=weights --exclude=secret -C "$work/fs" runs
        rm -rf "$work/fs/runs"
    done
}
given_baseline=${2:-} launches=2 series_steps=3 resume_last=1
if [ -n "$given_baseline" ]; then
    # `loop_session.sh OUT BASELINE_JSON`: the series alone (1 + 1 where there are two GPUs), two
    # launches of 2 steps, the offline figures taken from an earlier run's JSON. SERIES_LAUNCHES=1: one
    # launch, resumed (a requeued attempt's first step, in under 6 min on a fresh machine).
    series_steps=2 launches=${SERIES_LAUNCHES:-2}
    if [ "$gpus" -eq 1 ]; then first_step_series first_step_1gpu 0 1 18100
    else first_step_series first_step_1plus1 0,1 2 18100; fi
    find ~/.cache/vllm -name cache_key_factors.json -exec grep -l VLLM_API_KEY {} + > "$out/key_in_vllm_cache.txt"
    touch "$out/ALL_DONE"
    exit 0
fi
# The 1- and 4-GPU plans first launch the loop twice (goal 5 of issue 24): a fresh machine's first
# run (after the offline baseline's engine), then a new run on what it compiled (every cache a
# requeued attempt keeps, in local mode, is kept across runs: ~/.cache/vllm, ~/.cache/prl/inductor,
# ~/.cache/prl/triton), then that run resumed for one step (`resumed` in its JSON: a requeued
# attempt's first step, its checkpoint loaded; 63.1 s at 1 + 1 on h200x2-2026-11-28f).
if [ "$gpus" -eq 1 ]; then
    first_step_series first_step_1gpu 0 1 18100  # vLLM and the trainer share the GPU (--kv-cache-gib)
    touch "$out/ALL_DONE"
    exit 0
fi
if [ "${LOOP_PLAN:-}" = probe ]; then
    # `LOOP_PLAN=probe loop_session.sh OUT` on 2 GPUs: an engine bound by its core's CPU thread.
    # h200x2-2026-11-28i (benchmarks/probe_timeline.py over its samples): while a batch generated, the
    # engine core's busiest thread used 96 % of a core and GPU 0 was busy 39 % of the time, at full
    # clock (25k tok/s). First whether a second engine on the GPU adds rollouts (engines_per_gpu_bench:
    # 1, 2, then 1 again for the drift), then the loop at 1 + 1 (recompute, 8 steps) with one server
    # and with two on the vLLM GPU (inference.servers_per_gpu), each sampled (machine_sampler.sh, vLLM's
    # stats each second) and the one-server loop's engine core profiled by py-spy for 20 s from batch 3
    # (spy_diff.py reads it), then the first-step series. The offline figures are -28h's (another
    # machine: the efficiency column does not hold; the per-second figures do).
    probed() {  # NAME COMMAND...: COMMAND with the machine sampled into $out/NAME.*
        local name=$1 sampler; shift
        setsid bash benchmarks/machine_sampler.sh "$out/$name" & sampler=$!
        "$@"
        kill -- -"$sampler"
    }
    spy_server() {  # RUNS_DIR NAME: py-spy of the run's inference server for 20 s once batch 3 is written
        local log="" i pid
        for (( i = 0; i < 600; i++ )); do
            log=$(ls "$1"/*/logs/attempt_0/orchestrator/rank_0.log 2> /dev/null | head -1)
            [ -n "$log" ] && grep -q "batch 3:" "$log" && break
            sleep 1
        done
        pid=$(grep -o "inference rank 0: pid [0-9]*" "${log%orchestrator/rank_0.log}inference/rank_0.log" | tail -1 | grep -o "[0-9]*$")
        [ -n "$pid" ] || { echo "spy_server: no server pid under $1" > "$out/$2.spy.log"; return; }
        .gpu-mini/bin/py-spy record --subprocesses -p "$pid" -d 20 -r 100 --format raw -o "$out/$2.spy.txt" \
            > "$out/$2.spy.log" 2>&1
    }
    export VLLM_LOG_STATS_INTERVAL=1
    step bench_model 300 python3 benchmarks/bench_model.py --preset qwen2-1.5b --out "$work/models/qwen2-1.5b"
    # PROBE_SKIP_ENGINES=1: a machine after one that measured them (h200x2-2026-11-28j)
    [ -n "${PROBE_SKIP_ENGINES:-}" ] || probed probe_engines step engines_per_gpu 420 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/engines_per_gpu_bench.py \
        "$work/models/qwen2-1.5b" --engines 1,2,1 --kv-cache-gib 16 --work "$work/engines"
    long=(--offline-json benchmarks/results/h200x2-2026-11-28h/offline.json --steps 8 --skip 3)
    two="inference.servers_per_gpu=2:inference.data_parallel=2:inference.replica_servers=true"
    two+=":inference.gpu_memory_utilization=0.42:inference.extra_args=[--kv-cache-memory-bytes=17179869184]"
    probed probe_two loop loop_two_servers 0,1 2 w3 18100 "2:recompute::$two" "${long[@]}"
    spy_server "$work/w2/runs" loop_engine & spy=$!
    probed probe_loop loop loop_probe 0,1 2 w2 18100 "2:recompute" "${long[@]}"
    kill "$spy" 2> /dev/null  # still waiting for a batch 3 that never came: its 20 s ended long before
    wait
    # Goal 5 last, now that the token route's tokenizer loads before the servers are waited for: a new
    # run, then a run on its caches resumed for a step (63.1 s to a resumed attempt's first step on
    # h200x2-2026-11-28f).
    given_baseline=benchmarks/results/h200x2-2026-11-28h/offline.json series_steps=2
    first_step_series first_step_1plus1 0,1 2 18100
    touch "$out/ALL_DONE"
    exit 0
fi
if [ "$gpus" -lt 4 ]; then
    # On 2 GPUs, goal 1 at 1 + 1 (0.82 with recompute, batch by batch, h100x4-2026-11-28; 0.79 on
    # h200x2-2026-11-28f with each version staged, its engine slower than -28g's): first whether a
    # server's first batches, and the batch after a weight update, run slower in the engine alone
    # (reload_bench), then this machine's offline baseline, then batch by batch staged
    # (inference.stage_weights, the default) and not, and continuous mode, 8 steps each. The
    # first-step series (goal 5) ran on -28f: `loop_session.sh OUT BASELINE_JSON` runs it alone.
    step reload_bench 420 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/reload_bench.py --preset qwen2-1.5b \
        --work "$work/reload" --rounds 2
    offline offline 0 w1 --preset qwen2-1.5b
    long=(--steps 8 --skip 3)
    loop loop_2gpu_async2_recompute 0,1 2 w2 18100 "2:recompute" "${long[@]}"
    loop loop_2gpu_async2_recompute_unstaged 0,1 2 w2 18100 "2:recompute::inference.stage_weights=false" "${long[@]}"
    loop loop_2gpu_async2_continuous 0,1 2 w2 18100 "2:inference::orchestrator.continuous=true" "${long[@]}"
    touch "$out/ALL_DONE"
    exit 0
fi
fixed=(--offline-json "$out/first_step_1plus1_1.json")  # the series' baseline: 1024 tokens, GPU 0
# On 4 GPUs. Phase 1: the series at 1 + 1 (GPUs 0-1), alone (a start is CPU work that benchmarks
# beside it would slow). Phase 2, side by side: goal 1 at 1 + 1 in continuous mode (GPUs 0-1, as on
# 2 GPUs), the varied baseline (GPU 2), the trainer's GPU tests (GPU 3). Phase 3: varied lengths by
# tokens at 2 + 2 (vLLM data-parallel on GPUs 0-1, the trainer on 2-3): a rank short of
# micro-batches trains the one-token filler, which the prewarm of a several-rank trainer now meets
# first. Then 1 + 1 batch by batch, the reference for phase 2, and the CPU benches.
first_step_series first_step_1plus1 0,1 2 18100
loop loop_2gpu_async2_continuous 0,1 2 w1 18100 "2:inference::orchestrator.continuous=true" "${fixed[@]}" &
offline offline_varied 2 w2 --preset qwen2-1.5b --stop-tokens 300 &
step gpu_trainer_tests 240 env CUDA_VISIBLE_DEVICES=3 python3 -m pytest -m gpu tests/test_trainer_gpu.py -v \
    -p no:cacheprovider &
wait
TORCH_LOGS=recompiles,graph_breaks loop loop_2plus2_async2_varied_by_tokens 0,1,2,3 4 w2 18100 "$by_tokens" \
    "${varied[@]}" --trainer-gpus 2
loop loop_2gpu_async2_recompute 0,1 2 w1 18100 "2:recompute" "${fixed[@]}"
step hash_bench 120 python3 benchmarks/hash_bench.py --rounds 3
step logprob_messages 120 python3 benchmarks/logprob_path_bench.py messages
touch "$out/ALL_DONE"
