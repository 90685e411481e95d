"""serve.py: an OpenAI-compatible HTTP server over the engine, with continuous batching.

    python serve.py [--ckpt DIR] [--port 8000] [--max-batch 8] [--api-key KEY] [chat.py's model flags]
    curl localhost:8000/v1/chat/completions -d '{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: GET /health (200 when the model is ready, 503 before), GET /v1/models, POST /v1/chat/completions and
POST /v1/completions (OpenAI's formats; "stream": true sends server-sent events), POST /tokenize and /detokenize
(llama-server's shapes), GET /metrics (Prometheus).

Continuous batching: one scheduler thread owns the model. The KV cache has --max-batch rows; each request gets a row
while it runs (the free row whose cache already holds the longest prefix of its prompt: only the rest is prefilled).
Each scheduler turn admits waiting requests, prefills (while other rows stream, at most --prefill-chunk tokens, so a
long prompt goes in chunks between their steps; prompts admitted together in one pass), then runs one decode step
that feeds each busy row its own last token at its own position (an idle or still-prefilling row writes to the
scratch slot). A row is freed when its request ends (end of text, max_tokens, a stop string) or its client goes away;
more requests than rows wait in line (--max-queue). Decoding, a row's result never depends on the others: the CPU
kernels compute each row alone, in the same order whatever the batch; a prompt prefilled in chunks or beside others
may differ in the last bits of its logits from a whole prefill (its greedy text is tested equal). Sampling settings
differ per request: they are inputs of the compiled step, and each request draws its noise from its own generator
(its `seed`).

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
import traceback
import uuid
from dataclasses import dataclass, field

import torch

import dense
from dense_engine.cli.flags import add_model_flags, check_environment, load_model, make_draft, parse_flags, positive_int
from dense_engine.formats.default_model import default_checkpoint
from dense_engine.formats.vocab import TextStream, Vocabulary, load_vocabulary
from dense_engine.runtime import generate, grammar, speculative, tools, tp
from dense_engine.runtime.session import common_prefix, fitting_cache, steps_for_program
from dense_engine.system.errors import CheckpointError, UsageError, first_line, run_program

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
# Parameters that change results and are not implemented: refused by name (400), never ignored. Parameters this
# server does not know at all are ignored with one log line, as llama-server and vLLM do (front-ends send many).
REFUSED = {"n": lambda v: v not in (None, 1), "functions": bool, "function_call": lambda v: v not in (None, "none"),
           "best_of": lambda v: v not in (None, 1), "suffix": lambda v: v not in (None, ""),
           "prediction": lambda v: v is not None, "audio": lambda v: v is not None,
           "modalities": lambda v: v not in (None, ["text"])}
IGNORED = ("model", "user", "metadata", "store", "service_tier")  # no effect on the text
PREFILL_BUDGET = 64  # prompt tokens prefilled per scheduler turn while other rows decode (measured: BENCHMARKS.md)


class BadRequest(Exception):
    """A request the server refuses: 4xx with OpenAI's error body naming the parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


