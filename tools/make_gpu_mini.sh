#!/usr/bin/env bash
# Builds .gpu-mini/: what prl needs on the offline GPU machines beyond the gpu-vllm bundle
# (../shared/tools/gpu-vllm/), as unpacked wheels for Python 3.12 to put on PYTHONPATH there.
#
#   bash tools/make_gpu_mini.sh            # about 30 MB; carried beside the bundle's last piece
#   # on the GPU machine: export PYTHONPATH=$PYTHONPATH:$PWD/.gpu-mini:$PWD
#
# - omegaconf (+ antlr4), loguru, pyyaml, psutil: prl's config and logs, for trainer-only runs
#   without the bundle;
# - peft, accelerate: LoRA (trainer.lora);
# - openai-agents and what it imports (mcp, griffelib, jsonschema, ...): verifiers 0.3.1 imports it for
#   every tool environment (ToolEnv, StatefulToolEnv) and the bundle leaves it out (docs/inference.md);
# - py-spy (PY_SPY, a static binary, in .gpu-mini/bin): where a GPU run's processes spend their time
#   (the profiles of benchmarks/reports/vllm-logprob-messages_cpu2_2026-11-28.md).
# Versions are this machine's .venv's, so both sides run the same code.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu-mini
PY_SPY=0.4.3
packages=(omegaconf antlr4-python3-runtime loguru pyyaml psutil peft accelerate
          openai-agents griffelib mcp httpx-sse jsonschema jsonschema-specifications referencing rpds-py
          sse-starlette pygments rich click markdown-it-py mdurl)
pins=()
for p in "${packages[@]}"; do
    v=$(.venv/bin/pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
    [ -n "$v" ] || { echo "make_gpu_mini: $p is not in .venv (run tools/setup.sh first)" >&2; exit 1; }
    pins+=("$p==$v")
done
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$wheels" "${pins[@]}"
rm -rf "$out" && mkdir -p "$out"
for w in "$wheels"/*.whl; do .venv/bin/python -m zipfile -e "$w" "$out/"; done
find "$out" -path "*dist-info/RECORD" -delete  # paths of an install that never happened
.venv/bin/pip download -q --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
    -d "$wheels/spy" "py-spy==$PY_SPY"
mkdir -p "$out/bin" && .venv/bin/python -m zipfile -e "$wheels"/spy/*.whl "$wheels/spy/x"
install -m 755 "$wheels"/spy/x/*.data/scripts/py-spy "$out/bin/py-spy"
echo "make_gpu_mini: $(ls "$wheels"/*.whl | wc -l) wheels and py-spy unpacked into $out ($(du -sh "$out" | cut -f1))"
