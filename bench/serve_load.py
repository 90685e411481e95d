"""A load test of the OpenAI-compatible server: N clients, each sending one streamed chat request after another
for T seconds; requests/s, generated tokens/s, time to first token and inter-token latency (p50, p95). This engine's
serve.py and llama.cpp's servers (its own `llama-server`, a slot per row of ours; llama-cpp-python's
`llama_cpp.server`) on the same GGUF, under the same load, side by side, each in its own process (started here,
stopped after its rows).

    python bench/serve_load.py [--clients 1,4,8,16] [--seconds 60] [--engines dense,llama-server,llama] \
        [--llama-server BINARY] [--llama-python VENV/bin/python] [--quant auto] [--gguf FILE] [--replies short|long] \
        [--scenarios load,multi-turn,long-prompt,timeouts,flood,restart] [--root CHECKOUT] \
        [--serve-flag=--no-prefix-reuse]

Also measures the same 8 requests sent one after another (one client, 8 requests), the reference for the batching
gain: aggregate tokens/s with 8 clients over it. Greedy (temperature 0), 128 tokens a request, prompts from a fixed
list (chat template applied by each server): `--replies short` (the default) asks questions the default model
answers in 8-128 tokens (88 on average; `--tokens 44` holds them to ~40), so a request's prefill weighs about as much
as its decode; `--replies long` asks for essays and stories,
which run to the 128-token limit, the shape of a chat reply or a throughput benchmark (vLLM's, with its ignore-eos).

The other scenarios (this engine only, a server of their own each):
- multi-turn: one chat of 6 turns, each reply appended to the history; time to first token per turn.
- long-prompt: 4 streams running long replies; a ~3,000-token prompt arrives; its time to first token and the
  largest gap between two tokens of the 4 streams (context 4096).
- timeouts: 8 non-streamed requests (max_tokens 2000, end of text suppressed) whose clients give up after 1 s; the
  time of a request sent after them against the same request on the idle server.
- flood: 100 requests at once with --max-queue 16: answered, refused (503), or neither within 300 s; then one more.
- conversations-4, conversations-20: that many conversations, each with its own ~800-token system prompt, a turn
  each in turn, 3 rounds: the median time to first token per round (8 rows: 4 fit, 20 do not).
- speculative: --lookup; one client whose prompt repeats itself beside 4 plain ones, started together: each one's
  time to first token and largest gap between two pieces of text.
- restart: a ~3,000-token system prompt asked about twice, the server restarted, then asked again: the time to first
  token after the restart (the prefix store's disk files) against the first, cold one.
--root runs another checkout's serve.py (a before/after pair from one script).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis simply.",
           "List three uses of copper.", "Why is the sky blue?", "Tell me a short story about a cat.",
           "What does a compiler do?", "Give me a recipe for pancakes."]
LONG_PROMPTS = ["Write a long story about a cat who sails around the world.",
                "Write a detailed essay on the history of the printing press.",
                "Explain in detail, step by step, how a car engine works.",
                "Write a long letter to a friend describing your summer holiday.",
                "Describe in detail the water cycle and why it matters for farming.",
                "Write a long story about a robot who learns to paint.",
                "Write a detailed guide to starting a vegetable garden.",
                "Write a long essay about the importance of sleep for students."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(engine: str, args, ctx: int | None = None, extra=()) -> tuple[subprocess.Popen, int]:
    port = free_port()
    if engine == "dense":
        cmd = [sys.executable, os.path.join(args.root, "serve.py"), "--port", str(port), "--max-batch",
               str(args.max_batch), "--quant", args.quant, "--max-seq-len", str(ctx or args.ctx), *args.serve_flag,
               *extra]
        if args.gguf:
            cmd += ["--ckpt", args.gguf]
    elif engine == "llama-server":  # llama.cpp's own: a slot per row of ours, each with our context
        cmd = [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port), "-np",
               str(args.max_batch), "-c", str(args.ctx * args.max_batch), "-t", str(os.cpu_count())]
    else:
        cmd = [args.llama_python, "-m", "llama_cpp.server", "--model", args.gguf, "--port", str(port), "--n_ctx",
               str(args.ctx), "--n_threads", str(os.cpu_count()), "--interrupt_requests", "False"]
        # (by default a new request interrupts the one being generated: under load, streams end cut off)
    log = open(os.path.join(tempfile.gettempdir(), f"serve-load-{engine}.log"), "w")  # noqa: SIM115 (the server's)
    process = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=args.root)
    import urllib.request

    end = time.monotonic() + 900  # (a first run compiles its steps)
    while time.monotonic() < end:
        try:
            ready = "/v1/models" if engine == "llama" else "/health"  # (503 until the model is loaded)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{ready}", timeout=2):
                return process, port
        except OSError:
            if process.poll() is not None:
                sys.exit(f"{engine} server exited; see {log.name}")
            time.sleep(1)
    sys.exit(f"{engine} server did not start")


async def stream_chat(client, messages: list, tokens: int) -> dict:
    """One streamed chat request (greedy): its reply, time to first token, the arrival of each piece of text, the
    completion tokens (the server's usage), and when it ended."""
    start, times, text, usage = time.perf_counter(), [], [], None
    stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=tokens, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return {"text": "".join(text), "ttft": times[0] - start if times else None, "times": times,
            "tokens": usage if usage is not None else len(times), "end": time.perf_counter()}


def openai_client(port: int, timeout: float = 600):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=timeout)


