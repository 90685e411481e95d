"""Aggregate decode tokens/s against batch size: `chat.py --bench --batch-size B` for each B and each --quant, every
point in its own process (so peak memory is that point's own), ragged prompts. Prints one table with the ratio
to batch 1 of the same mode.

    python bench/batch_curve.py [--quant none int4] [--batch 1 2 4 8 16 32] [--json FILE] [-- other chat.py flags]
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(quant: str, batch: int, extra: list[str]) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "chat.py"), "--bench", "--json", "--quant", quant, "--batch-size",
           str(batch), "--prompt-len", "32:128", "--gen-len", "64", "--runs", "3", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode:
        sys.exit(f"{' '.join(cmd)}: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quant", nargs="+", default=["none", "int4"])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--json", help="also write every result to this file")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the curve as a bar chart (needs matplotlib)")
    p.add_argument("chat_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    extra = [a for a in args.chat_args if a != "--"]
    results = []
    print(f"{'quant':6} {'batch':>5} {'decode tok/s':>12} {'per row':>8} {'vs batch 1':>10} {'ms/step':>8} "
          f"{'peak MiB':>9}")
    for quant in args.quant:
        base = None
        for batch in args.batch:
            r = measure(quant, batch, extra)
            results.append(r)
            base = base or r["decode_tok_s"]
            print(f"{quant:6} {batch:5d} {r['decode_tok_s']:12.1f} {r['decode_tok_s_per_row']:8.1f} "
                  f"{r['decode_tok_s'] / base:9.2f}x {r['ms_per_step']:8.2f} {r['peak_mem_bytes'] / 2**20:9.0f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        from dense_engine.cli import benchmark

        rate = {(r["quant"], r["batch_size"]): r["decode_tok_s"] for r in results}
        benchmark.bar_chart(args.plot, [str(b) for b in args.batch],
                            {q: [rate.get((q, b)) for b in args.batch] for q in {r["quant"]: 0 for r in results}},
                            f"{results[0]['model']}: aggregate decode tok/s by batch size", "tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
