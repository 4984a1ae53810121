#!/usr/bin/env bash
# The toy RL job on the test cluster (tools/slurm_cluster.sh up), with every process's CPU sampled by top
# until its second step: what the machine does during the first batch. Prints the server's ready time
# and the first batches' times.
#
#   bash benchmarks/first_batch_slurm_probe.sh [OUT_DIR]
set -u
cd "$(dirname "$0")/.."
out=${1:-/tmp/fbprobe}; rm -rf "$out"; mkdir -p "$out"
.venv/bin/prl submit configs/toy.yaml run.output_dir=$out model.name=$PWD/.cache/tiny-qwen2 slurm.time=00:15:00 \
  inference.nodes=1 trainer.nodes=2 orchestrator.placement=own_node orchestrator.cpus=1 run.max_steps=6 \
  trainer.checkpoint.interval=2 > $out/submit.txt 2>&1
cat $out/submit.txt
for i in $(seq 150); do
  echo "=== $(date +%T.%N | cut -c1-12)" >> $out/top.txt
  top -b -n1 -w 200 | sed -n 7,22p >> $out/top.txt
  [ -f $out/toy/logs/attempt_0/trainer/metrics.jsonl ] && [ $(wc -l < $out/toy/logs/attempt_0/trainer/metrics.jsonl) -ge 2 ] && break
  sleep 0.5
done
echo done
a=$out/toy/logs/attempt_0
grep -m1 "Starting vLLM server" $a/inference/*.out
grep -m2 "batch [0-9]*: reward" $a/orchestrator/rank_0.log
echo "top samples with a C++ compiler running: $(grep -c cc1plus $out/top.txt)"
