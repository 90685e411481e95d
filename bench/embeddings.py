"""embeddings.py: embedding throughput (texts/s) of this engine against sentence-transformers, the same folder.

    python bench/embeddings.py [--layers 28] [--counts 1,16,256] [--tokens 100] [--rounds 3]

Writes a random Qwen3-Embedding-0.6B-shaped folder (transformers' Qwen3Model, float32: 1024 wide, 28 layers, 16
query and 8 key-value heads of 128, MLP 3072, last-token pooling, normalized; the test fixture's small tokenizer:
the texts' token counts are what costs), then times, alternating in rounds, encoding N texts of about --tokens
tokens each: sentence-transformers' encode (its default batch of 32) and this engine's Embedder (the code behind
/v1/embeddings: tokenize, batches of similar length, pool). The best of the rounds each, and the largest difference
between the two's vectors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time

import torch

from dense_engine.formats import load
from dense_engine.formats.pooling import read_pooling
from dense_engine.formats.vocab import load_vocabulary
from dense_engine.server.embeddings import Embedder

HERE = os.path.dirname(os.path.abspath(__file__))


def make_folder(folder: str, layers: int) -> None:
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                         tie_word_embeddings=True, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    Qwen3Model(config).save_pretrained(folder)
    tokenizer = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer, name), os.path.join(folder, name))
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({**config, "pad_token": config.get("eos_token")}, f)
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump([{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
                   for i, (path, kind) in enumerate(modules)], f)
    for path in ("1_Pooling", "2_Normalize"):
        os.makedirs(os.path.join(folder, path), exist_ok=True)
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 1024, "pooling_mode_lasttoken": True, "include_prompt": True}, f)
    with open(os.path.join(folder, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 8192, "do_lower_case": False}, f)


def texts(count: int, tokens: int, vocab) -> list[str]:
    """Texts of about `tokens` tokens each (words drawn from the fixture's English sample), lengths varying +-20%."""
    with open(os.path.join(HERE, "english.txt")) as f:
        words = f.read().split()
    rng, out = random.Random(0), []
    for _ in range(count):
        want, text = int(tokens * rng.uniform(0.8, 1.2)), ""
        while len(vocab.encode(text, special=True)) < want:
            text += " " + rng.choice(words)
        out.append(text.strip())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--counts", default="1,16,256")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    folder = tempfile.mkdtemp(prefix="embedding-bench-")
    try:
        make_folder(folder, args.layers)
        vocab = load_vocabulary(folder, None)
        model = load.from_pretrained(folder, dtype=torch.float32, quant="none")
        ours = Embedder(model, vocab, read_pooling(folder), None, 32768)
        theirs = SentenceTransformer(folder, device="cpu")
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; Qwen3-Embedding-0.6B shape, "
              f"{args.layers} layers, float32")
        print(f"{'texts':>6} {'tokens':>7} {'sentence-transformers':>22} {'dense-engine':>13} {'ratio':>6} "
              f"{'max |diff|':>10}")
        for count in map(int, args.counts.split(",")):
            batch = texts(count, args.tokens, vocab)
            best = {"st": float("inf"), "de": float("inf")}
            for _ in range(args.rounds):
                start = time.perf_counter()
                reference = theirs.encode(batch, convert_to_tensor=True)
                best["st"] = min(best["st"], time.perf_counter() - start)
                start = time.perf_counter()
                vectors, used = ours.vectors({"input": batch}, "input")
                best["de"] = min(best["de"], time.perf_counter() - start)
            diff = float((torch.from_numpy(vectors) - reference.float()).abs().max())
            print(f"{count:>6} {used:>7} {count / best['st']:>16.1f} t/s {count / best['de']:>7.1f} t/s "
                  f"{best['st'] / best['de']:>5.2f}x {diff:>10.2e}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
