#!/usr/bin/env bash
# What the machine does, second by second, while a benchmark runs beside it: started in the background,
# ended by PID (its process group) when the benchmark is done.
#
#   setsid bash benchmarks/machine_sampler.sh /tmp/gpu-out/probe & sampler=$!
#   ... the benchmark ...
#   kill -- -$sampler
#
# Writes PREFIX.vmstat (CPU user/system/idle/iowait/steal, blocks written: `vmstat -t 1`),
# PREFIX.gpus (each GPU's SM and memory use, power and clocks: `nvidia-smi dmon -s pucm -d 1`, with
# the time), PREFIX.top (the 12 busiest processes every 2 s, their command lines cut at 200
# characters) and PREFIX.threads (the 12 busiest threads, by name: one at 100 % is a process bound by
# its CPU). A tool the machine lacks writes its own line saying so and the rest go on.
set -u
prefix=${1:?usage: machine_sampler.sh OUT_PREFIX}
mkdir -p "$(dirname "$prefix")"
if command -v vmstat > /dev/null; then vmstat -t -w 1 > "$prefix.vmstat" 2>&1 &
else echo "no vmstat on this machine" > "$prefix.vmstat"; fi
if command -v nvidia-smi > /dev/null; then nvidia-smi dmon -s pucm -d 1 -o T > "$prefix.gpus" 2>&1 &
else echo "no nvidia-smi on this machine" > "$prefix.gpus"; fi
if command -v top > /dev/null; then
    # -w: top cuts its lines to the terminal's width, which a background job has none of.
    top -b -d 2 -c -w 200 -o %CPU | grep --line-buffered -A 19 '^top -' > "$prefix.top" 2>&1 &
    top -b -d 2 -H -w 200 -o %CPU | grep --line-buffered -A 19 '^top -' > "$prefix.threads" 2>&1 &
else echo "no top on this machine" | tee "$prefix.threads" > "$prefix.top"; fi
wait