class Metrics:
    """What /metrics reports, in Prometheus' text format (prometheus_client, a registry of the server's own):
    requests by status, prompt and generated tokens, the queue and the busy rows, time to first token and the time
    between tokens (seconds, histograms)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("dense_requests", "Completion requests answered, by HTTP status", ["status"],
                                registry=self.registry)
        self.prompt_tokens = Counter("dense_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.generated_tokens = Counter("dense_generated_tokens", "Tokens generated", registry=self.registry)
        self.queue = Gauge("dense_queue_depth", "Requests waiting for a row", registry=self.registry)
        self.busy = Gauge("dense_busy_rows", "Cache rows running a request", registry=self.registry)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram("dense_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=buckets, registry=self.registry)
        self.itl = Histogram("dense_inter_token_latency_seconds", "Between a request's consecutive tokens",
                             buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
                             registry=self.registry)

    def watch(self, scheduler: "Scheduler") -> None:
        self.queue.set_function(scheduler.waiting.qsize)
        self.busy.set_function(lambda: sum(r is not None for r in scheduler.rows))

    def token(self, request: "Request") -> None:
        """A request's new token (called by the scheduler)."""
        now = time.perf_counter()
        if request.last_token_at is None:
            self.ttft.observe(now - request.arrived)
        else:
            self.itl.observe(now - request.last_token_at)
        request.last_token_at = now
        self.generated_tokens.inc()

    def text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


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
    arrived: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    logprobs: int | None = None  # the alternatives to report per token (0: only the chosen one); None: no logprobs
    echo: bool = False  # (completions) the prompt's own logprobs too
    index: int = 0  # its choice's index (a completion request may carry several prompts)
    entries: list = field(default_factory=list)  # logprob entries of tokens whose text is not sent yet
    prompt_entries: list = field(default_factory=list)  # (echo) one per prompt token, the first None
    constraint: object = None  # a grammar.Constraint (response_format): the tokens its grammar allows
    logit_bias: dict = field(default_factory=dict)  # token id -> added to its logit
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # ... times how often it was generated
    counts: dict = field(default_factory=dict)  # token id -> times generated (for the penalties)
    filled: int | None = None  # in a row: its prompt tokens in the cache so far, while prefilled; None once decoding

    def bias(self, vocab: int) -> torch.Tensor | None:
        """[V] float32 added to this request's logits before sampling (OpenAI's semantics), or None: none."""
        penalties = self.counts and (self.presence_penalty or self.frequency_penalty)
        if self.constraint is None and not self.logit_bias and not penalties:
            return None
        bias = self.constraint.bias("cpu") if self.constraint is not None else torch.zeros(vocab)
        if self.logit_bias:
            bias[list(self.logit_bias)] += torch.tensor(list(self.logit_bias.values()))
        if penalties:
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            bias[list(self.counts)] -= self.presence_penalty + self.frequency_penalty * counts
        return bias

    def chose(self, token: int, stop_ids) -> None:
        """A token was chosen: the grammar and (for the penalties) the counts move on."""
        if token in stop_ids:
            return
        if self.constraint is not None:
            self.constraint.consume(token)
        if self.presence_penalty or self.frequency_penalty:
            self.counts[token] = self.counts.get(token, 0) + 1

    def send(self, *event) -> None:
        """Events ("text", piece, logprob entries) and ("done", finish_reason, entries), tagged with the index."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, *event))

    def take_entries(self) -> list:
        entries, self.entries = self.entries, []
        return entries


class Scheduler:
    """Owns the model: admits waiting requests into free cache rows (a prefill each), then runs one decode step over
    every row, until stopped. Under tensor parallel, rank 0 runs it and broadcasts each step to the other ranks."""

    def __init__(self, model: dense.DenseDecoder, vocab: Vocabulary, max_batch: int, max_seq_len: int,
                 compile: bool, draft=None, speculate_k: int = 4, metrics: Metrics | None = None,
                 reuse: bool = True, prefill_chunk: int = PREFILL_BUDGET) -> None:
        self.model, self.vocab, self.draft, self.speculate_k = model, vocab, draft, speculate_k
        self.metrics, self.reuse, self.prefill_chunk = metrics, reuse, prefill_chunk
        self.rows: list[Request | None] = [None] * max_batch
        self.row_tokens: list[list[int]] = [[] for _ in range(max_batch)]  # the tokens in each row's slots 0..
        self.admitting: Request | None = None  # (a request decoded speculatively, not in a row)
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
            self.safe_turn()
        tp.broadcast(("stop",)) if tp.world()[1] > 1 else None

    def safe_turn(self) -> None:
        """One turn; an exception in it (a bug, a fault in a model call) fails the requests in flight with an error
        the clients see, is logged with its traceback, and serving goes on with the next requests: a server that
        stopped would leave every client hanging on a connection that never ends."""
        try:
            self.turn()
        except Exception as e:
            traceback.print_exc()
            self.fail(e)

    def turn(self) -> None:
        """Admit waiting requests into free rows, prefill up to the budget, then one decode step of the running rows."""
        self.admit()
        self.prefill()
        busy = [r for r, request in enumerate(self.rows) if request is not None and request.filled is None]
        if busy:
            self.decode(busy)
        elif not any(self.rows):
            try:  # idle: wait for a request
                self.waiting.put(self.waiting.get(timeout=0.1))
            except queue.Empty:
                pass

    def fail(self, e: Exception) -> None:
        message = f"internal error: {type(e).__name__}: {first_line(e)}"
        for request in {id(r): r for r in [*self.rows, self.admitting] if r is not None}.values():
            if request.finish_reason is None:
                request.finish_reason = "error"
                request.send("error", message, [])
        self.rows, self.admitting = [None] * len(self.rows), None
        self.row_tokens = [[] for _ in self.rows]  # (what a failed step left in the cache is not known)

    def admit(self) -> None:
        """Give waiting requests the free rows (their prompts are prefilled by `prefill`). A row keeps the tokens of
        its last request in its cache: a new request takes the free row whose tokens share the longest prefix with
        its prompt, and only the rest is prefilled (a conversation's next turn, a shared system prompt)."""
        while None in self.rows:
            try:
                request = self.waiting.get_nowait()
            except queue.Empty:
                return
            if request.cancelled:
                continue
            if self.draft is not None:
                self.admitting = request
                self.speculate(request)
                self.row_tokens[0], self.admitting = [], None
                continue
            row, common = self.pick_row(request)
            self.rows[row], request.filled = request, common
            self.row_tokens[row] = self.row_tokens[row][:common]

    def prefill(self) -> None:
        """Prefill the admitted prompts, oldest first. While other rows decode, at most `prefill_chunk` tokens a turn:
        a long prompt goes in chunks between their steps (no stream waits for a whole long prefill); with none
        decoding, every prompt whole. Chunks of several prompts go in one pass (the weights are read once)."""
        filling = sorted((r for r, q in enumerate(self.rows) if q is not None and q.filled is not None),
                         key=lambda r: self.rows[r].arrived)
        budget = self.prefill_chunk if self.prefill_chunk and len(filling) < sum(q is not None for q in self.rows) \
            else None
        group = []  # (row, start, end) of this turn's chunks
        for row in filling:
            request = self.rows[row]
            if request.cancelled:  # (the cache keeps what was prefilled)
                self.rows[row] = None
                continue
            if budget is not None and budget <= 0:
                break
            end = len(request.prompt) if budget is None else min(len(request.prompt), request.filled + budget)
            if request.echo:  # every position's logits: alone, whole
                group = group or [(row, request.filled, len(request.prompt))]
                break
            group.append((row, request.filled, end))
            budget = None if budget is None else budget - (end - request.filled)
        if not group:
            return
        if len(group) == 1 or any(end - start <= generate.PREFILL_CHUNK for _, start, end in group):
            for row, start, end in group:  # (a short chunk runs a compiled step, alone)
                request = self.rows[row]
                self.prefilled(row, end, step(self.runner, ("prefill", row, request.prompt[start:end], request.echo,
                                                            start)))
            return
        rows, chunks = [row for row, _, _ in group], [self.rows[r].prompt[s:e] for r, s, e in group]
        starts = [s for _, s, _ in group]
        logits = step(self.runner, ("prefill_rows", rows, chunks, starts))
        for i, (row, _, end) in enumerate(group):
            self.prefilled(row, end, logits[i:i + 1])

    def prefilled(self, row: int, end: int, logits: torch.Tensor) -> None:
        """A chunk of row's prompt is in the cache, up to `end`; logits: the last token's [1, V] (echo: every token's
        [1, T, V]). At the prompt's end, the first token is drawn and the row decodes from the next step."""
        request = self.rows[row]
        request.filled = end
        self.row_tokens[row] = list(request.prompt[:end])
        if request.echo:  # [1, T, V]: position p's logits rate prompt token p + 1
            request.prompt_entries = [None] + [logprob_entry(logits[0, p], request.prompt[p + 1],
                                                             request.logprobs or 0)
                                               for p in range(len(request.prompt) - 1)]
            logits = logits[:, -1]
        if end < len(request.prompt):
            return
        request.filled = None  # (decoding from now on)
        if request.max_tokens == 0:  # (echo alone: the prompt's logprobs, nothing generated)
            request.finish_reason = "length"
            request.send("done", "length", [])
            self.rows[row] = None
            return
        token = int(sample_one(logits, request, self.vocab_limit, request.bias(logits.shape[-1])))
        self.positions[row], self.last[row] = len(request.prompt), token
        self.deliver(row, token, logits[0])

    def pick_row(self, request: Request) -> tuple[int, int]:
        """(the free row to prefill into, how many of the prompt's first tokens its cache already holds)."""
        free = [r for r, current in enumerate(self.rows) if current is None]
        if not self.reuse or request.echo:  # (echo's logprobs need every prompt position computed)
            return free[0], 0

        def common(row: int) -> int:
            return common_prefix(self.row_tokens[row], request.prompt)

        # the longest shared prefix; with none, the row holding least (an idle one keeps another conversation)
        best = max(free, key=lambda r: (common(r), -len(self.row_tokens[r]) if common(r) == 0 else 0, -r))
        return best, common(best)

    def decode(self, busy: list[int]) -> None:
        # A request alone (admitted to row 0, the first free one) decodes in a batch-1 step, at batch 1's speed;
        # otherwise every row steps (two compiled graphs in all, whatever the load).
        rows = [self.rows[r] if r in busy else None for r in range(1 if busy == [0] else len(self.rows))]
        tokens, positions = self.last[:len(rows)], self.positions[:len(rows)]
        for row, request in enumerate(rows):
            if request is None:  # an idle row (or one still prefilling) writes to the scratch slot: nothing reads it
                tokens[row], positions[row] = 0, self.max_seq_len
        V = self.model.config.vocab_size
        biases = [r.bias(V) if r is not None else None for r in rows]
        bias = None  # (a batch with no constrained, biased or penalized row runs the plain step)
        if any(b is not None for b in biases):
            bias = torch.stack([b if b is not None else torch.zeros(V) for b in biases]).to(self.model.device)
        sampling = generate.Sampling(
            tuple(r.temperature if r else 0.0 for r in rows), tuple(r.top_k if r else None for r in rows),
            tuple(r.top_p if r else None for r in rows), self.vocab_limit,
            tuple(r.generator if r else self.idle_generator for r in rows), bias)
        with_logits = any(r is not None and r.logprobs is not None for r in rows)
        out = step(self.runner, ("decode", tokens, positions, sampling, with_logits))
        out, logits = out if with_logits else (out, None)
        out = out[:, 0].tolist()
        for row in busy:
            self.row_tokens[row].append(tokens[row])  # (fed at positions[row]: now in the cache)
            self.positions[row] += 1
            self.last[row] = out[row]
            self.deliver(row, out[row], None if logits is None else logits[row])

    def deliver(self, row: int, token: int, logits: torch.Tensor | None = None) -> None:
        """A row's new token (and the logits it was drawn from, when the request wants logprobs): its text to the
        client (held back while it may start a stop string), and the row freed when the request is done."""
        request = self.rows[row]
        if request.logprobs is not None and logits is not None and token not in self.vocab.stop_ids:
            request.entries.append(logprob_entry(logits, token, request.logprobs))
        request.chose(token, self.vocab.stop_ids)
        reason = finish(self.vocab, request, token)
        if self.metrics is not None:
            self.metrics.token(request)
            if reason or request.cancelled:
                self.metrics.prompt_tokens.inc(len(request.prompt))
        if reason or request.cancelled:
            request.finish_reason = reason or "cancelled"
            request.send("done", request.finish_reason, request.take_entries())
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


def logprob_entry(logits: torch.Tensor, token: int, top: int) -> tuple:
    """(token, its logprob, [(id, logprob)] of the `top` likeliest): the float32 log-softmax of the model's logits
    [V], before temperature or any filter, as OpenAI reports them."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = logprobs.topk(top) if top else None
    alternatives = list(zip(best.indices.tolist(), best.values.tolist())) if top else []
    return token, float(logprobs[token]), alternatives


def sample_one(logits: torch.Tensor, request: Request, vocab_limit: int | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """The first token of a request, from its prefill's logits [1, V] (plus its bias), with its own noise."""
    if bias is not None:
        logits = logits + bias.to(logits.device)
    noise = torch.empty_like(logits).exponential_(1, generator=request.generator)
    return dense.sample(logits, request.temperature, request.top_k, request.top_p, vocab_limit, noise)


def finish(vocab: Vocabulary, request: Request, token: int) -> str | None:
    """Take one generated token; returns the finish reason once the request is done ("stop": an end-of-text token,
    a stop string, or a complete grammar; "length")."""
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
    complete = request.constraint is not None and request.constraint.done  # the grammar takes no more tokens
    if len(request.generated) >= request.max_tokens or complete:
        flush(request, request.pending + request.stream.finish())
        return "length" if len(request.generated) >= request.max_tokens else "stop"
    keep = max((n for stop in request.stop for n in range(1, len(stop)) if request.pending.endswith(stop[:n])),
               default=0)  # the longest tail that could still grow into a stop string
    tail = request.pending[len(request.pending) - keep:] if keep else ""
    flush(request, request.pending[: len(request.pending) - keep])
    request.pending = tail  # (held back, in order, until it completes a stop string or cannot)
    return None


def flush(request: Request, text: str) -> None:
    request.pending = ""
    if text:
        request.send("text", text, request.take_entries())


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


def step_local(runner, action):
    model = runner.model
    if action[0] == "prefill":
        _, row, prompt, every, start = action
        return runner.prefill(torch.tensor([prompt], device=model.device), start, None,
                              rows=torch.tensor([row], device=model.device), every=every)
    if action[0] == "prefill_rows":  # several rows' chunks: one pass
        _, rows, chunks, starts = action
        return runner.prefill_rows(chunks, starts, torch.tensor(rows, device=model.device))
    _, tokens, positions, sampling, with_logits = action
    return runner.decode(torch.tensor(tokens, device=model.device)[:, None], positions, None, sampling, with_logits)


# ----------------------------------------------------------------------------------------------------------------
# Requests: OpenAI's parameters, checked


def message_text(message: dict, i: int):
    """A message's content as one string: text content parts ([{"type": "text", "text": ...}]) joined; any other
    part refused by name. Other shapes are left for the caller's check."""
    content = message.get("content")
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise BadRequest(f"messages[{i}].content[{j}]: only text parts are supported, got type {kind!r}",
                             f"messages[{i}].content[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)  # (as vLLM joins them)


def tool_settings(body: dict, state: "Server") -> dict | None:
    """The request's tools, checked: {tools, names, choice, format, parallel, grammar (None unless a call is
    required)}, or None when there are none or tool_choice is "none"."""
    given, choice = body.get("tools"), body.get("tool_choice")
    if given in (None, []):
        if choice not in (None, "none"):
            raise BadRequest("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(given, list) or not all(
            isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and isinstance(t["function"].get("parameters", {}), dict)
            for t in given):
        raise BadRequest("'tools' must be a list of {type: function, function: {name, description, parameters}}",
                         "tools")
    names = {t["function"]["name"] for t in given}
    choice = "auto" if choice is None else choice
    only = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (choice in ("none", "auto", "required") or only in names):
        raise BadRequest(f"'tool_choice' must be none, auto, required or a function of 'tools' ({', '.join(sorted(names))})",
                         "tool_choice")
    if choice == "none":
        return None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    fmt = tools.reply_format(state.vocab.chat_template)
    forced = None
    if choice == "required" or only:
        try:
            forced = tools.call_grammar(given, only, fmt, parallel and not only)
        except UsageError as e:
            raise BadRequest(str(e), "tool_choice", status=500, kind="server_error") from None
    return {"tools": given, "names": names, "format": fmt, "parallel": parallel, "grammar": forced}


def response_grammar(response_format) -> str | None:
    """The grammar of `response_format`: None for text, any JSON object, or JSON valid against a schema."""
    if response_format in (None, {"type": "text"}):
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    try:
        if kind == "json_object":
            return grammar.json_grammar(None)
        spec = response_format.get("json_schema") if kind == "json_schema" else None
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise BadRequest("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                             "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\"}}",
                             "response_format")
        return grammar.json_grammar(spec.get("schema") or {})
    except ValueError as e:
        raise BadRequest(f"'response_format': the JSON schema cannot be used ({e})", "response_format") from None
    except UsageError as e:
        raise BadRequest(str(e), "response_format", status=500, kind="server_error") from None


def logit_bias(value, size: int) -> dict[int, float]:
    """OpenAI's logit_bias, {"token id": -100..100}, as {id: bias}."""
    if value is None:
        return {}
    out = {}
    if isinstance(value, dict):
        for key, bias in value.items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < size or isinstance(bias, bool) or not isinstance(bias, (int, float)) or \
                    not -100 <= bias <= 100:
                break
            out[token] = float(bias)
        else:
            return out
    raise BadRequest(f"'logit_bias' must map token ids (0..{size - 1}) to numbers in -100..100", "logit_bias")


def generator(state: "Server", seed: int) -> torch.Generator:
    """A request's own noise source (on the model's device), seeded: its sampled text depends on nothing else."""
    g = torch.Generator(state.scheduler.model.device if state.scheduler else "cpu")
    return g.manual_seed(seed % 2**63)


def completion_prompts(prompt, state: "Server") -> list[list[int]]:
    """A completion's prompts as token ids: a string, a list of strings (one choice each), a list of token ids, or
    a list of lists of ids (what evaluation harnesses send)."""
    def ids(value) -> bool:
        return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)

    if isinstance(prompt, str) or ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or ids(p) for p in prompt):
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of lists of "
                         "token ids", "prompt")
    if len(prompt) > 64:
        raise BadRequest(f"'prompt' has {len(prompt)} prompts; at most 64 a request", "prompt")
    size = state.vocab.size
    for p in prompt:
        if not isinstance(p, str) and not all(0 <= i < size for i in p):
            raise BadRequest(f"'prompt' has a token id outside 0..{size - 1}", "prompt")
    return [state.vocab.encode(p, special=True) if isinstance(p, str) else list(p) for p in prompt]


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
    allowed = {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"} if kind == "chat" else {
        "prompt", "echo"}
    allowed |= {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                "stream_options", "logprobs", "response_format", "logit_bias", "presence_penalty",
                "frequency_penalty", *REFUSED, *IGNORED}
    for name, value in body.items():
        if name in REFUSED and REFUSED[name](value):
            raise BadRequest(f"'{name}' is not supported by this server", name)
        if name not in allowed:
            print(f"note: ignoring the unknown parameter '{name}'", file=sys.stderr, flush=True)
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
        messages = [dict(m, content=message_text(m, i)) if isinstance(m, dict) else m for i, m in enumerate(messages)]
        for i, m in enumerate(messages):
            calls = isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")
            if not isinstance(m, dict) or not (isinstance(m.get("content"), str) or calls and m["content"] is None):
                raise BadRequest(f"messages[{i}] must be an object with a string 'content'", f"messages[{i}]")
            if m.get("role") not in CHAT_ROLES:
                raise BadRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.get('role')!r}",
                                 f"messages[{i}].role")
            if calls and not (isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                              and isinstance(c["function"].get("name"), str)
                                                              for c in calls)):
                raise BadRequest(f"messages[{i}].tool_calls must be a list of {{id, type, function: {{name, "
                                 "arguments}}}", f"messages[{i}].tool_calls")
        if not state.vocab.chat_template:
            raise BadRequest("this checkpoint has no chat template: use /v1/completions", "messages")
        keep = ("role", "content", "tool_calls", "tool_call_id", "name")
        messages = [{k: ("system" if k == "role" and v == "developer" else v) for k, v in m.items() if k in keep}
                    for m in messages]
        calling = tool_settings(body, state)
        render_tools = None
        if calling is not None:
            messages, render_tools = tools.template_messages(messages, calling["tools"], state.vocab.chat_template)
        elif any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages = tools.template_messages(messages, [], state.vocab.chat_template)[0]
        try:
            prompts = [state.vocab.encode(state.vocab.render(messages, render_tools), special=False)]
        except UsageError as e:
            raise BadRequest(str(e), "messages") from None
        logprobs = body.get("logprobs")
        if logprobs not in (None, True, False):
            raise BadRequest("'logprobs' must be true or false", "logprobs")
        top = number(body, "top_logprobs", int, None, low=0, high=20)
        if top is not None and not logprobs:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs, echo = (top or 0) if logprobs else None, False
    else:
        prompts = completion_prompts(body.get("prompt"), state)
        logprobs = number(body, "logprobs", int, None, low=0, high=20)
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise BadRequest("'echo' must be true or false", "echo")
    shaping = {"logprobs": logprobs is not None, "echo": echo,
               "response_format": body.get("response_format") not in (None, {"type": "text"}),
               "logit_bias": bool(body.get("logit_bias")), "presence_penalty": bool(body.get("presence_penalty")),
               "frequency_penalty": bool(body.get("frequency_penalty"))}
    if any(shaping.values()) and state.scheduler is not None and state.scheduler.draft is not None:
        name = next(k for k, v in shaping.items() if v)
        raise BadRequest(f"'{name}' is not served with speculative decoding (--draft, --lookup)", name)
    where = "prompt" if kind != "chat" else "messages"
    for prompt in prompts:
        if not prompt:
            raise BadRequest("the prompt is empty", where)
        if len(prompt) >= state.max_seq_len:
            raise BadRequest(f"the prompt has {len(prompt)} tokens; the context holds {state.max_seq_len}", where,
                             code="context_length_exceeded")
    room = state.max_seq_len - max(len(p) for p in prompts)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    # beyond the context left: clamped ("length"); 0 only with echo (an evaluation harness's log-likelihoods)
    max_tokens = min(number(body, name, int, room, low=0 if echo else 1), room)
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
    seed = seed if seed is not None else int(torch.randint(2**62, ()))
    top_p = number(body, "top_p", float, None, low=0, high=1, low_open=True)
    required = kind == "chat" and calling is not None and calling["grammar"] is not None
    if required and body.get("response_format") not in (None, {"type": "text"}):
        raise BadRequest("'response_format' and a required tool call cannot both shape the reply", "response_format")
    return {"prompts": prompts, "max_tokens": max_tokens, "stop": stop, "stream": stream, "logprobs": logprobs,
            "echo": echo, "calling": calling if kind == "chat" else None,
            "grammar": calling["grammar"] if required else response_grammar(body.get("response_format")),
            "logit_bias": logit_bias(body.get("logit_bias"), state.vocab.size),
            "presence_penalty": number(body, "presence_penalty", float, 0.0, low=-2, high=2),
            "frequency_penalty": number(body, "frequency_penalty", float, 0.0, low=-2, high=2),
            "include_usage": options.get("include_usage", False), "seed": seed,
            "temperature": number(body, "temperature", float, 1.0, low=0, high=2),
            "top_p": None if top_p == 1 else top_p, "top_k": number(body, "top_k", int, None, low=1)}


