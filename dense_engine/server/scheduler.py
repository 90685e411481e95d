"""The scheduler: one thread owns the model and runs requests in the cache's rows, continuous batching.

A turn, in nano-vllm's shape (LLMEngine.step): schedule (the tasks asked for; schedule() decides, on the records
alone, which waiting requests get which free rows, the prompt chunks prefilled, a speculative round, the rows that
decode; the requests are admitted to their rows), run (runner.ModelRunner makes the plan's model calls: every
tensor-parallel rank makes the same calls by name) and postprocess (each new token delivered: its text to the
client, the row freed when the request ends). A row's cache keeps its last request's tokens; a new request takes
the free row sharing the longest prefix of its prompt, and the prefix cache keeps what a row held (prefixes.py).
Prompts prefill in chunks while other rows decode. With a draft (--draft, --lookup) one request at a time decodes
speculatively in row 0, a round a turn, beside the batch.
Records (records.py): a Request (its Output and Shaping, what it asks of the sampler), a Row per cache row, an Event
per thing a client is told; here, a Plan per turn."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import traceback
from collections.abc import Callable, Iterable

import torch

import dense
from dense_engine.formats.load import LoadRecord
from dense_engine.formats.vocab import StopText, TextStream, Vocabulary
from dense_engine.runtime import caches, generate
from dense_engine.runtime.sampling import SamplerSettings
from dense_engine.runtime.session import common_prefix, steps_for_program
from dense_engine.server.prefix_store import BLOCK
from dense_engine.server.prefixes import PrefixCache, token_bytes  # noqa: F401 (token_bytes: imported from here too)
from dense_engine.server.records import Plan, Request, Row, Status
from dense_engine.server.runner import Decoded, Drafted, ModelCalls, ModelRunner, Prefilled
from dense_engine.system.errors import first_line

PREFILL_BUDGET = 64  # prompt tokens prefilled per scheduler turn while other rows decode (measured: BENCHMARKS.md)
# A free row is taken for a prompt that shares at least this share of what the row's cache holds (what is kept, and
# not prefilled again, outweighs what is overwritten); below it, an empty row: a chat template's first tokens, which
# every conversation shares, are no reason to overwrite another conversation
REUSE_SHARE = 0.5


def schedule(rows: list[Row], waiting: list[Request], *, drafting: bool = False, speculating: bool = False,
             reuse: bool = True, prefill_chunk: int = PREFILL_BUDGET,
             stored: Callable[[Request], int] = lambda request: 0, whole_rows: bool = False,
             snapshots: Callable[[Request], list[int]] = lambda request: []) -> Plan:
    """This turn's Plan, from the rows and the line of waiting requests (changes neither). With a draft, a request
    the sampler alone decides takes row 0 to speculate, when no other request does. stored(request): how many of its
    prompt's first tokens the prefix store holds (PrefixCache.stored). whole_rows: a row's cache is reused only whole
    (a state layer holds where it ends: a prompt that goes on from all of it, or none); snapshots(request): where a
    state model's prefill stops to keep its state (PrefixCache.snapshots)."""
    plan, taken = Plan(), set()
    for request in waiting:
        free = [r for r, row in enumerate(rows) if row.request is None and r not in taken]
        if not free:
            break
        plan.taken += 1
        if request.cancelled:
            continue
        if drafting and not speculating and plan.speculate is None and 0 in free and not request.shaped \
                and request.sampler.plain:
            plan.speculate, plan.round = request, True
            taken.add(0)
            continue
        row, common = pick_row(rows, free, request, reuse, whole_rows)
        taken.add(row)
        plan.admit.append((row, request, common))
    plan.round = plan.round or speculating
    starts = {row: max(common, stored(request)) for row, request, common in plan.admit}
    filling = [(r, row.request, len(row.tokens)) for r, row in enumerate(rows)
               if row.request is not None and row.request.status is Status.PREFILLING and not row.request.waits]
    filling += [(row, request, starts[row]) for row, request, _ in plan.admit if not request.waits]
    running = sum(row.request is not None for row in rows) + len(taken)  # (a speculating row 0 among them)
    prompts = {row: request.prompt for row, request, _ in filling}
    plan.freed, plan.prefill = prefill_group(sorted(filling, key=lambda f: f[1].timing.arrived), running,
                                             prefill_chunk, snapshots)
    done = {row for row, _, end in plan.prefill if end == len(prompts[row])}  # (their first token comes first)
    plan.decode = sorted({r for r, row in enumerate(rows) if row.request is not None
                          and row.request.status is Status.DECODING} | done)
    return plan


