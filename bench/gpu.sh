#!/usr/bin/env bash
# One GPU check, sized for the 15-minute device budget (aim: under 8 minutes). Installs nothing.
#   bash bench/gpu.sh [OUT_DIR]      -> OUT_DIR/gpu.json (one JSON object per line) and OUT_DIR/gpu.txt (a table)
# 1. correctness on CUDA: cached vs no-cache logits, compiled vs eager greedy tokens (bf16, each quant mode);
# 2. decode speed with compile: bf16, int8, nf4 (and int4) for SmolLM2-135M, OpenELM-1.1B and Llama-2-7B shapes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-/tmp/gpu-bench}}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

timeout 150 python3 - <<'EOF' 2>&1 | tee -a "$OUT/gpu.txt"
import torch, dense, quantize, benchmark
dev = torch.device("cuda")
for shape in ("smollm2-135m",):
    model = benchmark.random_model(shape, dev, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), device=dev, generator=torch.Generator(dev).manual_seed(0))
    full = model(ids)
    model.setup_cache(2, 64)
    parts = [model(ids[:, :30], input_pos=torch.arange(30, device=dev))]
    parts += [model(ids[:, p:p + 1], input_pos=torch.tensor([p], device=dev)) for p in range(30, 40)]
    err = ((torch.cat(parts, 1) - full).abs().max() / full.abs().max()).item()
    print(f"correctness {shape} bf16 cached vs no-cache rel err {err:.2e} {'OK' if err < 2e-2 else 'FAIL'}")
    for mode in ("none", "int8", "int4", "nf4"):
        m = model if mode == "none" else quantize.quantize_model(benchmark.random_model(shape, dev, torch.bfloat16), mode)
        eager = dense.generate(m, ids[:, :16], 24)
        compiled = dense.generate(m, ids[:, :16], 24, compile=True)
        same = int((eager == compiled).all(0).long().cumprod(0).sum()) - 16
        print(f"correctness {shape} {mode} compiled vs eager greedy: {same}/24 tokens equal")
EOF

for shape in smollm2-135m openelm-1.1b llama-2-7b; do
  for quant in none int8 nf4 int4; do
    timeout 120 python3 chat.py --bench --shape "$shape" --device cuda --dtype bfloat16 --compile --quant "$quant" \
      --prompt-len 128 --gen-len 128 --runs 3 --json >> "$OUT/gpu.json" 2>> "$OUT/gpu.err" \
      || echo "{\"model\": \"$shape\", \"quant\": \"$quant\", \"error\": \"failed or timed out\"}" >> "$OUT/gpu.json"
  done
done

python3 - "$OUT/gpu.json" <<'EOF' | tee -a "$OUT/gpu.txt"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
base = {r["model"]: r["decode_tok_s"] for r in rows if r.get("quant") == "none" and "decode_tok_s" in r}
print(f"{'model':34s} {'quant':6s} {'decode tok/s':>12s} {'x bf16':>7s} {'MBU':>6s} {'GB/s':>7s} {'compile s':>9s}")
for r in rows:
    if "error" in r:
        print(f"{r['model']:34s} {r['quant']:6s} {r['error']}")
        continue
    mbu = f"{r['mbu'] * 100:.0f}%" if r.get("mbu") else "-"
    ratio = r["decode_tok_s"] / base[r["model"]] if r["model"] in base else float("nan")
    print(f"{r['model']:34s} {r['quant']:6s} {r['decode_tok_s']:12.1f} {ratio:7.2f} {mbu:>6s} "
          f"{r['bandwidth_gbs']:7.0f} {r['compile_s']:9.1f}")
EOF
