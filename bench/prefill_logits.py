"""How far a long prefill's logits are from the float path, this engine's and llama.cpp's, on the same K-quant files.

Past 12 tokens this engine multiplies K-quant weights by x rounded to 8 bits a value (a scale per 256: llama.cpp's
Q8_K), as llama.cpp does for every quantized matmul. Issue 36's bar: such logits no farther from the float path
(the file's weights dequantized by gguf, float32 products) than llama.cpp's own. For each file: a 128-token prompt
(bench/llamacpp.py's text, repeated), logits at every position from the float path (`--quant none`), this engine's
default (`--quant auto`, eager) and llama.cpp (float32 KV cache, one batch of 128); the largest difference relative
to the float path's largest logit, the root mean square difference relative to the float path's, and the share of
positions whose argmax is the float path's.

    python bench/prefill_logits.py --llama-python VENV/bin/python [--model llama-3.2-1b,qwen2.5-0.5b] [--tokens 128]

The files are bench/llamacpp.py's (made there once, under the cache folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import llamacpp  # (the bench files and prompt)

WORKER = r"""
import json, sys
import numpy as np
import llama_cpp
path, ids, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = llama_cpp.Llama(model_path=path, n_ctx=2 * len(ids), n_batch=len(ids), n_ubatch=len(ids), logits_all=True,
                      type_k=0, type_v=0, flash_attn=False, verbose=False, n_threads=2)
llm.eval(ids)
np.save(out, np.asarray(llm.scores[: len(ids)], dtype=np.float32))
"""


def llama_cpp_logits(python: str, path: str, ids: list[int]):
    import numpy as np
    import torch

    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "logits.npy")
        result = subprocess.run([python, "-c", WORKER, path, json.dumps(ids), out], capture_output=True, text=True,
                                check=False)
        if result.returncode:
            sys.exit(f"llama.cpp failed on {path}:\n{result.stderr[-3000:]}")
        return torch.from_numpy(np.load(out))


def main() -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from dense_engine.formats import load

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-python", required=True, help="python of a virtualenv with llama-cpp-python")
    p.add_argument("--model", default="llama-3.2-1b,qwen2.5-0.5b")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    console, rows = Console(), []
    table = Table(title=f"{args.tokens}-token prefill: logits against the float path (gguf's dequantized weights)")
    for col in ("model", "file", "this engine: max / rms diff", "same argmax", "llama.cpp: max / rms diff",
                "same argmax", "this engine vs llama.cpp"):
        table.add_column(col)
    for name in args.model.split(","):
        files = llamacpp.model_files(name, args.llama_python, lambda s: console.print(f"[dim]{s}[/dim]"),
                                     llamacpp.KQUANT_FILES)
        text = llamacpp.prompt_ids(files[llamacpp.KQUANT_FILES[0]])
        ids = (text * (args.tokens // len(text) + 1))[:args.tokens]
        for label in llamacpp.KQUANT_FILES:
            path = files[label]
            with torch.no_grad():
                want = load.from_pretrained(path, quant="none")(torch.tensor([ids]))[0]
                ours = load.from_pretrained(path, quant="auto")(torch.tensor([ids]))[0]
            theirs = llama_cpp_logits(args.llama_python, path, ids)
            scale = float(want.abs().max())
            # (rel, rms and same read this file's want and scale, and are called for it: B023 does not apply)

            def rel(a):
                return float((a - want).abs().max()) / scale  # noqa: B023

            def rms(a):  # the typical difference, not its outlier
                return float((a - want).square().mean().sqrt() / want.square().mean().sqrt())  # noqa: B023

            def same(a):
                return float((a.argmax(-1) == want.argmax(-1)).float().mean())  # noqa: B023

            row = {"model": name, "file": label, "tokens": args.tokens, "dense_rel": rel(ours), "dense_rms": rms(ours),
                   "dense_argmax": same(ours), "llama_cpp_rms": rms(theirs),
                   "llama_cpp_rel": rel(theirs), "llama_cpp_argmax": same(theirs),
                   "dense_vs_llama_cpp": float((ours - theirs).abs().max()) / scale}
            rows.append(row)
            table.add_row(name, label, f"{row['dense_rel']:.4f} / {row['dense_rms']:.4f}", f"{row['dense_argmax']:.0%}",
                          f"{row['llama_cpp_rel']:.4f} / {row['llama_cpp_rms']:.4f}", f"{row['llama_cpp_argmax']:.0%}",
                          f"{row['dense_vs_llama_cpp']:.2e}")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
