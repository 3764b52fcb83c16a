#!/usr/bin/env bash
# Every GPU check of kvtier in one run, for a machine with a CUDA GPU and PyTorch but no
# network (wheels of what its image lacks carried in .whl/):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_17_x86_64 -d .whl zstandard==0.25.0
#   scripts/gpu_run.sh [OUT_DIR]          # default: out/
#
# 1. scripts/gpu_check.py: the store's device pool, the page copy path, every KV layout;
# 2. scripts/gpu_worker_check.py: the connector's worker, driven as vLLM's GPU runner drives
#    it, in every layout, at chunks of 256 tokens, then 64 and 1024 for FlashAttention's
#    (LBNHC) and MLA's. Each writes its JSON to OUT_DIR; the first failure stops the run.
#
# DRY_RUN=1 runs the same on the CPU at small sizes, the disk's ceiling left out
# (tests/test_gpu_worker_check.py does).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out}
mkdir -p "$out"
if [ "${DRY_RUN:-0}" != 1 ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kvtier-site .whl/*.whl
  export PYTHONPATH=/tmp/kvtier-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
dry=() worker=()
if [ "${DRY_RUN:-0}" = 1 ]; then
  dry=(--device cpu --small) worker=(--no-fio)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$python" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
fi
"$python" scripts/gpu_check.py "${dry[@]}" --json "$out/gpu_check.json" >"$out/gpu_check.log" 2>&1 \
  || { tail -40 "$out/gpu_check.log"; exit 1; }
echo "gpu_check: passed"
"$python" scripts/gpu_worker_check.py "${dry[@]}" "${worker[@]}" --json "$out/gpu_worker_check.json"
"$python" scripts/gpu_worker_check.py "${dry[@]}" "${worker[@]}" --chunk-tokens 64,1024 --cases LBNHC,MLA \
  --json "$out/gpu_worker_check_chunks.json"
echo "gpu_worker_check: passed"
