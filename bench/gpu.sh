#!/usr/bin/env bash
# The GPU plan, two staged calls that each end within 8 minutes on a warm machine. Installs nothing.
#   bash bench/gpu.sh check [--dry-run]   (a) correctness on CUDA of every quant mode and path (plain, compiled,
#                                             speculative, ragged batch, llm.int8) against CPU float32, then the
#                                             tests marked for CUDA (tests/test_cuda.py)
#   bash bench/gpu.sh time [--dry-run]    (b) batch-1 decode and prefill of a 1B- and a 7B-class shape (random
#                                             weights) in bf16, int8, int4 and nf4, compiled, with MBU
# Results: $OUT/gpu.json (a JSON line each, written as they come: a stage cut short keeps what it measured) and
# $OUT/gpu.txt (BENCHMARKS.md rows, from `python bench/gpu.py table`). --dry-run: the same plan on the CPU, tiny shape.
set -uo pipefail
cd "$(dirname "$0")/.."
stage="${1:?usage: bash bench/gpu.sh check|time [--dry-run]}"
shift
export OUT="${OUT:-/tmp/gpu-bench}" PYTHONUNBUFFERED=1
export DENSE_KERNELS=0  # the CPU references run on plain torch: no kernels.cpp build on the GPU's time
mkdir -p "$OUT"
dry=""
[ "${1:-}" = "--dry-run" ] && dry=1
[ -z "$dry" ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"

case "$stage" in
  check)
    timeout 360 python3 bench/gpu.py check --out "$OUT" "$@"
    status=$?
    if [ -z "$dry" ]; then
      timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -15 | tee -a "$OUT/gpu.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    fi
    ;;
  time)
    timeout 420 python3 bench/gpu.py time --out "$OUT" "$@"
    status=$?
    ;;
  *)
    echo "unknown stage $stage (check or time)" >&2
    exit 2
    ;;
esac
python3 bench/gpu.py table "$OUT/gpu.json" | tee -a "$OUT/gpu.txt"
exit $status
