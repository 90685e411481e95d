#!/usr/bin/env bash
# The GPU plan as ONE device call that ends within 9 minutes (540 s) on a warm machine with a cold compile cache.
# Installs nothing. Stages, each with its own time limit (a stage cut short keeps what it wrote to gpu.json):
#   1. probe (60 s)   the memory's rate: an 8 GB copy and a sum
#   2. rows  (480 s)  every row in its own process (bench/gpu.py rows): the 7B shape's decode at batch 1 in bf16,
#                     int8, int4-g32, int4-g128, nf4, fp8 and at batch 8 in bf16 and int8 (prefill 128 and 2,048,
#                     bytes, MBU, CUDA-graph skips, a profile each), one-row linears in a CUDA graph for every mode,
#                     the server at 1 and 8 clients, the correctness checks (gpu.py check), the CUDA tests. They
#                     compile side by side (one Inductor cache, 2 compile threads each) and measure one at a time.
# Results: $OUT/gpu.json (one JSON line each, written as they come), $OUT/gpu.txt (BENCHMARKS.md rows),
# $OUT/gpu-results.json (bench/results/gpu-<card>.json's content), $OUT/cuda-tests.txt, $OUT/row-*.log.
#   bash bench/gpu.sh              on the GPU machine (device tool: command "bash bench/gpu.sh", timeout_s 590)
#   bash bench/gpu.sh --dry-run    the same single call on the CPU with a tiny shape, every stage's time printed
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/gpu-bench}" PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the GPU machine runs the checkout as it is: nothing installed
export DENSE_KERNELS=0  # the CPU references run on plain torch: no kernels.cpp build on the GPU's time
mkdir -p "$OUT"
dry=()
workers=5
if [ "${1:-}" = "--dry-run" ]; then
  dry=(--dry-run)
  workers=2
fi
if [ ${#dry[@]} -eq 0 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/gpu.txt"
fi
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
status=0
times=()

stage() {  # stage NAME LIMIT COMMAND...: run it under its limit, note its time and status
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  [ $rc -eq 0 ] || status=1
  times+=("$name $((SECONDS - start)) s (limit $limit s, exit $rc)")
  echo "## stage $name: $((SECONDS - start)) s, exit $rc" >&2
}

stage probe 60 python3 bench/gpu.py probe "${dry[@]}"
stage rows 480 python3 bench/gpu.py rows --budget 460 --workers "$workers" "${dry[@]}"
python3 bench/gpu.py table "$OUT/gpu.json" | tee -a "$OUT/gpu.txt"
python3 bench/gpu.py results "$OUT/gpu.json" > "$OUT/gpu-results.json"
printf 'stage %s\n' "${times[@]}" | tee -a "$OUT/gpu.txt"
exit $status