async def load(port: int, clients: int, seconds: float, tokens: int, requests: int | None = None,
               prompts: list[str] = PROMPTS) -> dict:
    """clients loops for `seconds` (or `requests` in all, one client); the metrics over completed requests."""
    client = openai_client(port)
    results, start = [], time.perf_counter()

    async def user(index: int):
        i = index
        while (requests is None and time.perf_counter() - start < seconds) or (requests is not None and
                                                                              len(results) < requests):
            results.append(await stream_chat(client, [{"role": "user", "content": prompts[i % len(prompts)]}], tokens))
            i += clients

    async with client:  # closed inside this event loop (asyncio.run closes the loop next)
        await asyncio.gather(*(user(i) for i in range(clients)))
    elapsed = max(r["end"] for r in results) - start
    ttft = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    gaps = sorted(b - a for r in results for a, b in zip(r["times"], r["times"][1:]))

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else None

    return {"clients": clients, "requests": len(results), "seconds": elapsed,
            "requests_per_s": len(results) / elapsed, "tokens_per_s": sum(r["tokens"] for r in results) / elapsed,
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p95_ms": pct(ttft, 0.95), "itl_p50_ms": pct(gaps, 0.5),
            "itl_p95_ms": pct(gaps, 0.95)}


async def multi_turn(port: int) -> dict:
    """One conversation of 6 turns, each reply appended: time to first token per turn."""
    questions = ["Tell me about the history of Paris.", "What about its museums?", "Which one should I visit first?",
                 "How long would that take?", "And what should I eat nearby?", "Summarize our conversation."]
    messages, ttft = [], []
    async with openai_client(port) as client:
        await stream_chat(client, [{"role": "user", "content": "Hello!"}], 8)  # (warm-up: turn 1 is not a cold start)
        for q in questions:
            messages.append({"role": "user", "content": q})
            reply = await stream_chat(client, messages, 64)
            messages.append({"role": "assistant", "content": reply["text"]})
            ttft.append(reply["ttft"] * 1000)
    return {"scenario": "multi-turn", "ttft_ms_per_turn": ttft, "turn6_over_turn1": ttft[-1] / ttft[0]}