def make_jobs(body: dict, kind: str, state: "Server", loop, events) -> tuple[dict, list[Request]]:
    """(the request's settings, a Request per prompt whose events go to `events` on `loop`), or BadRequest."""
    settings = parse_request(body, kind, state)
    V = state.scheduler.model.config.vocab_size
    return settings, [
        Request(prompt, settings["max_tokens"], settings["temperature"], settings["top_p"], settings["top_k"],
                settings["stop"], generator(state, settings["seed"] + i), loop, events, logprobs=settings["logprobs"],
                echo=settings["echo"], index=i,
                constraint=grammar.Constraint(settings["grammar"], grammar.tokenizer_for(state.vocab, V), V)
                if settings["grammar"] else None, logit_bias=settings["logit_bias"],
                presence_penalty=settings["presence_penalty"], frequency_penalty=settings["frequency_penalty"])
        for i, prompt in enumerate(settings["prompts"])]


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
        self.metrics = Metrics()

    def load(self, console) -> None:
        """Load the model and start the scheduler (a thread of its own; /health answers 503 meanwhile)."""
        args = self.args
        check_environment(args, console)
        ckpt = args.ckpt or default_checkpoint(console)
        self.name = os.path.basename(os.path.normpath(ckpt))
        self.vocab = load_vocabulary(ckpt, args.tokenizer)
        if self.vocab.chat_template:
            from jinja2 import TemplateError

            try:
                self.vocab.template()  # (compiled once, now: not in the first request's time)
            except TemplateError:
                pass  # (a chat request says what is wrong with it; completions still work)
        model, why = load_model(ckpt, args, console)
        print(why, file=sys.stderr, flush=True)
        draft = make_draft(args, model, console)
        batch = 1 if draft is not None else args.max_batch
        self.max_seq_len = fitting_cache(model, batch, args.max_seq_len)
        self.scheduler = Scheduler(model, self.vocab, batch, self.max_seq_len, args.compile, draft, args.speculate_k,
                                   reuse=args.prefix_reuse, prefill_chunk=args.prefill_chunk)
        warm_up(self.scheduler)
        self.scheduler.metrics = self.metrics  # (after the warm-up: its throwaway tokens are not counted)
        self.metrics.watch(self.scheduler)
        self.scheduler.thread.start()
        self.ready.set()


