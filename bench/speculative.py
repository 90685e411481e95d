"""Speculative decoding against plain decoding on the default model, in one process (same weights, same compiled
steps, same cache length as chat.py's default): decode tok/s, the ratio to plain, acceptance rate, tokens per
target step, and whether the greedy tokens are identical to plain decoding's.

    python bench/speculative.py [--quant none] [--draft-quant int4] [--k 2 3 4 6 8] [--runs 3] [--max-new 128]

Two prompts (chat template): a free question, and one asking to fix the typos of a paragraph (prompt lookup's case).
Rows: plain; a quantized self-draft at each k; prompt lookup at each k.
"""

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import chat
from dense_engine.cli import flags
from dense_engine.formats import default_model
from dense_engine.formats import vocab as vocab_module
from dense_engine.runtime import caches, generate, speculative
from dense_engine.runtime.steps import Steps

PARAGRAPH = ("The quick brwn fox jumpd over the lazy dog. It was a sunny day in the vilage, and the childen were "
             "playing in the park near the rivr. Their parents sat on the benchs, talking about the wether and the "
             "harvest that was coming soon.")
PROMPTS = {
    "question": "Explain in a few sentences why the sky is blue.",
    "edit": f"Fix the typos in this paragraph and write it out again:\n\n{PARAGRAPH}",
}


def run(model, ids, max_new, steps, stops, draft=None, k=4):
    stats = {}
    tokens = []
    ids = torch.tensor([ids])
    tokens_out = (generate.generate_tokens(model, ids, max_new, steps=steps) if draft is None else
                  speculative.generate_tokens(model, ids, max_new, draft, steps=steps, speculate_k=k, stats=stats))
    for i, t in enumerate(tokens_out):
        t = int(t)
        if i == 0:
            first = time.perf_counter()
        if t in stops:
            break
        tokens.append(t)
    end = time.perf_counter()
    return tokens, (len(tokens) - 1) / (end - first), stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quant", default="none", help="the target's weights (chat.py --quant)")
    p.add_argument("--draft-quant", default="int4")
    p.add_argument("--k", nargs="+", type=int, default=[2, 3, 4, 6, 8])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--min-ngram", nargs="+", type=int, default=[1, 2], help="prompt lookup's shortest match")
    p.add_argument("--no-self-draft", action="store_true")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--ckpt")
    args = p.parse_args()
    from rich.console import Console

    console = Console(stderr=True)
    ckpt = args.ckpt or default_model.default_checkpoint(console)
    chat_args = chat.parse_args(["--ckpt", ckpt, "--quant", args.quant])
    model, record = flags.load_model(ckpt, chat_args, console)
    vocab = vocab_module.load_vocabulary(ckpt, None)
    caches.setup_cache(model, 1, model.config.max_position_embeddings)  # chat.py's default cache
    steps = Steps(model)
    self_draft = speculative.ModelDraft(speculative.quantized_copy(model, args.draft_quant))
    configs = [("plain", None, 1)]
    configs += [] if args.no_self_draft else [(f"{args.draft_quant} self-draft", self_draft, k) for k in args.k]
    configs += [(f"lookup (n-gram {m}..3)", speculative.LookupDraft(3, m), k) for m in args.min_ngram for k in args.k]
    print(f"# {ckpt}: target {record.weights}; cache {model.max_seq_len}; torch threads {torch.get_num_threads()}")
    print(f"{'prompt':9} {'draft':22} {'k':>2} {'tok/s':>7} {'vs plain':>8} {'accepted':>8} {'tok/step':>8} "
          f"{'tokens':>6} same")
    for name, text in PROMPTS.items():
        ids = flags.prompt_ids(vocab, text, "chat", None)
        plain = None
        for label, draft, k in configs:
            run(model, ids, args.max_new, steps, vocab.stop_ids, draft, k)  # warm-up: load or compile the steps
            rates, out, stats = [], None, {}
            for _ in range(args.runs):
                out, rate, stats = run(model, ids, args.max_new, steps, vocab.stop_ids, draft, k)
                rates.append(rate)
            rate = statistics.median(rates)
            plain = plain or (out, rate)
            accepted = f"{stats['accepted'] / max(1, stats['proposed']):.0%}" if draft else "-"
            per_step = f"{(len(out) - 1) / max(1, stats['target_steps']):.2f}" if draft else "1.00"
            print(f"{name:9} {label:22} {k:2d} {rate:7.1f} {rate / plain[1]:7.2f}x {accepted:>8} {per_step:>8} "
                  f"{len(out):6d} {'yes' if out == plain[0] else 'NO'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