async def long_prompt(port: int, prompt_tokens: int = 3000) -> dict:
    """4 streams with long replies; then a ~3,000-token prompt: its time to first token, and the 4 streams' largest
    gap between two tokens while it was prefilled (and over their whole replies)."""
    page = " ".join(["The history of the printing press begins long before Gutenberg, with carved wooden blocks."]
                    * (prompt_tokens // 17))
    async with openai_client(port) as client:
        streams = [asyncio.ensure_future(stream_chat(client, [{"role": "user", "content": p}], 400))
                   for p in LONG_PROMPTS[:4]]
        await asyncio.sleep(2.0)  # (the four are decoding)
        sent = time.perf_counter()
        long = await stream_chat(client, [{"role": "user", "content": "Summarize this page:\n" + page}], 16)
        first = sent + long["ttft"]
        replies = await asyncio.gather(*streams)
    during, overall = [], []
    for r in replies:
        gaps = [(a, b - a) for a, b in zip(r["times"], r["times"][1:])]
        overall += [g for _, g in gaps]
        during += [g for a, g in gaps if a + g >= sent and a <= first]
    return {"scenario": "long-prompt", "prompt_chars": len(page), "long_ttft_ms": long["ttft"] * 1000,
            "largest_gap_during_ms": max(during, default=0) * 1000, "largest_gap_ms": max(overall) * 1000,
            "median_gap_ms": sorted(overall)[len(overall) // 2] * 1000}


async def timeouts(port: int) -> dict:
    """The same short request on the idle server, then after 8 non-streamed requests whose clients gave up."""
    async def reference() -> float:
        async with openai_client(port) as client:
            start = time.perf_counter()
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPTS[0]}],
                                                 max_tokens=32, temperature=0)
            return (time.perf_counter() - start) * 1000

    idle = min([await reference() for _ in range(3)])
    async with openai_client(port, timeout=1.0) as client:
        async def abandoned(prompt: str):
            try:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=2000, temperature=0,
                                                     logit_bias={str(i): -100 for i in range(3)})
            except Exception:  # noqa: BLE001 (the client's timeout: it went away)
                return
        await asyncio.gather(*(abandoned(p) for p in LONG_PROMPTS))
    after = await reference()
    return {"scenario": "timeouts", "idle_ms": idle, "after_8_abandoned_ms": after, "ratio": after / idle}


async def flood(port: int, count: int = 100, limit: float = 300) -> dict:
    """count requests at once: answered (200), refused (503), or neither within `limit` seconds; then one more."""
    import openai

    async with openai_client(port, timeout=limit) as client:
        async def one(i: int):
            try:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=32,
                    temperature=0)
                return 200
            except openai.APIStatusError as e:
                return e.status_code
            except openai.APITimeoutError:
                return "hung"
        start = time.perf_counter()
        statuses = await asyncio.gather(*(one(i) for i in range(count)))
        elapsed = time.perf_counter() - start
        after = await one(0)
    return {"scenario": "flood", "requests": count, "answered": statuses.count(200), "refused_503": statuses.count(503),
            "other": [s for s in statuses if s not in (200, 503)], "seconds": elapsed, "next_request": after}


