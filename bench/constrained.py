"""Constrained against free decoding on serve.py (the default model unless --ckpt): generated tokens/s of one client
sending requests one after another, and of 8 clients at once, free and with `response_format` json_object; and the
grammar's own cost per token (llguidance's mask and its bias row, in this process).

    python bench/constrained.py [--ckpt DIR] [--requests 8] [--tokens 96]

Greedy, the same prompts for both kinds (they ask for JSON, so a free reply is about as long as a constrained one).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from serve_load import free_port

PROMPTS = ["List five countries and their capitals as JSON.", "Describe a cat as a JSON object.",
           "Give three colors and their hex codes in JSON.", "A JSON object for a book: title, author, year.",
           "Three fruits and their prices, as JSON.", "A JSON object describing the weather today.",
           "Four planets and their sizes, as JSON.", "A JSON object with a recipe for pancakes."]


def post(port: int, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    answer = json.loads(conn.getresponse().read())
    conn.close()
    return answer


def body(prompt: str, constrained: bool, tokens: int) -> dict:
    out = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": tokens}
    return {**out, "response_format": {"type": "json_object"}} if constrained else out


def one_after_another(port: int, constrained: bool, n: int, tokens: int) -> float:
    start, generated = time.perf_counter(), 0
    for i in range(n):
        generated += post(port, body(PROMPTS[i % len(PROMPTS)], constrained, tokens))["usage"]["completion_tokens"]
    LENGTHS.append(generated / n)
    return generated / (time.perf_counter() - start)


LENGTHS: list[float] = []


def together(port: int, constrained: bool, n: int, tokens: int) -> float:
    counts = [0] * n

    def one(i):
        counts[i] = post(port, body(PROMPTS[i % len(PROMPTS)], constrained, tokens))["usage"]["completion_tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def mask_cost(ckpt: str | None) -> float:
    """Microseconds per token of Constraint.bias + consume, walking a JSON reply token by token."""
    from rich.console import Console

    from dense_engine.formats import default_model
    from dense_engine.formats import vocab as vocab_module
    from dense_engine.runtime import grammar

    path = ckpt or default_model.default_checkpoint(Console(stderr=True))
    vocab = vocab_module.load_vocabulary(path, None)
    text = json.dumps({"countries": [{"name": n, "capital": c} for n, c in (
        ("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"), ("Peru", "Lima"))]},
        separators=(",", ":"))
    ids = vocab.encode(text, special=False)
    V = vocab.size
    tokenizer = grammar.tokenizer_for(vocab, V)
    rule = grammar.json_grammar(None)
    constraint = grammar.Constraint(rule, tokenizer, V)
    start = time.perf_counter()
    for token in ids:
        constraint.bias("cpu")
        constraint.consume(token)
    return (time.perf_counter() - start) / len(ids) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=96)
    args = p.parse_args()
    port = free_port()
    cmd = [sys.executable, os.path.join(ROOT, "serve.py"), "--port", str(port), "--max-batch", "8"]
    server = subprocess.Popen(cmd + (["--ckpt", args.ckpt] if args.ckpt else []), stderr=subprocess.DEVNULL,
                              env={**os.environ, "DENSE_BACKGROUND_COMPILE": "0"})
    try:
        for _ in range(600):
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        together(port, True, 8, 8)  # warm-up: the biased steps (batch 1 and 8) compiled
        one_after_another(port, True, 1, 8)
        rows = {}
        for constrained in (False, True):
            kind = "json_object" if constrained else "free"
            rows[kind] = {"one client": one_after_another(port, constrained, args.requests, args.tokens),
                          "8 clients": together(port, constrained, 8, args.tokens), "tokens": LENGTHS[-1]}
        print(json.dumps(rows))
        print("| | one client, tok/s | 8 clients, tok/s | tokens a reply |\n|---|---|---|---|")
        for kind, row in rows.items():
            print(f"| {kind} | {row['one client']:.1f} | {row['8 clients']:.1f} | {row['tokens']:.0f} |")
        print(f"mask: {mask_cost(args.ckpt):.0f} us per token (llguidance's bitmask, the bias row, consume)")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
