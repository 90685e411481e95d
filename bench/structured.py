"""Structured output against llama.cpp's grammar on the same GGUF file: which replies parse (and validate).

    python bench/structured.py --llama-python VENV/bin/python [--gguf FILE] [--max-tokens 96]

Eight requests (four JSON schemas, four json_object; issue 100's kind, greedy): this engine's server through the
openai client, and llama-cpp-python's create_chat_completion with the same schema (its grammar from llama.cpp's
json-schema-to-grammar) in its own virtual environment. Without --gguf, the default model's file (SmolLM2-135M-Instruct
Q4_1). Prints a row per request and the counts; the replies in JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

# the requests, shared with tests/test_serve.py: [{"prompt", "schema" (null: json_object)}]
REQUESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures",
                        "structured_requests.json")


LLAMA_SCRIPT = """
import json, sys
from llama_cpp import Llama
requests, path, max_tokens = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=2048, n_threads=2, verbose=False)
out = []
for prompt, schema in requests:
    fmt = {"type": "json_object", **({"schema": schema} if schema else {})}
    reply = llm.create_chat_completion(messages=[{"role": "user", "content": prompt}], response_format=fmt,
                                       temperature=0, max_tokens=max_tokens)
    out.append([reply["choices"][0]["message"]["content"], reply["choices"][0]["finish_reason"]])
print(json.dumps(out))
"""


def parses(text: str, schema) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema or {"type": "object"})
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def ours(requests: list, gguf: str, max_tokens: int) -> list[tuple[str, str]]:
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serve.py")
    server = subprocess.Popen([sys.executable, serve, "--ckpt", gguf, "--port", str(port), "--no-compile"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for _ in range(600):  # (until the model is loaded: /health answers 200)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        out = []
        for prompt, schema in requests:
            fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}} if schema else {
                "type": "json_object"}
            reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                                   response_format=fmt, temperature=0, max_tokens=max_tokens)
            out.append((reply.choices[0].message.content, reply.choices[0].finish_reason))
        return out
    finally:
        server.terminate()
        server.wait()


def theirs(requests: list, python: str, gguf: str, max_tokens: int) -> list[tuple[str, str]]:
    result = subprocess.run([python, "-c", LLAMA_SCRIPT, json.dumps(requests), gguf, str(max_tokens)],
                            capture_output=True, text=True, check=True)
    return [tuple(r) for r in json.loads(result.stdout.strip().splitlines()[-1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python installed")
    parser.add_argument("--gguf", help="the GGUF file (default: the default model's)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--json", action="store_true", help="print the replies as JSON")
    args = parser.parse_args()
    with open(REQUESTS) as f:
        requests = [(r["prompt"], r["schema"]) for r in json.load(f)]
    if not args.gguf:
        from dense_engine.formats import default_model

        args.gguf = default_model.fetch_default_gguf(tempfile.mkdtemp(prefix="dense-bench-"))
    rows = {"dense-engine": ours(requests, args.gguf, args.max_tokens),
            "llama.cpp": theirs(requests, args.llama_python, args.gguf, args.max_tokens)}
    if args.json:
        print(json.dumps(rows, indent=1))
    print(f"{'request':<60} {'dense-engine':>14} {'llama.cpp':>14}")
    for i, (prompt, schema) in enumerate(requests):
        cells = [("parses" if parses(rows[k][i][0], schema) else "no") + f" ({rows[k][i][1]})" for k in rows]
        print(f"{prompt[:58] + (' [schema]' if schema else ''):<60} {cells[0]:>14} {cells[1]:>14}")
    counts = {k: sum(parses(r[0], s) for r, (_, s) in zip(rows[k], requests)) for k in rows}
    print("parsed: " + ", ".join(f"{k} {n} of {len(requests)}" for k, n in counts.items()))


if __name__ == "__main__":
    main()