def pick_row(rows: list[Row], free: list[int], request: Request, reuse: bool,
             whole_rows: bool = False) -> tuple[int, int]:
    """(the free row to prefill into, how many of the prompt's first tokens its cache already holds): the row sharing
    the longest prefix when that is at least REUSE_SHARE of what it holds (a conversation's next turn); else an empty
    row; else the least recently used one (its conversation the least likely to come back). whole_rows: a shared
    prefix counts only when it is all the row holds."""
    if not reuse or request.echo:  # (echo's logprobs need every prompt position computed)
        return free[0], 0
    shared = {r: common_prefix(rows[r].tokens, request.prompt, whole_rows) if rows[r].adapters == request.adapters
              else 0 for r in free}  # (keys and values computed with other adapters are other numbers)
    best = max(free, key=lambda r: (shared[r], -r))
    if shared[best] and shared[best] >= REUSE_SHARE * len(rows[best].tokens):
        return best, shared[best]
    empty = [r for r in free if not rows[r].tokens]
    row = empty[0] if empty else min(free, key=lambda r: rows[r].used)
    return row, shared[row]


def prefill_group(filling: list[tuple[int, Request, int]], running: int, chunk: int,
                  snapshots: Callable[[Request], list[int]] = lambda request: []
                  ) -> tuple[list[int], list[tuple[int, int, int]]]:
    """(rows freed, chunks (row, start, end)) of the prefilling requests, oldest first: (row, request, prompt tokens
    in its cache) each. While other rows decode, at most `chunk` tokens a turn (no stream waits for a whole long
    prefill); with none decoding, every prompt whole. A cancelled request's row is freed (its cache keeps what was
    prefilled); an echo (every position's logits) prefills alone, whole. A chunk ends at the first of
    snapshots(request) past its start."""
    budget = chunk if chunk and len(filling) < running else None
    freed, group = [], []
    for row, request, filled in filling:
        if request.cancelled:
            freed.append(row)
            continue
        if budget is not None and budget <= 0:
            break
        if request.echo:
            return freed, group or [(row, filled, len(request.prompt))]
        end = len(request.prompt) if budget is None else min(len(request.prompt), filled + budget)
        end = min([end] + [p for p in snapshots(request) if p > filled])
        group.append((row, filled, end))
        budget = None if budget is None else budget - (end - filled)
    return freed, group

