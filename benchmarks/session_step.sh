# Sourced by the GPU session scripts (benchmarks/*_session.sh), after they set $out:
#   step NAME LIMIT_S COMMAND...   run COMMAND into $out/NAME.log, cut at LIMIT_S, its start, end and
#                                  exit status in $out/steps.log; later steps run either way.
step() {
    local name=$1 limit=$2; shift 2
    echo "== $(date -u +%T) $name: $*" | tee -a "$out/steps.log"
    timeout --kill-after=20 "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $(date -u +%T) $name exit $?" | tee -a "$out/steps.log"
}
