#!/usr/bin/env bash
# On a machine of 2 GPUs (nvidia-h100-x2 / -h200-x2): what the signed weight broadcast costs at 1.5B
# (benchmarks/weight_transfer_bench.py, NCCL from GPU 1 into a server on GPU 0), then whether vLLM 0.26
# serves one data-parallel endpoint across two "nodes" and at what rate against independent servers
# (benchmarks/vllm_dp_probe.py). Each step logs to OUT/NAME.log; the run ends with OUT/ALL_DONE.
#
#   setsid bash benchmarks/gpu_weights_dp_session.sh /tmp/gpu-out &
#
# Needs the gpu-vllm bundle unpacked (/tmp/prl-gpu-site).
set -uo pipefail
out=${1:?usage: gpu_weights_dp_session.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
. /tmp/prl-gpu-site/env.sh
export PYTHONPATH=$PYTHONPATH:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
. benchmarks/session_step.sh  # step NAME LIMIT_S COMMAND...
nvidia-smi -L > "$out/gpus.txt"
step model_1.5b 300 python3 benchmarks/bench_model.py --preset qwen2-1.5b --out /tmp/m15
step weights_1.5b 600 python3 benchmarks/weight_transfer_bench.py configs/toy.yaml model.name=/tmp/m15 \
    model.dtype=bfloat16 model.max_model_len=2048 inference.gpus_per_node=1 inference.enforce_eager=false \
    --sender-device cuda:1 --updates 6
step dp_probe_1.5b 900 python3 benchmarks/vllm_dp_probe.py --model /tmp/m15 --work /tmp/dp-probe --json "$out/dp_probe_1.5b.json"
cp /tmp/dp-probe/*.log "$out/" 2>/dev/null
touch "$out/ALL_DONE"
