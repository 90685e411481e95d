"""serve.py: an OpenAI-compatible HTTP server over the engine, with continuous batching.

    python serve.py [--ckpt DIR] [--port 8000] [--max-batch 8] [--api-key KEY] [chat.py's model flags]
    curl localhost:8000/v1/chat/completions -d '{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: GET /health (200 when the model is ready, 503 before), GET /v1/models, POST /v1/chat/completions and
POST /v1/completions (OpenAI's formats; "stream": true sends server-sent events).

Continuous batching: one scheduler thread owns the model. The KV cache has --max-batch rows; each request gets a row
while it runs. A new request is prefilled alone into a free row (positions 0.. of that row) and joins the running
decode at the next step; every decode step feeds each busy row its own last token at its own position (an idle row
writes to the scratch slot). A row is freed when its request ends (end of text, max_tokens, a stop string) or its
client goes away; more requests than rows wait in line. A row's result never depends on the others: the CPU kernels
compute each row alone, in the same order whatever the batch, so a request's greedy text is what
`python chat.py --prompt` prints for it. Sampling settings differ per request: they are inputs of the compiled step,
and each request draws its noise from its own generator (its `seed`).

The HTTP side is Starlette on uvicorn (small, well kept, plain ASGI: errors are OpenAI's {"error": ...} bodies with
the status OpenAI gives, not a validation framework's 422s). Stands on session.py and generate.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

import dense
import generate
import speculative
import tp
from checkpoint import CheckpointError
from default_model import default_checkpoint
from session import (add_model_flags, check_environment, fitting_cache, load_model, make_draft, parse_flags,
                     positive_int, steps_for_program)
from vocab import TextStream, UsageError, Vocabulary, load_vocabulary

CHAT_ROLES = ("system", "user", "assistant", "developer")
# Parameters that change results and are not implemented: refused by name (400), never ignored.
REFUSED = {"n": lambda v: v != 1, "logprobs": bool, "top_logprobs": lambda v: v is not None,
           "tools": lambda v: bool(v), "tool_choice": lambda v: v not in (None, "none"), "functions": bool,
           "function_call": lambda v: v not in (None, "none"), "logit_bias": bool,
           "presence_penalty": lambda v: v not in (None, 0), "frequency_penalty": lambda v: v not in (None, 0),
           "response_format": lambda v: v not in (None, {"type": "text"}), "echo": bool,
           "best_of": lambda v: v not in (None, 1), "suffix": lambda v: v not in (None, ""),
           "prediction": lambda v: v is not None, "audio": lambda v: v is not None,
           "modalities": lambda v: v not in (None, ["text"])}
IGNORED = ("model", "user", "metadata", "store", "service_tier", "parallel_tool_calls")  # no effect on the text


class BadRequest(Exception):
    """A request the server refuses: 4xx with OpenAI's error body naming the parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


# ----------------------------------------------------------------------------------------------------------------
# A request, as the scheduler runs it