class Scheduler:
    """Owns the cache's rows: each turn schedules (the tasks asked for, schedule()'s Plan, its requests admitted),
    runs the plan (its runner: the model calls, the step launched ahead, the speculation in row 0) and postprocesses
    the outputs (each new token delivered), until stopped; its prefix cache keeps what rows held (the store, its
    disk). Under tensor parallel, rank 0 runs it and the other ranks make the same model calls."""

    def __init__(self, model: dense.DenseDecoder, vocab: Vocabulary, max_batch: int, max_seq_len: int,
                 compile: bool, draft=None, speculate_k: int = 4, metrics=None, reuse: bool = True,
                 prefill_chunk: int = PREFILL_BUDGET, prefix_cache_mb: int | None = None,
                 prefix_disk_mb: int | None = 0, prefix_block: int = BLOCK, load: LoadRecord | None = None) -> None:
        self.model, self.vocab, self.reuse, self.prefill_chunk = model, vocab, reuse, prefill_chunk
        self.rows = [Row() for _ in range(max_batch)]
        self.admitted = 0  # requests given a row so far (Row.used)
        self.waiting: queue.Queue[Request] = queue.Queue()
        self.tasks: queue.Queue = queue.Queue()  # (function, Future): run on this thread between turns (slots.py)
        self.stopping = threading.Event()
        load = load or LoadRecord()  # (the kind of cache, and how the background compiler loads the model again)
        caches.setup_cache(model, max_batch, max_seq_len, load.kv_dtype)
        self.max_seq_len = max_seq_len
        steps = steps_for_program(model, max_batch, max_seq_len, load) if compile else None
        vocab_limit = vocab.size if vocab.size < model.config.vocab_size else None
        self.runner = ModelRunner(model, steps, max_seq_len, vocab_limit, draft, speculate_k)
        self.key: str | None = None  # (model_key)
        self.whole_rows = caches.has_state(model)  # (a row's state is where it ends: the row reused whole or not)
        self.prefixes = PrefixCache(model, self.runner.calls, reuse, prefix_cache_mb, prefix_disk_mb, prefix_block,
                                    self.model_key)
        self.metrics = metrics
        self.thread = threading.Thread(target=self.run, name="scheduler", daemon=True)

    def model_key(self) -> str:
        """caches.model_key of the model and its cache, made once (the disk tier's folder, slot files)."""
        if self.key is None:
            self.key = caches.model_key(self.model)
        return self.key

    @property
    def requests(self) -> list[Request | None]:
        """The request in each cache row (None: free)."""
        return [row.request for row in self.rows]

    def submit(self, request: Request) -> None:
        self.waiting.put(request)

    def forget(self) -> None:
        """Drop what the rows' caches and the prefix store hold (after a warm-up: no later prompt reuses its
        throwaway tokens)."""
        for row in self.rows:
            row.tokens = []
        self.prefixes.clear()

    def warm_up(self) -> None:
        """Run the steps a first request needs (prefill and decode, eager or compiled) on throwaway prompts,
        submitted as any request is: a long prompt alone (an eager prefill), two together (one pass for both, then
        the all-rows decode step), a short one alone (the compiled prefill chunk, the batch-1 decode step)."""
        long = [[token] * (generate.PREFILL_CHUNK + 1) for token in (1, 2, 3)]  # (different: no prefix to reuse)
        for prompts in (long[:1], long[1:1 + min(2, len(self.rows))], [[4]]):
            for prompt in prompts:
                self.submit(Request(prompt, 2, SamplerSettings(), [], self.runner.idle_generator, lambda event: None))
            self.turn()
            while any(self.requests):  # (a speculating request holds row 0)
                self.turn()
        self.forget()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.safe_turn()
        self.calls.stop()

    def safe_turn(self) -> None:
        """One turn; an exception in it (a bug, a fault in a model call) fails the requests in flight with an error
        the clients see, is logged with its traceback, and serving goes on with the next requests: a server that
        stopped would leave every client hanging on a connection that never ends."""
        try:
            self.turn()
        except Exception as e:  # noqa: BLE001 (every request in flight is told; the server goes on)
            traceback.print_exc()
            self.fail(e)

    def call_soon(self, function: Callable[[], object]) -> concurrent.futures.Future:
        """Run function() on the scheduler's thread before its next turn (it owns the model and the rows): a
        Future of its result."""
        done = concurrent.futures.Future()
        self.tasks.put((function, done))
        return done

    def turn(self) -> None:
        """schedule -> run -> postprocess. run() yields each model call's output and makes the next call once
        postprocess has delivered it (a row whose prompt ends this turn decodes in its step with its first token)."""
        plan = self.schedule()
        outputs = self.runner.run(plan, self.rows)
        self.postprocess(outputs)

    def fail(self, e: Exception) -> None:
        message = f"internal error: {type(e).__name__}: {first_line(e)}"
        for request in self.requests:
            if request is not None and request.finish_reason is None:
                request.finish_reason, request.status = "error", Status.FINISHED
                request.output.send("error", message, [])
        self.rows = [Row() for _ in self.rows]  # (what a failed step left in the cache is not known)
        self.runner.reset()

    # ---- schedule: what runs this turn, its requests in their rows

    def schedule(self) -> Plan:
        """Wait while there is nothing to do; run the tasks asked for; copy first choices' prefills into later
        choices' rows; then this turn's Plan (schedule()), its requests admitted and its freed rows freed. A step
        launched ahead is delivered first unless the plan is that step's rows decoding again, nothing else."""
        if not any(self.requests) and self.tasks.empty() and self.waiting.empty():
            try:  # idle: wait for a request
                self.waiting.put(self.waiting.get(timeout=0.1))
            except queue.Empty:
                pass
        if self.runner.ahead is not None and not self.tasks.empty():
            self.postprocess([self.runner.read_ahead(self.rows)])
        while not self.tasks.empty():
            function, done = self.tasks.get_nowait()
            try:
                done.set_result(function())
            except Exception as e:  # noqa: BLE001 (the asker is told)
                done.set_exception(e)
        self.prefixes.share_prefills(self.rows)
        with self.waiting.mutex:  # (the line as it is now: only this thread takes from it)
            line = list(self.waiting.queue)
        plan = self.plan(line)
        if self.runner.ahead is not None and not self.runner.keeps_pace(plan, self.rows):
            self.postprocess([self.runner.read_ahead(self.rows)])  # (rows freed, requests ended: planned again)
            plan = self.plan(line)
        self.admit(plan)
        for row in plan.freed:
            self.rows[row].request = None
        return plan

    def plan(self, line: list[Request]) -> Plan:
        prefixes = self.prefixes
        return schedule(self.rows, line, drafting=self.runner.draft is not None,
                        speculating=self.runner.speculation is not None, reuse=self.reuse,
                        prefill_chunk=self.prefill_chunk, stored=prefixes.stored, whole_rows=self.whole_rows,
                        snapshots=prefixes.snapshots)

    def admit(self, plan: Plan) -> None:
        """The plan's requests off the line into their rows: what a row held goes to the prefix store first, and a
        longer prefix from the store (or its disk) is copied in."""
        for _ in range(plan.taken):
            self.waiting.get_nowait()
        if plan.speculate is not None:  # (row 0's cache from slot 0)
            self.prefixes.keep(0, self.rows[0], 0)
            self.rows[0].request, self.rows[0].tokens, plan.speculate.status = plan.speculate, [], Status.SPECULATING
            self.runner.start_speculation(plan.speculate)
        for row, request, common in plan.admit:
            cache_row = self.rows[row]
            self.prefixes.keep(row, cache_row, common)
            stored = self.prefixes.restore(row, request, common)
            self.admitted += 1
            cache_row.request, cache_row.used, cache_row.adapters = request, self.admitted, request.adapters
            request.row = row
            cache_row.tokens = request.prompt[:stored] if stored > common else cache_row.tokens[:common]
            self.prefixes.persist(row, cache_row)
            if self.metrics is not None and max(common, stored):
                self.metrics.prefix_hits.inc()
                self.metrics.reused_tokens.inc(max(common, stored))
                self.metrics.stored_tokens.inc(max(0, stored - common))
            request.status = Status.PREFILLING

    # ---- postprocess: the new tokens delivered

    def postprocess(self, outputs: Iterable[Prefilled | Drafted | Decoded]) -> None:
        """Each model call's output, as it comes: a prompt chunk (its row's state kept at a snapshot point), a
        speculative round, a decode step."""
        for output in outputs:
            if isinstance(output, Prefilled):
                self.postprocess_prefill(output)
                self.prefixes.keep_state(output.row, output.request, output.end)
            elif isinstance(output, Drafted):
                self.postprocess_round(output)
            else:
                self.postprocess_step(output)

    def postprocess_prefill(self, out: Prefilled) -> None:
        """A chunk of a row's prompt is in its cache. At the prompt's end, its first token is delivered and the row
        decodes from the next step."""
        cache_row, request, logits = self.rows[out.row], out.request, out.logits
        cache_row.tokens = list(request.prompt[:out.end])
        if request.echo:  # [1, T, V]: position p's logits rate prompt token p + 1
            request.prompt_entries = [None] + [logprob_entry(logits[0, p], request.prompt[p + 1],
                                                             request.logprobs or 0)
                                               for p in range(len(request.prompt) - 1)]
            logits = logits[:, -1]
        if out.end < len(request.prompt):
            return
        request.status = Status.DECODING
        if request.max_tokens == 0:  # (echo alone: the prompt's logprobs, nothing generated)
            request.end("length", [])
            cache_row.request = None
            return
        cache_row.position, cache_row.last = len(request.prompt), out.token
        self.deliver(out.row, out.token, logits[0])

    def postprocess_round(self, out: Drafted) -> None:
        """A speculative round's tokens, delivered one by one; row 0 is free again when the request ends."""
        request = out.request
        for token in out.tokens or []:
            self.deliver(0, token)
            if request.status is Status.FINISHED:
                break
        if out.tokens is None and request.status is not Status.FINISHED:  # (cancelled, or no more tokens)
            request.end("cancelled" if request.cancelled else "length")
        if request.status is Status.FINISHED:
            self.rows[0] = Row()

    def postprocess_step(self, out: Decoded) -> None:
        """A decode step's tokens: each row's fed token is now in its cache, its new one delivered."""
        for i, row in enumerate(out.rows):
            cache_row = self.rows[row]
            cache_row.tokens.append(out.fed[i])
            cache_row.position, cache_row.last = cache_row.position + 1, out.out[i]
            self.deliver(row, out.out[i], None if out.logits is None else out.logits[i])

    def deliver(self, row: int, token: int, logits: torch.Tensor | None = None) -> None:
        """A row's new token (and the logits it was drawn from, when the request wants logprobs): its text to the
        client (held back while it may start a stop string), and the row freed when the request is done."""
        request = self.rows[row].request
        if request.logprobs is not None and logits is not None and token not in self.vocab.stop_ids:
            request.output.entries.append(logprob_entry(logits, token, request.logprobs))
        request.shaping.chose(request.sampler, token, self.vocab.stop_ids)
        reason = finish(self.vocab, request, token)
        if self.metrics is not None:
            self.metrics.token(request)
            if reason or request.cancelled:
                self.metrics.prompt_tokens.inc(len(request.prompt))
        if reason or request.cancelled:
            request.end(reason or "cancelled")
            self.rows[row].request = None

    # ---- what callers (serve.py, slots.py, the tests) read or set here, held by the scheduler's parts

    @property
    def calls(self) -> ModelCalls:
        return self.runner.calls

    @property
    def draft(self):
        return self.runner.draft

    @property
    def speculation(self):
        return self.runner.speculation

    @property
    def one_step_behind(self) -> bool:
        return self.runner.one_step_behind

    @one_step_behind.setter
    def one_step_behind(self, behind: bool) -> None:
        self.runner.one_step_behind = behind

    @property
    def store(self):
        return self.prefixes.store

    @store.setter
    def store(self, store) -> None:
        self.prefixes.store = store

    @property
    def disk(self):
        return self.prefixes.disk

    @property
    def metrics(self):
        return self.prefixes.metrics

    @metrics.setter
    def metrics(self, metrics) -> None:  # (serve.py sets it after the warm-up: its throwaway tokens not counted)
        self.prefixes.metrics = metrics


