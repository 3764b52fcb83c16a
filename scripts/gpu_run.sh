#!/usr/bin/env bash
# Every GPU check of kvtier in one run, for a machine with a CUDA GPU and PyTorch but no
# network (wheels of what its image lacks carried in .whl/, which git ignores):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_17_x86_64 -d .whl zstandard==0.25.0
#   scripts/gpu_run.sh OUT_DIR 2>&1 | tee OUT_DIR/run.log
#
# (through the device tool: carry [".whl"], and OUT_DIR "$OUT", so that its files come back)
#
# 1. scripts/gpu_check.py: the store's device pool, the page copy path, every KV layout;
# 2. scripts/gpu_worker_check.py: the connector's worker, driven as vLLM's GPU runner drives
#    it, in every layout, at chunks of 256 tokens;
# 3. the same at 64 and 1024 tokens for FlashAttention's layout (LBNHC) and MLA's;
# 4. a control: kvtier's copies made not to wait for the compute stream, which the checks
#    of step 2 must catch (exit 0 only then).
# Each writes its JSON (and log) to OUT_DIR; every step runs, and the run fails if any did.
#
# DRY_RUN=1 runs steps 1-3 on the CPU at small sizes, the disk's ceiling left out
# (tests/test_gpu_worker_check.py does); the control needs CUDA streams.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-out}
mkdir -p "$out"
if [ "${DRY_RUN:-0}" != 1 ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kvtier-site .whl/*.whl || exit 1
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
failed=()
step() {  # name, then the command; its output to OUT_DIR/name.log and its tail on failure
  local name=$1
  shift
  if "$@" >"$out/$name.log" 2>&1; then
    echo "$name: passed"
  else
    echo "$name: FAILED (exit $?)"
    tail -30 "$out/$name.log"
    failed+=("$name")
  fi
}
step gpu_check "$python" scripts/gpu_check.py "${dry[@]}" --json "$out/gpu_check.json"
step gpu_worker_check "$python" scripts/gpu_worker_check.py "${dry[@]}" "${worker[@]}" \
  --json "$out/gpu_worker_check.json"
step gpu_worker_check_chunks "$python" scripts/gpu_worker_check.py "${dry[@]}" "${worker[@]}" \
  --chunk-tokens 64,1024 --cases LBNHC,MLA --json "$out/gpu_worker_check_chunks.json"
if [ "${DRY_RUN:-0}" != 1 ]; then
  step gpu_worker_check_control "$python" scripts/gpu_worker_check.py --no-wait --no-fio \
    --cases LBNHC,LBNHC-apart --json "$out/gpu_worker_check_control.json"
fi
[ ${#failed[@]} = 0 ] || { echo "failed: ${failed[*]}"; exit 1; }
echo "every GPU check passed"
