#!/usr/bin/env bash
# Goal 5 of issue 24 on one GPU: a 1.5B server's start with the engine process forked (prl's default
# on GPUs, prl.inference.server.gpu_engine_environment) against vLLM's spawn, from the caches a cold
# start left; each step logs to OUT/NAME.log and keeps the server's log, the run ends with OUT/ALL_DONE.
#
#   setsid bash benchmarks/start_session.sh /tmp/gpu-out > /tmp/gpu-out/session.log 2>&1 < /dev/null &
#
# What a cluster install has and the device image lacks (h200-2026-11-28c: every interpreter there ran
# with -B and compiled vLLM's, torch's and transformers' sources at each import): Python's bytecode
# cache, written by the cold start into PYTHONPYCACHEPREFIX (gpu_test_cluster_env). Each warm start runs with Triton's default
# cache emptied: vLLM's warm start loads its compiled model without pointing Triton at the directory
# where the cold start had put the sampler's kernels, so the first warm start after a cold one compiles
# them again (h200-2026-11-28c: 20 s of its warm-up, 1 s on later starts); emptied, each warm start
# pays that alike and the two differ by the start method only.
set -uo pipefail
out=${1:?usage: start_session.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
. benchmarks/session_step.sh  # step NAME LIMIT_S COMMAND...; gpu_test_cluster_env
{ echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE-unset}"  # the image's, before gpu_test_cluster_env
  python3 -c 'import sys; print("dont_write_bytecode", sys.flags.dont_write_bytecode)'; } > "$out/python.txt" 2>&1
gpu_test_cluster_env
work=/tmp/start-session
starts() {  # NAME [ENV...]: one 1.5B server start on GPU 0, to /health only; its log kept
    local name=$1; shift
    step "$name" 300 env CUDA_VISIBLE_DEVICES=0 "$@" python3 benchmarks/server_start_bench.py --preset qwen2-1.5b \
        --gpus 1 --variants servers --no-batches --work "$work" --json "$out/$name.json"
    tar czf "$out/$name-logs.tgz" -C "$work" --exclude=models --exclude=secret .
}
starts cold_fork
rm -rf ~/.triton/cache
starts warm_fork
rm -rf ~/.triton/cache
starts warm_spawn VLLM_WORKER_MULTIPROC_METHOD=spawn  # last: whatever a later start gains favours spawn
touch "$out/ALL_DONE"
