#!/usr/bin/env bash
# Issue 24 on one machine of 4 GPUs (1.5B and 7B, token route, vLLM replicas + the trainer), in priority
# order; each step logs to OUT/NAME.log, is cut at its own limit, and the run ends with OUT/ALL_DONE.
#
#   bash benchmarks/loop_session.sh /tmp/gpu-out &
#
# What the 4 x H200 session of h200x4-2026-11-27e (code 4094192: 1 + 1, 2 + 1, 3 + 1 at async 2,
# broadcast, a server per replica) left open, in phases of about 5.5 minutes, benchmarks side by side on
# GPUs of their own where they fit (rl_bench reads CUDA_VISIBLE_DEVICES):
# 0. benchmarks/hash_bench.py (CPU, seconds): the tag's hashing in pieces against a task per tensor;
#    logprob_path_bench.py messages (CPU, seconds): what vLLM's logprobs add per step on these cores;
# 1. GPU 3: rl_bench's offline baseline at 1.5B (every 1.5B ratio's denominator), then where vLLM's
#    logprobs go on the GPU (logprob_path_bench.py engine under vLLM's torch profiler, with and without);
#    GPUs 0-1: the loop at 1 + 1 with trainer.behaviour_logprobs=recompute, async 2
#    (configs/one_node_2gpu.yaml's choice; its efficiency from perf/behaviour_s); GPU 2: the 7B model
#    built, then its offline baseline;
# 2. continuous mode against batch by batch, completions of varying length (--stop-tokens), 1 + 1 each
#    (GPUs 0-1 and 2-3);
# 3. 7B at 2 + 2 (FSDP over two trainer GPUs), async 2, weights by file; 4. the same by NCCL broadcast;
# 5. the logprob path's Python under py-spy (if .gpu-mini/bin has it), each way, on one GPU;
# 6. 3 + 1 with a server per replica, now with one torch thread each, then 7. 3 + 1 with vLLM's data
#    parallelism (the same machine's comparison); 8. server start-up with warm caches, if the lease lasts.
# On a machine of 2 GPUs (the kinds lent change): 0, then 1 with the baseline and the profile on GPU 1
# before the loop on both, and 2 one run after the other; the rest needs 4.
# At most one benchmark at a time runs data-parallel vLLM: a precaution (on one node vLLM picks its
# ports itself; not tried side by side).
# Needs, carried: the gpu-vllm bundle unpacked (/tmp/prl-gpu-site), .gpu-mini on PYTHONPATH.
# Poll in calls that follow each other at once (a machine idle for 30 s is given back), fetching OUT
# after each phase.
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
    tar czf "$out/$name-logs.tgz" -C "$work/$dir" runs --exclude='*.pt' --exclude='*.safetensors' --exclude='*.bin' \
        --exclude=checkpoints --exclude=weights 2>/dev/null
    rm -rf "$work/$dir/runs"
}
offline() {  # NAME GPU WORK [RL_BENCH ARGS...]: one engine on GPU, the multi-GPU memory settings (--gpus $gpus)
    local name=$1 gpu=$2 dir=$3 others="" g; shift 3
    for (( g = 0; g < gpus; g++ )); do [ "$g" = "$gpu" ] || others+=",$g"; done
    step "$name" 480 env CUDA_VISIBLE_DEVICES="$gpu$others" python3 benchmarks/rl_bench.py --gpus "$gpus" \
        --routes tokens --work "$work/$dir" --skip-loop --json "$out/$name.json" "$@"
}
# The 1.5B engine (built by rl_bench in WORK) without and with logprobs, profiled on GPU:
logprob_ops() {  # GPU WORK: vLLM's torch profiler, the ops of 100 steps each way, GPU time first
    mkdir -p "$out/logprob_ops"
    step logprob_engine 420 env CUDA_VISIBLE_DEVICES="$1" python3 benchmarks/logprob_path_bench.py engine \
        "$work/$2/models/qwen2-1.5b" --completion-tokens 1024 --rounds 1 --torch-profile "$out/logprob_ops"
}
logprob_spy() {  # GPU WORK: py-spy over every process of the engine, each way, and the difference
    local spy=.gpu-mini/bin/py-spy model=$work/$2/models/qwen2-1.5b v
    [ -x "$spy" ] || { echo "no $spy: tools/make_gpu_mini.sh" >> "$out/steps.log"; return; }
    for v in plain logprobs; do  # py-spy starts the bench: a parent may trace its children
        step "logprob_profile_$v" 300 env CUDA_VISIBLE_DEVICES="$1" "$spy" record --subprocesses --nonblocking \
            --rate 50 --format raw -o "$out/logprob_profile_$v.txt" -- python3 benchmarks/logprob_path_bench.py \
            engine "$model" --completion-tokens 1024 --rounds 1 --only "$v"
    done
    python3 benchmarks/spy_diff.py "$out/logprob_profile_plain.txt" "$out/logprob_profile_logprobs.txt" \
        > "$out/logprob_profile_diff.txt" 2>&1
}
step hash_bench 120 python3 benchmarks/hash_bench.py --rounds 3  # CPU only: the broadcast tag's hashing, old against pieces
step logprob_messages 120 python3 benchmarks/logprob_path_bench.py messages  # CPU only: logprobs' messages on this host's cores
if [ "$gpus" -lt 4 ]; then
    offline offline 1 w2 --preset qwen2-1.5b
    logprob_ops 1 w2
    logprob_spy 1 w2
    loop loop_2gpu_async2_recompute 0,1 2 w1 18100 "2:recompute"
    loop loop_2gpu_async2_varied 0,1 2 w1 18100 "2:inference" --stop-tokens 300
    loop loop_2gpu_async2_varied_continuous 0,1 2 w1 18100 "2:inference::orchestrator.continuous=true" --stop-tokens 300
    touch "$out/ALL_DONE"
    exit 0
fi
seven_b=(--preset qwen2-7b --trainer-gpus 2 --steps 5 --run-timeout 480 --offline-json "$out/offline_7b.json")
{ offline offline 3 w2 --preset qwen2-1.5b; logprob_ops 3 w2; } &
offline offline_7b 2 w3 --preset qwen2-7b &  # the 7B built on GPU 2 first
loop loop_2gpu_async2_recompute 0,1 2 w1 18100 "2:recompute"
wait
# Ratios against the fixed-length baseline; what compares is the two runs' step and trainer idle.
loop loop_2gpu_async2_varied 0,1 2 w1 18100 "2:inference" --stop-tokens 300 &
loop loop_2gpu_async2_varied_continuous 2,3 2 w2 18200 "2:inference::orchestrator.continuous=true" --stop-tokens 300
wait
loop loop_7b_2plus2_async2 0,1,2,3 4 w3 18300 "2:inference::trainer.activation_checkpointing=true" "${seven_b[@]}"
loop loop_7b_2plus2_async2_broadcast 0,1,2,3 4 w3 18300 \
    "2:inference::trainer.activation_checkpointing=true:inference.weight_transfer=broadcast" "${seven_b[@]}"
logprob_spy 3 w2
loop loop_4gpu_async2_servers 0,1,2,3 4 w1 18100 "2:inference::inference.replica_servers=true"
loop loop_4gpu_async2 0,1,2,3 4 w1 18100 "2:inference"
step start_bench 420 python3 benchmarks/server_start_bench.py --model "$work/w1/models/qwen2-1.5b" \
    --gpus $(( gpus - 1 )) --variants dp,servers --work "$work/start" --json "$out/start_bench.json"
touch "$out/ALL_DONE"
