"""What each sampler costs a reply: decode tokens/s of the default model (its default mode, compiled steps, batch 1,
as chat.py runs it) with chat.py's default sampling and with each of min-p, typical-p, the repetition penalty and DRY
on top, the same prompt and seed each time; each setting warmed up first (its step compiled or loaded), then timed.

    python bench/samplers.py [--ckpt DIR] [--tokens 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dense_engine.formats import load
from dense_engine.formats.default_model import default_checkpoint
from dense_engine.formats.vocab import load_vocabulary
from dense_engine.runtime import caches, generate
from dense_engine.runtime.sampling import SamplerSettings
from dense_engine.runtime.steps import Steps

SETTINGS = {  # name -> SamplerSettings' keywords (chat.py's default temperature 0.7 under each)
    "greedy": {"temperature": 0.0},
    "temperature 0.7 (chat.py's default)": {},
    "top-p 0.9": {"top_p": 0.9},
    "min-p 0.05": {"min_p": 0.05},
    "typical-p 0.9": {"typical_p": 0.9},
    "repetition-penalty 1.1": {"repetition_penalty": 1.1},
    "DRY 0.8": {"dry_multiplier": 0.8},
    "min-p + repetition + DRY": {"min_p": 0.05, "repetition_penalty": 1.1, "dry_multiplier": 0.8},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", default=None)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    ckpt = args.ckpt or default_checkpoint(None)
    vocab = load_vocabulary(ckpt, None)
    model = load.from_pretrained(ckpt, quant="auto")
    caches.setup_cache(model, 1, 1024)
    steps = Steps(model)
    ids = torch.tensor([vocab.encode(vocab.render([{"role": "user", "content": "Tell me about the sea."}]),
                                     special=False)])
    print(f"{ckpt}: {ids.shape[1]} prompt tokens, {args.tokens} new, best of {args.repeat}")
    base = None
    for name, settings in SETTINGS.items():
        sampler = SamplerSettings(**{"temperature": 0.7, **settings})

        def run(sampler: SamplerSettings) -> float:
            torch.manual_seed(0)
            tokens = generate.generate_tokens(model, ids, args.tokens, steps=steps, sampler=sampler,
                                              dry=sampler.dry_for(vocab))
            next(tokens)  # (the prefill's token: not decode)
            start = time.perf_counter()
            for _ in tokens:
                pass
            return (args.tokens - 1) / (time.perf_counter() - start)

        run(sampler)  # (compile or load its step)
        rate = max(run(sampler) for _ in range(args.repeat))
        base = base or rate
        print(f"{name:40s} {rate:7.1f} tok/s  {rate / base:5.2f}x greedy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
