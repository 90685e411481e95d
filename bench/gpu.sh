#!/usr/bin/env bash
# The GPU plan as ONE device call that ends within 9.5 minutes on a warm machine with a cold compile cache. Installs
# nothing. Stages, each with its own time limit (a stage cut short keeps what it wrote to gpu.json); the limits are
# sized by the first H200 run (BENCHMARKS.md, "The first GPU rows"): a 7B row takes 65-100 s, most of it compiling.
#   1. time  (230 s)  batch-1 decode and 128-token prefill, compiled: Llama-2-7B's shape in bf16, int8, nf4, int4
#                     (gpt-fast's published rows), one-row linears, then Llama-3.2-1B's shape while time is left
#   2. check (210 s)  correctness on CUDA against CPU float32 (bench/gpu.py check)
#   3. tests (120 s)  the tests that need a GPU, by name, each line written as it comes
# Results: $OUT/gpu.json (one JSON line each, written as they come) and $OUT/gpu.txt (BENCHMARKS.md rows).
#   bash bench/gpu.sh              on the GPU machine (device tool: command "bash bench/gpu.sh", timeout_s 590)
#   bash bench/gpu.sh --dry-run    the same single call on the CPU with a tiny shape, every stage's time printed
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/gpu-bench}" PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the GPU machine runs the checkout as it is: nothing installed
export DENSE_KERNELS=0  # the CPU references run on plain torch: no kernels.cpp build on the GPU's time
mkdir -p "$OUT"
dry=()
[ "${1:-}" = "--dry-run" ] && dry=(--dry-run)
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

stage time 230 python3 bench/gpu.py time --budget 215 "${dry[@]}"
stage check 210 python3 bench/gpu.py check "${dry[@]}"
tests=(tests/test_cuda.py::test_cuda_logits_match_the_cpu_in_every_mode
       tests/test_cuda.py::test_cuda_compiled_generation_matches_eager
       tests/test_cuda.py::test_cuda_int8_layer_is_the_float_product)
if [ ${#dry[@]} -eq 0 ]; then
  stage tests 120 bash -c "python3 -m pytest -v -p no:cacheprovider ${tests[*]} 2>&1 | tee -a $OUT/gpu.txt; exit \${PIPESTATUS[0]}"
else
  stage tests 120 python3 -m pytest -q -p no:cacheprovider --collect-only "${tests[@]}"  # (the names exist)
fi
python3 bench/gpu.py table "$OUT/gpu.json" | tee -a "$OUT/gpu.txt"
printf 'stage %s\n' "${times[@]}" | tee -a "$OUT/gpu.txt"
exit $status
