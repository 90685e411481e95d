"""Decode speed of two trees of this engine side by side: a change's before (a git revision) and after (this tree), on
the same checkpoint folders, the same prompt, greedy, batch 1, compiled steps, each tree in its own process, the two
alternating for --rounds (which runs first alternates too). A figure is the median over a tree's processes, the ratio
the median of the rounds' ratios (the machine drifts between minutes).

    python bench/trees.py --before HEAD                      # the default model and Qwen3.5-0.8B's shape
    python bench/trees.py --before HEAD~3 --ckpt FOLDER --quant int8 --rounds 5

A worker runs with the tree's folder first on its path and reads only what both trees have (load.from_pretrained,
caches.setup_cache, generate.generate_tokens, steps.Steps). Qwen3.5-0.8B's shape (24 layers, three Gated DeltaNet in
every four, 1024 wide, its 248320-token vocabulary, tied head) is written once with random weights, by the before
tree (whose native config.json the after tree reads too), under the cache folder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dense-engine", "bench")
QWEN35 = {"vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
          "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "rotary_dim": 64,
          "max_position_embeddings": 4096, "rope_theta": 1e7, "norm_eps": 1e-6, "norm_unit_offset": True,
          "qk_norm": "shared", "attn_output_gate": True, "tie_word_embeddings": True, "rope_precision": "float32",
          "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(24)],
          "linear_heads": [16, 16], "linear_head_dims": [128, 128], "conv_kernel": 4}


def write_qwen35(folder: str) -> None:
    """Qwen3.5-0.8B's shape with random weights (N(0, 0.02), norms 1) as a native folder, by this process's tree."""
    import torch

    import dense
    from dense_engine.formats import convert, load
    from dense_engine.formats.checkpoint import make_config

    config = make_config("qwen3.5-0.8b", **QWEN35)
    if os.path.isfile(os.path.join(os.path.dirname(dense.__file__), "layer_kinds.py")):
        from layer_kinds import Decoder as build
    else:  # (a tree from before issue 98, where dense.py built every kind; an installed layer_kinds is not its own)
        build = dense.DenseDecoder
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(0.0) if "norm" in name or name.endswith(("A_log", "dt_bias")) else p.normal_(0, 0.02)
    tmp = tempfile.mkdtemp(prefix="qwen35-", dir=os.path.dirname(folder))
    tensors = getattr(load, "checkpoint_tensors", None) or load.checkpoint_state_dict  # (the name before 98)
    convert.write_native(tmp, config, {k: v.contiguous() for k, v in tensors(model).items()})
    os.replace(tmp, folder)


def worker(args) -> dict:
    import torch

    import dense
    from dense_engine.formats.load import from_pretrained
    from dense_engine.runtime import caches, generate
    from dense_engine.runtime.steps import Steps

    assert os.path.dirname(os.path.abspath(dense.__file__)) == os.path.abspath(args.tree), dense.__file__
    model = from_pretrained(args.ckpt[0], quant=args.quant)
    caches.setup_cache(model, 1, 1024)
    ids = torch.arange(3, 3 + args.prompt).reshape(1, -1) % model.config.vocab_size
    steps = Steps(model)
    rates, tokens = [], []
    for run in range(args.runs + 1):  # (the first compiles or opens the steps: not counted)
        out = generate.generate_tokens(model, ids, args.gen, steps=steps)
        first = int(next(out))
        start = time.perf_counter()
        tokens = [first, *(int(t) for t in out)]
        if run:
            rates.append((len(tokens) - 1) / (time.perf_counter() - start))
    return {"decode_tok_s": statistics.median(rates), "tokens": tokens}


def run_worker(tree: str, args, ckpt: str, quant: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--tree", tree, "--ckpt", ckpt, "--quant", quant,
           "--gen", str(args.gen), "--runs", str(args.runs), "--prompt", str(args.prompt)]
    env = {**os.environ, "PYTHONPATH": tree, "DENSE_BACKGROUND_COMPILE": "0"}
    done = subprocess.run(cmd, check=False, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{tree}: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="HEAD", help="the git revision to compare this tree with")
    p.add_argument("--ckpt", action="append", help="a checkpoint folder (repeatable; default: the default model's "
                   "folder and Qwen3.5-0.8B's shape)")
    p.add_argument("--quant", default="auto", help="as --quant (Qwen3.5-0.8B's shape: int8)")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    p.add_argument("--write-qwen35", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.write_qwen35:
        return write_qwen35(args.write_qwen35) or 0
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    before = tempfile.mkdtemp(prefix="dense-before-")
    subprocess.run(["git", "-C", HERE, "worktree", "add", "--detach", before, args.before], check=True,
                   capture_output=True)
    try:
        rows = [(c, args.quant) for c in args.ckpt or []]
        if not rows:
            default = os.path.join(WORK, "..", "smollm2-135m-instruct")
            qwen = os.path.join(WORK, "qwen3.5-0.8b-native")
            if not os.path.isdir(qwen):
                os.makedirs(WORK, exist_ok=True)
                env = {**os.environ, "PYTHONPATH": before}
                subprocess.run([sys.executable, os.path.abspath(__file__), "--write-qwen35", qwen], cwd=before,
                               env=env, check=True)
            rows = [(os.path.normpath(default), "auto"), (qwen, "int8")]
        for ckpt, quant in rows:
            rates, tokens = {"before": [], "after": []}, {}
            for r in range(args.rounds):
                order = [("before", before), ("after", HERE)][:: 1 if r % 2 == 0 else -1]
                for name, tree in order:
                    result = run_worker(tree, args, ckpt, quant)
                    rates[name].append(result["decode_tok_s"])
                    tokens[name] = result["tokens"]
                    print(f"{os.path.basename(ckpt)} round {r + 1} {name}: {result['decode_tok_s']:.2f} tok/s",
                          flush=True)
            ratio = statistics.median(a / b for a, b in zip(rates["after"], rates["before"]))
            print(json.dumps({"ckpt": os.path.basename(ckpt), "quant": quant, "before": args.before,
                              "before_tok_s": statistics.median(rates["before"]),
                              "after_tok_s": statistics.median(rates["after"]), "after_over_before": ratio,
                              "same_greedy_tokens": tokens["before"] == tokens["after"]}))
    finally:
        subprocess.run(["git", "-C", HERE, "worktree", "remove", "--force", before], check=False,
                       capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