async def speculative(port: int) -> dict:
    """One client whose reply speculates (prompt lookup: a prompt that repeats itself) beside 4 plain ones, started
    together: each client's time to first token and its largest gap between two pieces of text."""
    repeated = "Repeat this list exactly, ten times: alpha, beta, gamma, delta, epsilon."
    prompts = [repeated] + PROMPTS[:4]
    async with openai_client(port) as client:
        await stream_chat(client, [{"role": "user", "content": "Hello!"}], 8)  # (warm-up)
        replies = await asyncio.gather(*(stream_chat(client, [{"role": "user", "content": p}], 96) for p in prompts))
    def gaps(r):
        return [b - a for a, b in zip(r["times"], r["times"][1:])] or [0.0]
    return {"scenario": "speculative", "ttft_ms": [round(r["ttft"] * 1000) for r in replies],
            "largest_gap_ms": [round(max(gaps(r)) * 1000) for r in replies],
            "median_gap_ms": [round(sorted(gaps(r))[len(gaps(r)) // 2] * 1000, 1) for r in replies],
            "tokens": [r["tokens"] for r in replies],
            "seconds": [round(r["end"] - r["times"][0] + r["ttft"], 2) if r["times"] else None for r in replies]}


async def conversations(port: int, count: int, turns: int = 3, system_tokens: int = 800) -> dict:
    """`count` conversations, each with its own ~800-token system prompt (they share the chat template's first
    tokens, as every conversation does), a turn each in turn, `turns` rounds: the median time to first token per
    round (issue 55: a conversation that fits in the rows should find its row again)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "english.txt")) as f:  # noqa: ASYNC230
        words = f.read().split()  # (a small file, read once before any request)
    per = system_tokens * 3 // 4  # (about 0.75 words a token)
    run = time.time_ns()  # (new to this run: the prefix store's disk files of an earlier run hold none of them)
    systems = [f"You are assistant {k} of run {run}. Read this first: " + " ".join(
        words[(k * 997) % max(1, len(words) - per):][:per]) for k in range(count)]
    histories = [[{"role": "system", "content": system}] for system in systems]
    questions = ["What is this text about?", "Say more about its second part.", "Summarize it in a line."]
    rounds = []
    async with openai_client(port) as client:
        await stream_chat(client, [{"role": "user", "content": "Hello!"}], 8)  # (warm-up)
        for turn in range(turns):
            ttft = []
            for history in histories:
                history.append({"role": "user", "content": questions[turn % len(questions)]})
                reply = await stream_chat(client, history, 32)
                history.append({"role": "assistant", "content": reply["text"]})
                ttft.append(reply["ttft"] * 1000)
            rounds.append(statistics.median(ttft))
    return {"scenario": f"conversations-{count}", "ttft_ms_median_per_turn": rounds,
            "turn3_over_turn1": rounds[-1] / rounds[0]}


def restart(args) -> dict:
    """A ~3,000-token system prompt (new to this run: a nonce in front) and a question, asked twice on one server (the
    second finds the prompt in a row: a prefix used twice, written to disk); the server stopped and started again;
    the same system prompt with another question: its time to first token against the first (cold) request's."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "english.txt")) as f:
        words = f.read().split()
    system = f"Session {time.time_ns()}. Read this first: " + " ".join((words * 4)[:2250])

    async def ask(port: int, question: str) -> float:
        async with openai_client(port) as client:
            reply = await stream_chat(client, [{"role": "system", "content": system},
                                               {"role": "user", "content": question}], 16)
            return reply["ttft"] * 1000

    ttft = []
    for questions in (["What is this text about?", "Who wrote it?"], ["Summarize it in a line."]):
        process, port = start("dense", args, 4096)
        try:
            asyncio.run(stream_chat_once(port))  # (warm-up: the first request is not a compile)
            ttft += [asyncio.run(ask(port, q)) for q in questions]
        finally:
            process.terminate()
            process.wait(timeout=60)
    return {"scenario": "restart", "cold_ttft_ms": ttft[0], "same_server_ttft_ms": ttft[1],
            "after_restart_ttft_ms": ttft[2], "after_restart_over_cold": ttft[2] / ttft[0]}


async def stream_chat_once(port: int) -> None:
    async with openai_client(port) as client:
        await stream_chat(client, [{"role": "user", "content": "Hello!"}], 8)


SCENARIOS = {"multi-turn": (multi_turn, None, ()), "long-prompt": (long_prompt, 4096, ()),
             "conversations-4": (lambda port: conversations(port, 4), None, ()),
             "conversations-20": (lambda port: conversations(port, 20), None, ()),
             "timeouts": (timeouts, None, ()), "flood": (flood, None, ("--max-queue", "16")),
             "speculative": (speculative, None, ("--lookup",))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,4,8,16")
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--engines", default="dense,llama")
    p.add_argument("--llama-python", help="python of a virtualenv with llama-cpp-python[server] (--engines llama)")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary (--engines llama-server)")
    p.add_argument("--gguf", help="the GGUF both engines serve (default: the default model's)")
    p.add_argument("--quant", default="auto", help="this engine's --quant")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--replies", choices=["short", "long"], default="short",
                   help="questions answered in 8-128 tokens (88 on average), or essays that run to --tokens")
    p.add_argument("--scenarios", default="load",
                   help="load (the clients above) and/or " + ", ".join([*SCENARIOS, "restart"]))
    p.add_argument("--root", default=ROOT, help="the checkout whose serve.py runs (default: this one)")
    p.add_argument("--serve-flag", action="append", default=[], help="one more serve.py flag (repeat it)")
    args = p.parse_args()
    if not args.gguf:
        from dense_engine.formats import default_model

        args.gguf = default_model.fetch_default_gguf(tempfile.mkdtemp(prefix="dense-bench-"))
    rows = []
    for name in args.scenarios.split(","):
        if name == "load":
            continue
        if name == "restart":
            rows.append(restart(args))
            print(json.dumps(rows[-1]), flush=True)
            continue
        scenario, ctx, extra = SCENARIOS[name]
        with open(os.path.join(args.root, "serve.py")) as f:  # (an older serve.py: without its new flags)
            extra = extra if name == "speculative" or all(flag in f.read() for flag in extra[::2]) else ()
        process, port = start("dense", args, ctx, extra)
        try:
            row = asyncio.run(scenario(port))
        finally:
            process.terminate()
            process.wait(timeout=30)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if "load" not in args.scenarios.split(","):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    for engine in args.engines.split(","):
        if engine == "llama" and not args.llama_python:
            sys.exit("--engines llama needs --llama-python")
        if engine == "llama-server" and not args.llama_server:
            sys.exit("--engines llama-server needs --llama-server BINARY")
        process, port = start(engine, args)
        prompts = LONG_PROMPTS if args.replies == "long" else PROMPTS
        try:
            asyncio.run(load(port, 1, 0, 8, requests=1))  # warm-up
            sequential = asyncio.run(load(port, 1, 0, args.tokens, requests=8, prompts=prompts))
            sequential.update(engine=engine, mode="8 requests one after another")
            rows.append(sequential)
            print(json.dumps(sequential), flush=True)
            for clients in map(int, args.clients.split(",")):
                row = asyncio.run(load(port, clients, args.seconds, args.tokens, prompts=prompts))
                row.update(engine=engine, mode=f"{clients} clients, {args.seconds:.0f} s")
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            process.terminate()
            process.wait(timeout=30)
    print(f"\n{'engine':12s} {'load':30s} {'req/s':>6s} {'tok/s':>7s} {'TTFT p50/p95 ms':>16s} {'ITL p50/p95 ms':>15s}")
    for r in (r for r in rows if "engine" in r):  # (the scenarios' rows were printed as they came)
        print(f"{r['engine']:12s} {r['mode']:30s} {r['requests_per_s']:6.2f} {r['tokens_per_s']:7.1f} "
              f"{r['ttft_p50_ms'] or 0:7.0f} /{r['ttft_p95_ms'] or 0:6.0f} {r['itl_p50_ms'] or 0:7.1f} /"
              f"{r['itl_p95_ms'] or 0:6.1f}")
    for engine in args.engines.split(","):
        seq = next(r for r in rows if r.get("engine") == engine and "one after" in r["mode"])
        eight = next((r for r in rows if r.get("engine") == engine and r["clients"] == 8
                      and "one after" not in r["mode"]), None)
        if eight:
            print(f"{engine}: 8 clients {eight['tokens_per_s'] / seq['tokens_per_s']:.2f}x the same requests one after "
                  "another")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
