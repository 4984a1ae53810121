#!/usr/bin/env bash
# One poll of a GPU session script started in the background (setsid bash benchmarks/loop_session.sh
# DIR ...): wait up to SECONDS for DIR/ALL_DONE, print DIR/steps.log, pack DIR into $OUT/NAME.tgz.
#
#   bash benchmarks/poll_session.sh /tmp/gpu-out 540 out2
#
# Exits 3 at once when DIR is missing: the machine was given back since the session started there,
# and the fresh one this call got holds nothing (h100x4-2026-11-28 slept 560 s of device time on one).
# Returns as soon as the session ends, so no poll sleeps past it.
set -u
dir=${1:?usage: poll_session.sh DIR SECONDS NAME}
seconds=${2:?usage: poll_session.sh DIR SECONDS NAME}
name=${3:?usage: poll_session.sh DIR SECONDS NAME}
[ -d "$dir" ] || { echo "poll_session: no $dir: not the machine the session started on"; exit 3; }
end=$(( SECONDS + seconds ))
while [ ! -e "$dir/ALL_DONE" ] && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
cat "$dir/steps.log" 2>/dev/null
if [ -e "$dir/ALL_DONE" ]; then echo "poll_session: ALL_DONE"; fi
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader 2>/dev/null
tar czf "${OUT:-/tmp}/$name.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