def logprob_entry(logits: torch.Tensor, token: int, top: int) -> tuple:
    """(token, its logprob, [(id, logprob)] of the `top` likeliest): the float32 log-softmax of the model's logits
    [V], before temperature or any filter, as OpenAI reports them."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = logprobs.topk(top) if top else None
    alternatives = list(zip(best.indices.tolist(), best.values.tolist())) if top else []
    return token, float(logprobs[token]), alternatives


def finish(vocab: Vocabulary, request: Request, token: int) -> str | None:
    """Take one generated token and send its text (what a stop string cannot still claim); returns the finish
    reason once the request is done ("stop": an end-of-text token, a stop string, or a complete grammar; "length")."""
    if request.output.text is None:
        request.output.text, request.output.held = TextStream(vocab), StopText(request.output.stop)
    out = request.output
    if token in vocab.stop_ids:
        out.send_text(out.held.flush())
        return "stop"
    request.generated.append(token)
    shown = out.held.push(out.text.push(token))
    if out.held.stopped:  # a stop string ends the text before it
        out.send_text(shown)
        return "stop"
    complete = request.constraint is not None and request.constraint.done  # the grammar takes no more tokens
    if len(request.generated) >= request.max_tokens or complete:
        out.send_text(shown + out.held.flush() + out.text.finish())
        return "length" if len(request.generated) >= request.max_tokens else "stop"
    out.send_text(shown)
    return None