def warm_up(scheduler: Scheduler) -> None:
    """Run the steps a first request needs (prefill and decode, eager or compiled) on a throwaway prompt."""
    def throwaway(prompt: list[int]) -> Request:
        request = Request(prompt, 2, 0.0, None, None, [], scheduler.idle_generator, None, None)
        request.send = lambda *event: None
        return request

    # a long prompt alone (an eager prefill), two together (one pass for both, then the all-rows decode step), a
    # short one alone (the compiled prefill chunk, the batch-1 decode step)
    long = [[token] * (generate.PREFILL_CHUNK + 1) for token in (1, 2, 3)]  # (different: no prefix to reuse)
    for prompts in (long[:1], long[1:1 + min(2, len(scheduler.rows))], [[4]]):
        for prompt in prompts:
            scheduler.submit(throwaway(prompt))
        scheduler.turn()
        while any(scheduler.rows):
            scheduler.turn()
    scheduler.rows = [None] * len(scheduler.rows)
    scheduler.row_tokens = [[] for _ in scheduler.rows]


def error_response(e: BadRequest):
    from starlette.responses import JSONResponse

    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


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
        body = await ready_json(request)
        refuse_if_full(1)  # (before the work of parsing it)
        loop, queue_ = asyncio.get_running_loop(), asyncio.Queue()
        # the template's rendering, the tokenizing and a grammar's compiling run in a worker thread: the event loop
        # keeps streaming the other requests' tokens meanwhile
        settings, jobs = await asyncio.to_thread(make_jobs, body, kind, server, loop, queue_)
        refuse_if_full(len(jobs))
        created, ident = int(time.time()), ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        model_name = body.get("model") if isinstance(body.get("model"), str) else server.name
        for job in jobs:
            server.scheduler.submit(job)
        request.scope.setdefault("state", {})["job"] = jobs[0]
        vocab = server.vocab

        def usage() -> dict:
            prompt, generated = sum(len(j.prompt) for j in jobs), sum(len(j.generated) for j in jobs)
            return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

        def piece(token: int) -> str:
            return vocab.tokenizer.decode([token], skip_special_tokens=False)

        def logprobs(job: Request, entries: list, offset: int) -> dict | None:
            """OpenAI's logprobs object for these entries (chat: content; completions: parallel lists)."""
            if job.logprobs is None:
                return None
            if kind == "chat":
                def one(token, lp):
                    return {"token": piece(token), "logprob": lp, "bytes": list(piece(token).encode())}
                return {"content": [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in alts]}
                                    for t, lp, alts in entries]}
            tokens = [piece(e[0]) if isinstance(e, tuple) else piece(e) for e in entries]
            offsets = [offset + sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
            return {"tokens": tokens, "token_logprobs": [e[1] if isinstance(e, tuple) else None for e in entries],
                    "top_logprobs": [top_by_text(e[2]) if isinstance(e, tuple) else None for e in entries],
                    "text_offset": offsets}

        def top_by_text(alternatives: list) -> dict:
            """{token text: logprob}, best first; two ids of one text keep the better one."""
            top = {}
            for token, lp in alternatives:
                top.setdefault(piece(token), lp)
            return top

        def echoed(job: Request) -> tuple[str, list]:
            """(the prompt's text, its entries: the first token has none, as OpenAI's null)."""
            entries = [job.prompt[0]] + job.prompt_entries[1:] if job.echo and job.prompt_entries else []
            return vocab.decode(job.prompt), entries

        def choice(job: Request, text: str | None, reason: str | None, delta: bool, entries=(), offset=0) -> dict:
            lp = logprobs(job, list(entries), offset)
            if kind == "chat":
                message = {"content": text} if delta else {"role": "assistant", "content": text}
                if delta and text is None:
                    message = {}
                return {"index": job.index, "delta" if delta else "message": message, "finish_reason": reason,
                        "logprobs": lp}
            return {"index": job.index, "text": text or "", "finish_reason": reason, "logprobs": lp}

        calling = settings["calling"]

        def tool_calls(text: str) -> list[dict]:
            """The reply's calls in OpenAI's form (none unless the request offered tools and the reply is calls)."""
            if calling is None:
                return []
            calls = tools.parse_calls(text, calling["format"], calling["names"])
            calls = calls if calling["parallel"] else calls[:1]
            return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                     "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                    for c in calls]

        obj = "chat.completion" if kind == "chat" else "text_completion"
        head = {"id": ident, "created": created, "model": model_name, "system_fingerprint": None}
        if not settings["stream"]:
            texts, entries, open_jobs = [[] for _ in jobs], [[] for _ in jobs], len(jobs)
            gone = asyncio.ensure_future(disconnected(request))
            try:
                while open_jobs:
                    got = asyncio.ensure_future(queue_.get())
                    await asyncio.wait([got, gone], return_when=asyncio.FIRST_COMPLETED)
                    if gone.done():  # the client went away: free its rows at the next step, answer no one
                        got.cancel()
                        for job in jobs:
                            job.cancelled = True
                        return JSONResponse({}, status_code=499)
                    index, what, payload, new = got.result()
                    entries[index] += new
                    if what == "error":
                        raise BadRequest(payload, status=500, kind="server_error")
                    if what == "done":
                        open_jobs -= 1
                    else:
                        texts[index].append(payload)
            finally:
                gone.cancel()
            choices = []
            for job, text, got in zip(jobs, texts, entries):
                prompt_text, prompt_entries = echoed(job) if job.echo else ("", [])
                choices.append(choice(job, prompt_text + "".join(text), job.finish_reason, False,
                                      prompt_entries + got))
                calls = tool_calls("".join(text))
                if calls:
                    choices[-1].update(finish_reason="tool_calls")
                    choices[-1]["message"].update(content=None, tool_calls=calls)
            return JSONResponse({**head, "object": obj, "choices": choices, "usage": usage()})

        async def events():
            chunk = "chat.completion.chunk" if kind == "chat" else "text_completion"
            offsets = [0] * len(jobs)
            try:
                if kind == "chat":  # the role first, as OpenAI's streams start
                    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                             "logprobs": None}
                    yield sse({**head, "object": chunk, "choices": [first]})
                open_jobs, held = len(jobs), []
                while open_jobs:
                    index, what, payload, new = await queue_.get()
                    job = jobs[index]
                    if what == "error":  # the scheduler failed this request: an error event, then the end
                        yield sse(BadRequest(payload, status=500, kind="server_error").body())
                        break
                    if calling is not None:  # a reply that may be calls is held back, then sent as calls or text
                        held.append((payload if what == "text" else "", new))
                        if what != "done":
                            continue
                        open_jobs -= 1
                        text, got = "".join(p for p, _ in held), [e for _, n in held for e in n]
                        calls = tool_calls(text)
                        if not calls:
                            if text or got:
                                yield sse({**head, "object": chunk, "choices": [choice(job, text, None, True, got)]})
                            yield sse({**head, "object": chunk, "choices": [choice(job, None, job.finish_reason,
                                                                                    True)]})
                            continue
                        for i, call in enumerate(calls):  # the name first, then the arguments in pieces, as OpenAI
                            start = {"index": i, "id": call["id"], "type": "function",
                                     "function": {"name": call["function"]["name"], "arguments": ""}}
                            yield sse({**head, "object": chunk, "choices": [
                                {"index": 0, "delta": {"tool_calls": [start]}, "finish_reason": None,
                                 "logprobs": None}]})
                            arguments = call["function"]["arguments"]
                            step = max(1, len(arguments) // 3 + 1)
                            for at in range(0, len(arguments), step):
                                part = {"index": i, "function": {"arguments": arguments[at:at + step]}}
                                yield sse({**head, "object": chunk, "choices": [
                                    {"index": 0, "delta": {"tool_calls": [part]}, "finish_reason": None,
                                     "logprobs": None}]})
                        yield sse({**head, "object": chunk, "choices": [
                            {"index": 0, "delta": {}, "finish_reason": "tool_calls", "logprobs": None}]})
                        continue
                    if job.echo and offsets[index] == 0 and (what == "done" or payload):  # the prompt comes first
                        prompt_text, prompt_entries = echoed(job)
                        yield sse({**head, "object": chunk, "choices": [choice(job, prompt_text, None, True,
                                                                                prompt_entries)]})
                        offsets[index] = len(prompt_text) or -1
                    at = max(offsets[index], 0)
                    if what == "done":
                        open_jobs -= 1
                        yield sse({**head, "object": chunk, "choices": [choice(job, None, job.finish_reason, True,
                                                                                new, at)]})
                        continue
                    yield sse({**head, "object": chunk, "choices": [choice(job, payload, None, True, new, at)]})
                    offsets[index] = at + len(payload)
                if settings["include_usage"]:
                    yield sse({**head, "object": chunk, "choices": [], "usage": usage()})
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or the stream ended): the rows are freed at the next step
                for job in jobs:
                    job.cancelled = job.finish_reason is None

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def tokenize(request):
        """llama-server's shape: {"content": text, "add_special": false, "with_pieces": false} -> {"tokens": [...]}."""
        body = await ready_json(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise BadRequest("'content' must be a string", "content")
        ids = server.vocab.encode(content, special=bool(body.get("add_special", False)))
        if body.get("with_pieces"):
            return JSONResponse({"tokens": [{"id": i, "piece": server.vocab.tokenizer.id_to_token(i)} for i in ids]})
        return JSONResponse({"tokens": ids})

    async def detokenize(request):
        """{"tokens": [ids]} -> {"content": text}."""
        body = await ready_json(request)
        ids = body.get("tokens")
        size = server.vocab.size
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < size
                                                for i in ids):
            raise BadRequest(f"'tokens' must be a list of token ids in 0..{size - 1}", "tokens")
        return JSONResponse({"content": server.vocab.tokenizer.decode(ids, skip_special_tokens=False)})

    async def metrics(request):
        from starlette.responses import Response

        text, media_type = server.metrics.text()
        return Response(text, media_type=media_type)

    def refuse_if_full(incoming: int) -> None:
        waiting = server.scheduler.waiting.qsize()
        if waiting + incoming > server.args.max_queue:
            raise BadRequest(f"the server is busy ({waiting} requests wait for a row); try again shortly",
                             status=503, kind="server_error", code="queue_full")

    async def disconnected(request) -> None:
        """Returns when the client of a non-streamed request goes away (its body is read: the next message of the
        connection is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def ready_json(request) -> dict:
        if not server.ready.is_set():
            raise BadRequest("the model is loading; try again shortly", status=503, kind="server_error")
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the body is not valid JSON ({getattr(e, 'msg', 'not UTF-8')})") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

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

    routes = [Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
              Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/completions", complete,
                                                                             methods=["POST"]),
              Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={BadRequest: bad_request, HTTPException: http_error,
                                                        Exception: crash})
    app = Guard(app, server.args.api_key, server.metrics)
    origins = getattr(server.args, "cors_origin", None)
    if origins:  # outermost: a browser's preflight is answered before the API key is asked for
        from starlette.middleware.cors import CORSMiddleware

        app = CORSMiddleware(app, allow_origins=origins, allow_methods=["GET", "POST", "OPTIONS"],
                             allow_headers=["*"])
    return app


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Guard:
    """ASGI middleware: the API key (when --api-key is set) and one log line per request (method, path, status,
    tokens, time)."""

    def __init__(self, app, api_key: str | None, metrics: Metrics | None = None) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics

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
                if self.metrics is not None and scope["path"] in ("/v1/chat/completions", "/v1/completions"):
                    self.metrics.requests.labels(str(status[0])).inc()

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
    p.add_argument("--prefix-reuse", action=argparse.BooleanOptionalAction, default=True,
                   help="a request prefills only what follows the longest prefix a free row's cache already holds "
                        "(default on)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_BUDGET, metavar="N",
                   help=f"prompt tokens prefilled between two decode steps while other requests stream (default "
                        f"{PREFILL_BUDGET}: a long prompt never stalls them for long); 0: every prompt whole")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests that may wait for a row (default 64); more are answered 503 with Retry-After")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="let pages from ORIGIN call the server from a browser (CORS; repeat it for more, '*' for any)")
    args = parse_flags(p, argv)
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    if args.prefill_chunk < 0:
        raise UsageError(f"--prefill-chunk must be 0 or more, got {args.prefill_chunk}")
    if args.max_queue < 0:
        raise UsageError(f"--max-queue must be 0 or more, got {args.max_queue}")
    if tp.world()[1] > 1 and (args.draft or args.draft_quant or args.lookup):
        raise UsageError("speculative decoding is not served under torchrun (tensor parallel): drop --draft, "
                         "--draft-quant and --lookup")
    return args


def main(argv=None) -> int:
    from rich.console import Console

    argv = sys.argv[1:] if argv is None else argv
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    def work() -> int:
        args = parse_args(argv)
        if tp.world()[1] > 1:
            tp.setup(torch.device(args.device).type)
        if tp.world()[0] != 0:  # tensor parallel: the other ranks follow rank 0's model calls
            return serve_follower(args, console)
        return serve(args, console)

    return run_program(work, argv)


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
            server.error = first_line(e, None)
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
    max_seq_len = fitting_cache(model, args.max_batch, args.max_seq_len)
    scheduler = Scheduler(model, vocab, args.max_batch, max_seq_len, args.compile)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    follow(scheduler.runner)
    tp.exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
