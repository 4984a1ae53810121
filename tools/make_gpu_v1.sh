#!/usr/bin/env bash
# Builds .gpu-v1/: verifiers 0.4 and the project's v1 environment packages for the offline GPU machines
# (Python 3.12 there), the GPU side of .venv-v1 (docs/environments.md), and .gpu-v1/python, the
# environment worker's Python there (orchestrator.environment.python).
#
#   bash tools/make_gpu_v1.sh        # .gpu-v1/site (about 60 MB) and its .gpu-v1/site.tar.xz (about 15 MB)
#   # carry .gpu-v1/site.tar.xz and .gpu-v1/python; on the GPU machine:
#   tar -xJf .gpu-v1/site.tar.xz -C .gpu-v1 && ... orchestrator.environment.python=$PWD/.gpu-v1/python
#
# Versions are .venv-v1's, so both sides run the same code, less what the GPU machine already holds:
# the image's torch stack (transformers, tokenizers, huggingface_hub, numpy, ...) and the gpu-vllm
# bundle's wheels (../shared/tools/gpu-vllm/wheels.lock) of the same version, or of one verifiers 0.4
# accepts (anthropic>=1, pydantic>=2.12.3, uvicorn>=0.52). Not the bundle's openai 3 (verifiers 0.4:
# openai<3) nor its verifiers (the run's 0.3.1). .gpu-v1/python puts the site first on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu-v1
image=" numpy transformers tokenizers huggingface-hub hf-xet safetensors sympy mpmath pillow jinja2 markupsafe filelock "
image+="fsspec regex requests urllib3 certifi charset-normalizer idna packaging pyyaml tqdm typing-extensions "
[ -x .venv-v1/bin/python ] || { echo "make_gpu_v1: no .venv-v1 (run tools/setup.sh first)" >&2; exit 1; }
accepted=" anthropic pydantic pydantic-core uvicorn "
lock=${PRL_GPU_BUNDLE_LOCK:-../shared/tools/gpu-vllm/wheels.lock}
[ -f "$lock" ] || { echo "make_gpu_v1: no $lock (the gpu-vllm bundle's; PRL_GPU_BUNDLE_LOCK names another)" >&2; exit 1; }
norm() { local s=${1,,}; echo "${s//[-.]/_}"; }  # a distribution's name as wheels spell it
bundled=" $(sed -n 's/^\([A-Za-z0-9_.-]*\)==\([^ ]*\).*/\1==\2/p' "$lock" | while read -r p; do
    echo -n "$(norm "${p%%==*}")==${p#*==} "; done)"
pins=()
while read -r line; do
    case $line in -e*|"") continue ;; esac
    name=${line%%==*} key=$(norm "${line%%==*}")==${line#*==}
    [[ $image == *" $name "* || $bundled == *" $key "* || ( $bundled == *" $(norm "$name")=="* && $accepted == *" $name "* ) ]] \
        || pins+=("$line")
done < <(.venv/bin/uv pip freeze -q --python .venv-v1/bin/python)
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 -d "$wheels" "${pins[@]}"
.venv/bin/pip wheel -q --no-deps -w "$wheels" environments/prl_toy_v1 environments/prl_chat environments/prl_calc_v1
rm -rf environments/*/build  # setuptools' leftovers
rm -rf "$out" && mkdir -p "$out/site"
for w in "$wheels"/*.whl; do .venv/bin/python -m zipfile -e "$w" "$out/site/"; done
find "$out/site" -path "*dist-info/RECORD" -delete  # paths of an install that never happened
cat > "$out/python" <<'SH'
#!/bin/sh
# The v1 environment worker's Python on a GPU machine: the image's python3, verifiers 0.4 first.
exec env PYTHONPATH="$(cd "$(dirname "$0")" && pwd)/site${PYTHONPATH:+:$PYTHONPATH}" python3 "$@"
SH
chmod +x "$out/python"
tar -cf - -C "$out" site | xz -T0 -6 > "$out/site.tar.xz"  # what travels: a call carries at most 64 MiB
echo "make_gpu_v1: $(ls "$wheels"/*.whl | wc -l) wheels unpacked into $out/site ($(du -sh "$out/site" | cut -f1); $(du -h "$out/site.tar.xz" | cut -f1) packed)"