@dataclass
class Request:
    """One completion: its prompt ids, settings, and what the scheduler sends back (events on `events`, an asyncio
    queue of the server's loop): ("text", piece), then ("done", finish_reason)."""
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    stop: list[str]
    generator: torch.Generator
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: bool = False  # the client went away: free the row
    generated: list[int] = field(default_factory=list)
    stream: TextStream | None = None  # the generated text, decoded as it grows
    pending: str = ""  # text held back: it may be the start of a stop string
    finish_reason: str | None = None

    def send(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Scheduler:
    """Owns the model: admits waiting requests into free cache rows (a prefill each), then runs one decode step over
    every row, until stopped. Under tensor parallel, rank 0 runs it and broadcasts each step to the other ranks."""

    def __init__(self, model: dense.DenseDecoder, vocab: Vocabulary, max_batch: int, max_seq_len: int,
                 compile: bool, draft=None, speculate_k: int = 4) -> None:
        self.model, self.vocab, self.draft, self.speculate_k = model, vocab, draft, speculate_k
        self.rows: list[Request | None] = [None] * max_batch
        self.positions = [0] * max_batch  # the slot each row's next token goes to
        self.last = [0] * max_batch  # the token each row feeds next
        self.waiting: queue.Queue[Request] = queue.Queue()
        self.vocab_limit = vocab.size if vocab.size < model.config.vocab_size else None
        self.stopping = threading.Event()
        self.idle_generator = torch.Generator(model.device)  # (an idle row's noise, never used)
        generate.setup_cache(model, max_batch, max_seq_len)
        self.max_seq_len = max_seq_len
        steps = steps_for_program(model, max_batch, max_seq_len) if compile else None
        self.runner = generate.Runner(model, steps)
        self.thread = threading.Thread(target=self.run, name="scheduler", daemon=True)

    def submit(self, request: Request) -> None:
        self.waiting.put(request)

    def run(self) -> None:
        while not self.stopping.is_set():
            self.admit()
            busy = [r for r in range(len(self.rows)) if self.rows[r] is not None]
            if not busy:
                try:  # idle: wait for a request
                    self.waiting.put(self.waiting.get(timeout=0.1))
                except queue.Empty:
                    pass
                continue
            self.decode(busy)
        tp.broadcast(("stop",)) if tp.world()[1] > 1 else None

    def admit(self) -> None:
        """Prefill waiting requests into free rows (each alone: a prefill's result never depends on the others)."""
        for row, current in enumerate(self.rows):
            if current is not None:
                continue
            while True:
                try:
                    request = self.waiting.get_nowait()
                except queue.Empty:
                    return
                if not request.cancelled:
                    break
            if self.draft is not None:
                self.speculate(request)
                continue
            logits = step(self.runner, ("prefill", row, request.prompt))
            token = int(sample_one(logits, request, self.vocab_limit))
            self.rows[row], self.positions[row], self.last[row] = request, len(request.prompt), token
            self.deliver(row, token)

    def decode(self, busy: list[int]) -> None:
        # A request alone (admitted to row 0, the first free one) decodes in a batch-1 step, at batch 1's speed;
        # otherwise every row steps (two compiled graphs in all, whatever the load).
        rows = self.rows[:1] if busy == [0] else self.rows
        tokens, positions = self.last[:len(rows)], self.positions[:len(rows)]
        for row, request in enumerate(rows):
            if request is None:  # an idle row writes to the scratch slot, which nothing reads
                tokens[row], positions[row] = 0, self.max_seq_len
        sampling = generate.Sampling(
            tuple(r.temperature if r else 0.0 for r in rows), tuple(r.top_k if r else None for r in rows),
            tuple(r.top_p if r else None for r in rows), self.vocab_limit,
            tuple(r.generator if r else self.idle_generator for r in rows))
        out = step(self.runner, ("decode", tokens, positions, sampling))[:, 0].tolist()
        for row in busy:
            self.positions[row] += 1
            self.last[row] = out[row]
            self.deliver(row, out[row])

    def deliver(self, row: int, token: int) -> None:
        """A row's new token: its text to the client (held back while it may start a stop string), and the row freed
        when the request is done."""
        request = self.rows[row]
        reason = finish(self.vocab, request, token)
        if reason or request.cancelled:
            request.finish_reason = reason or "cancelled"
            request.send("done", request.finish_reason)
            self.rows[row] = None

    def speculate(self, request: Request) -> None:
        """With a draft: the request alone, speculative decoding's exact output in fewer target steps."""
        tokens = speculative.generate_tokens(
            self.model, torch.tensor([request.prompt], device=self.model.device), request.max_tokens, self.draft,
            speculate_k=self.speculate_k, temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
            steps=self.runner.steps, vocab_limit=self.vocab_limit)
        self.rows[0] = request
        for token in tokens:
            self.deliver(0, int(token))
            if self.rows[0] is None:
                break
        self.rows[0] = None


def sample_one(logits: torch.Tensor, request: Request, vocab_limit: int | None) -> torch.Tensor:
    """The first token of a request, from its prefill's logits [1, V], with its own generator's noise."""
    noise = torch.empty_like(logits).exponential_(1, generator=request.generator)
    return dense.sample(logits, request.temperature, request.top_k, request.top_p, vocab_limit, noise)


def finish(vocab: Vocabulary, request: Request, token: int) -> str | None:
    """Take one generated token; returns the finish reason once the request is done ("stop" or "length")."""
    if token in vocab.stop_ids:
        flush(request, request.pending)
        return "stop"
    request.generated.append(token)
    if request.stream is None:
        request.stream = TextStream(vocab)
    request.pending += request.stream.push(token)
    for stop in request.stop:  # a stop string ends the text before it
        at = request.pending.find(stop)
        if at >= 0:
            flush(request, request.pending[:at])
            return "stop"
    if len(request.generated) >= request.max_tokens:
        flush(request, request.pending + request.stream.finish())
        return "length"
    keep = max((n for stop in request.stop for n in range(1, len(stop)) if request.pending.endswith(stop[:n])),
               default=0)  # the longest tail that could still grow into a stop string
    flush(request, request.pending[: len(request.pending) - keep])
    request.pending = request.pending[len(request.pending) - keep:]
    return None


def flush(request: Request, text: str) -> None:
    request.pending = ""
    if text:
        request.send("text", text)


def step(runner: generate.Runner, action: tuple):
    """One model call of the scheduler; under tensor parallel every rank makes it (rank 0 says which)."""
    if tp.world()[1] > 1:
        tp.broadcast(action)
    return step_local(runner, action)


def follow(runner: generate.Runner) -> None:
    """Ranks other than 0 under torchrun: make every model call rank 0 makes, until it stops."""
    while True:
        action = tp.broadcast(None)
        if action[0] == "stop":
            return
        step_local(runner, action)


def step_local(runner, action) -> torch.Tensor:
    model = runner.model
    if action[0] == "prefill":
        _, row, prompt = action
        return runner.prefill(torch.tensor([prompt], device=model.device), 0, None,
                              rows=torch.tensor([row], device=model.device))
    _, tokens, positions, sampling = action
    return runner.decode(torch.tensor(tokens, device=model.device)[:, None], positions, None, sampling)


# ----------------------------------------------------------------------------------------------------------------
# Requests: OpenAI's parameters, checked


def number(body: dict, name: str, kind, default, low=None, high=None, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise BadRequest(f"'{name}' must be {'a number' if kind is float else 'an integer'}, got {value!r}", name)
    if low is not None and (value <= low if low_open else value < low):
        raise BadRequest(f"'{name}' must be {'above' if low_open else 'at least'} {low}, got {value}", name)
    if high is not None and value > high:
        raise BadRequest(f"'{name}' must be at most {high}, got {value}", name)
    return kind(value)


def parse_request(body, kind: str, state: "Server") -> dict:
    """The generation settings of a JSON body (chat: messages rendered by the checkpoint's template; completion: the
    prompt as `chat.py --complete` tokenizes it), or BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    allowed = {"messages"} if kind == "chat" else {"prompt"}
    allowed |= {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                "stream_options", *REFUSED, *IGNORED}
    for name, value in body.items():
        if name in REFUSED and REFUSED[name](value):
            raise BadRequest(f"'{name}' is not supported by this server", name)
        if name not in allowed:
            raise BadRequest(f"unrecognized parameter '{name}'", name)
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise BadRequest(f"messages[{i}] must be an object with a string 'content'", f"messages[{i}]")
            if m.get("role") not in CHAT_ROLES:
                raise BadRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.get('role')!r}",
                                 f"messages[{i}].role")
        if not state.vocab.chat_template:
            raise BadRequest("this checkpoint has no chat template: use /v1/completions", "messages")
        messages = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
                    for m in messages]
        try:
            prompt = state.vocab.encode(state.vocab.render(messages), special=False)
        except UsageError as e:
            raise BadRequest(str(e), "messages") from None
    else:
        text = body.get("prompt")
        if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
            text = text[0]
        if not isinstance(text, str):
            raise BadRequest("'prompt' must be a string", "prompt")
        prompt = state.vocab.encode(text, special=True)
    if not prompt:
        raise BadRequest("the prompt is empty", "prompt" if kind != "chat" else "messages")
    room = state.max_seq_len - len(prompt)
    if room < 1:
        raise BadRequest(f"the prompt has {len(prompt)} tokens; the context holds {state.max_seq_len}",
                         "messages" if kind == "chat" else "prompt", code="context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = number(body, name, int, room, low=1)
    if max_tokens > room:
        raise BadRequest(f"'{name}' {max_tokens} is more than the {room} tokens the context has left after the "
                         f"{len(prompt)}-token prompt", name, code="context_length_exceeded")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise BadRequest("'stop' must be a string or a list of up to 16 non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise BadRequest("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    seed = number(body, "seed", int, None)
    generator = torch.Generator(state.scheduler.model.device if state.scheduler else "cpu")  # (the noise's device)
    generator.manual_seed(seed if seed is not None else int(torch.randint(2**62, ())))
    top_p = number(body, "top_p", float, None, low=0, high=1, low_open=True)
    return {"prompt": prompt, "max_tokens": max_tokens, "stop": stop, "stream": stream,
            "include_usage": options.get("include_usage", False), "generator": generator,
            "temperature": number(body, "temperature", float, 1.0, low=0, high=2),
            "top_p": None if top_p == 1 else top_p, "top_k": number(body, "top_k", int, None, low=1)}


# ----------------------------------------------------------------------------------------------------------------
# The HTTP server


class Server:
    """The state the routes share: the scheduler (once the model is loaded), the vocabulary, the model's name."""

    def __init__(self, args) -> None:
        self.args, self.ready, self.error = args, threading.Event(), None
        self.scheduler: Scheduler | None = None
        self.vocab: Vocabulary | None = None
        self.max_seq_len = 0
        self.name = "dense"

    def load(self, console) -> None:
        """Load the model and start the scheduler (a thread of its own; /health answers 503 meanwhile)."""
        args = self.args
        check_environment(args, console)
        ckpt = args.ckpt or default_checkpoint(console)
        self.name = os.path.basename(os.path.normpath(ckpt))
        self.vocab = load_vocabulary(ckpt, args.tokenizer)
        model, why = load_model(ckpt, args, console)
        print(why, file=sys.stderr, flush=True)
        draft = make_draft(args, model, console)
        batch = 1 if draft is not None else args.max_batch
        self.max_seq_len = args.max_seq_len or fitting_cache(model, batch)
        self.scheduler = Scheduler(model, self.vocab, batch, self.max_seq_len, args.compile, draft, args.speculate_k)
        warm_up(self.scheduler)
        self.scheduler.thread.start()
        self.ready.set()


def warm_up(scheduler: Scheduler) -> None:
    """Run the steps a first request needs (prefill and decode, eager or compiled) on a throwaway prompt."""
    def throwaway(prompt: list[int]) -> Request:
        request = Request(prompt, 2, 0.0, None, None, [], scheduler.idle_generator, None, None)
        request.send = lambda *event: None
        return request

    # a long prompt (eager prefill) twice: the all-rows decode step; a short one alone: the compiled prefill chunk and
    # the batch-1 decode step
    for prompts in ([[1] * (generate.PREFILL_CHUNK + 1)] * min(2, len(scheduler.rows)), [[1]]):
        for prompt in prompts:
            scheduler.submit(throwaway(prompt))
        scheduler.admit()
        for _ in range(2):
            busy = [r for r, q in enumerate(scheduler.rows) if q is not None]
            if busy:
                scheduler.decode(busy)
    scheduler.rows = [None] * len(scheduler.rows)


def error_response(e: BadRequest):
    from starlette.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status)


def make_app(server: Server):
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def health(request):
        if server.error:
            return JSONResponse({"status": "error", "error": server.error}, status_code=500)
        return JSONResponse({"status": "ok"} if server.ready.is_set() else {"status": "loading"},
                            status_code=200 if server.ready.is_set() else 503)

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": server.name, "object": "model",
                                                          "created": int(time.time()), "owned_by": "dense-engine"}]})

    async def completions(request, kind: str):
        if not server.ready.is_set():
            raise BadRequest("the model is loading; try again shortly", status=503, kind="server_error")
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the body is not valid JSON ({getattr(e, 'msg', 'not UTF-8')})") from None
        settings = parse_request(body, kind, server)
        loop = asyncio.get_running_loop()
        job = Request(settings["prompt"], settings["max_tokens"], settings["temperature"], settings["top_p"],
                      settings["top_k"], settings["stop"], settings["generator"], loop, asyncio.Queue())
        created, ident = int(time.time()), ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        model_name = body.get("model") if isinstance(body.get("model"), str) else server.name
        server.scheduler.submit(job)
        request.scope.setdefault("state", {})["job"] = job

        def usage() -> dict:
            return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.generated),
                    "total_tokens": len(job.prompt) + len(job.generated)}

        def choice(text: str | None, reason: str | None, delta: bool) -> dict:
            if kind == "chat":
                message = {"content": text} if delta else {"role": "assistant", "content": text}
                if delta and text is None:
                    message = {}
                return {"index": 0, "delta" if delta else "message": message, "finish_reason": reason,
                        "logprobs": None}
            return {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}

        obj = "chat.completion" if kind == "chat" else "text_completion"
        head = {"id": ident, "created": created, "model": model_name, "system_fingerprint": None}
        if not settings["stream"]:
            text = []
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():  # the client went away: free its row, answer no one
                        job.cancelled = True
                        return JSONResponse({}, status_code=499)
                    continue
                if event[0] == "done":
                    break
                text.append(event[1])
            return JSONResponse({**head, "object": obj, "choices": [choice("".join(text), job.finish_reason, False)],
                                 "usage": usage()})

        async def events():
            chunk = "chat.completion.chunk" if kind == "chat" else "text_completion"
            try:
                if kind == "chat":  # the role first, as OpenAI's streams start
                    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                             "logprobs": None}
                    yield sse({**head, "object": chunk, "choices": [first]})
                while True:
                    event = await job.events.get()
                    if event[0] == "done":
                        yield sse({**head, "object": chunk, "choices": [choice(None, job.finish_reason, True)]})
                        break
                    yield sse({**head, "object": chunk, "choices": [choice(event[1], None, True)]})
                if settings["include_usage"]:
                    yield sse({**head, "object": chunk, "choices": [], "usage": usage()})
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or the stream ended): the row is freed at the next step
                job.cancelled = job.finish_reason is None

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def chat(request):
        return await completions(request, "chat")

    async def complete(request):
        return await completions(request, "completion")

    async def bad_request(request, e: BadRequest):
        return error_response(e)

    async def http_error(request, e: HTTPException):
        message = "not found" if e.status_code == 404 else e.detail
        return error_response(BadRequest(f"{request.method} {request.url.path}: {message}", status=e.status_code))

    async def crash(request, e: Exception):  # a bug of ours: one line in the log, a 500 body, the server goes on
        print(f"error: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return error_response(BadRequest(f"internal error: {type(e).__name__}", status=500, kind="server_error"))

    routes = [Route("/health", health), Route("/v1/models", models),
              Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/completions", complete,
                                                                             methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={BadRequest: bad_request, HTTPException: http_error,
                                                        Exception: crash})
    return Guard(app, server.args.api_key)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Guard:
    """ASGI middleware: the API key (when --api-key is set) and one log line per request (method, path, status,
    tokens, time)."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [0]
        scope.setdefault("state", {})
        if self.api_key is not None and scope["path"] != "/health":
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                from starlette.responses import JSONResponse

                response = JSONResponse(BadRequest("invalid or missing API key (Authorization: Bearer KEY)",
                                                   status=401, code="invalid_api_key").body(), status_code=401)
                await response(scope, receive, send)
                log(scope, 401, None, start)
                return

        async def watched(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log(scope, status[0], scope["state"].get("job"), start)

        await self.app(scope, receive, watched)


def log(scope, status: int, job: Request | None, start: float) -> None:
    tokens = f"{len(job.prompt)}+{len(job.generated)} tokens" if job is not None else "-"
    print(f"{scope['method']} {scope['path']} {status} {tokens} {(time.perf_counter() - start) * 1000:.0f} ms",
          file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# The program


def parse_args(argv):
    p = argparse.ArgumentParser(description="Serve the model over OpenAI's HTTP API, with continuous batching.")
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=positive_int, default=8,
                   help="requests decoded together (more wait in line); speculative decoding serves one at a time")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request")
    args = parse_flags(p, argv)
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    if tp.world()[1] > 1 and (args.draft or args.draft_quant or args.lookup):
        raise UsageError("speculative decoding is not served under torchrun (tensor parallel): drop --draft, "
                         "--draft-quant and --lookup")
    return args


def main(argv=None) -> int:
    from rich.console import Console

    argv = sys.argv[1:] if argv is None else argv
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        args = parse_args(argv)
        if tp.world()[1] > 1:
            tp.setup(torch.device(args.device).type)
        if tp.world()[0] != 0:  # tensor parallel: the other ranks follow rank 0's model calls
            return serve_follower(args, console)
        return serve(args, console)
    except (UsageError, CheckpointError, ValueError, OSError) as e:
        if "--debug" in argv:
            raise
        sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        return 2


def serve(args, console) -> int:
    import uvicorn

    server = Server(args)

    class Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGTERM or SIGINT: finish cleanly, exit 0 (stock uvicorn
            self.should_exit = True  # raises the signal again once it has stopped: status -15)

    config = uvicorn.Config(make_app(server), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=5, lifespan="off")
    http = Uvicorn(config)

    def loading():
        try:
            server.load(console)
            print(f"serving {server.name} on http://{args.host}:{args.port} (batch {server.scheduler.rows.__len__()},"
                  f" context {server.max_seq_len})", file=sys.stderr, flush=True)
        except (UsageError, CheckpointError, ValueError, OSError) as e:
            server.error = " ".join(str(e).split())
            sys.stderr.write(f"error: {server.error}\n")
            http.should_exit = True

    threading.Thread(target=loading, name="loading", daemon=True).start()
    http.run()
    if server.scheduler is not None:
        server.scheduler.stopping.set()
        if tp.world()[1] > 1:
            server.scheduler.thread.join(timeout=5)
    if tp.world()[1] > 1:
        tp.exit(0 if server.error is None else 2)
    return 0 if server.error is None else 2


def serve_follower(args, console) -> int:
    ckpt = args.ckpt or default_checkpoint(console)
    vocab = load_vocabulary(ckpt, args.tokenizer)
    model, _ = load_model(ckpt, args, console)
    max_seq_len = args.max_seq_len or fitting_cache(model, args.max_batch)
    scheduler = Scheduler(model, vocab, args.max_batch, max_seq_len, args.compile)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    follow(scheduler.runner)
    tp.exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
