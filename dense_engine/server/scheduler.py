"""The scheduler: one thread owns the model and runs requests in the cache's rows, continuous batching.

Read it top to bottom as a turn goes: admit (a waiting request gets the free row whose cache holds the longest
prefix of its prompt; what the row held goes to the prefix store, and a longer prefix comes back from it) -> prefill
(the admitted prompts, in chunks while other rows decode) -> decode (one step of every decoding row, each at its own
position) -> deliver (a token's text to its client, the row freed when it ends). With a draft (--draft, --lookup)
one request at a time decodes speculatively in row 0, a round a turn, beside the batch.
Records: a Request with a Status, a Row per cache row, an Event per thing a client is told. Model calls go through
runner.ModelCalls by name (every tensor-parallel rank makes the same ones)."""

from __future__ import annotations

import concurrent.futures
import enum
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

import dense
from dense_engine.formats.vocab import StopText, TextStream, Vocabulary
from dense_engine.formats.load import LoadRecord
from dense_engine.runtime import caches, generate, speculative, tp
from dense_engine.runtime.session import common_prefix, steps_for_program
from dense_engine.server.prefix_store import BLOCK, DiskStore, PrefixStore, default_capacity_mb, default_disk_mb
from dense_engine.server.runner import ModelCalls
from dense_engine.system import machine
from dense_engine.system.errors import first_line

PREFILL_BUDGET = 64  # prompt tokens prefilled per scheduler turn while other rows decode (measured: BENCHMARKS.md)
# A free row is taken for a prompt that shares at least this share of what the row's cache holds (what is kept, and
# not prefilled again, outweighs what is overwritten); below it, an empty row: a chat template's first tokens, which
# every conversation shares, are no reason to overwrite another conversation
REUSE_SHARE = 0.5


class Event(NamedTuple):
    """What a request's client is told: ("text", piece, logprob entries), ("done", finish reason, entries) or
    ("error", message, []), with the index of the request's choice."""
    index: int
    kind: str
    text: str
    entries: list


class Status(enum.Enum):
    WAITING = "waiting"  # in line for a row
    PREFILLING = "prefilling"  # in a row, its prompt going into the cache
    DECODING = "decoding"  # in a row, a token a step
    SPECULATING = "speculating"  # in row 0, a draft's tokens checked a round a turn
    FINISHED = "finished"


@dataclass
class Request:
    """One completion: its prompt ids, its settings, and `sink`, which takes the Events its client is told (the HTTP
    side puts them on an asyncio queue of its loop)."""
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    stop: list[str]
    generator: torch.Generator  # its own noise: its sampled text depends on nothing else
    sink: Callable[[Event], None]
    status: Status = Status.WAITING
    cancelled: bool = False  # the client went away: free the row
    generated: list[int] = field(default_factory=list)
    text: TextStream | None = None  # the generated text, decoded as it grows
    held: StopText | None = None  # ... cut at a stop string, a tail that may start one held back
    finish_reason: str | None = None
    arrived: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    first_token_at: float | None = None
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
    filled: int = 0  # its prompt tokens in its row's cache so far
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float = 1.0  # of the tokens among the last repeat_last_n (-1: all) of prompt and reply
    repeat_last_n: int = 64
    dry: object = None  # a dry.Dry: what would repeat the context is penalized (in the bias)

    @property
    def shaped(self) -> bool:
        """Whether something but the sampler picks its tokens (logprobs, echo, a grammar, a bias or penalties)."""
        return (self.logprobs is not None or self.echo or self.constraint is not None or bool(self.logit_bias)
                or bool(self.presence_penalty or self.frequency_penalty) or self.penalized or self.dry is not None)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 and self.repeat_last_n != 0

    def penalty(self, vocab: int) -> torch.Tensor | None:
        """[V] float32 repetition penalties (generate.shape_logits' rule), or None: none."""
        if not self.penalized:
            return None
        seen = self.prompt + self.generated
        seen = seen if self.repeat_last_n < 0 else seen[-self.repeat_last_n:]
        out = torch.ones(vocab)
        out[seen] = self.repetition_penalty
        return out

    def bias(self, vocab: int) -> torch.Tensor | None:
        """[V] float32 added to this request's logits before sampling (OpenAI's semantics), or None: none."""
        penalties = self.counts and (self.presence_penalty or self.frequency_penalty)
        if self.constraint is None and not self.logit_bias and not penalties and self.dry is None:
            return None
        bias = self.constraint.bias("cpu") if self.constraint is not None else torch.zeros(vocab)
        if self.logit_bias:
            bias[list(self.logit_bias)] += torch.tensor(list(self.logit_bias.values()))
        if penalties:
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            bias[list(self.counts)] -= self.presence_penalty + self.frequency_penalty * counts
        if self.dry is not None:
            bias -= self.dry.penalty(self.prompt + self.generated, vocab)
        return bias

    def chose(self, token: int, stop_ids) -> None:
        """A token was chosen: the grammar and (for the penalties) the counts move on."""
        if token in stop_ids:
            return
        if self.constraint is not None:
            self.constraint.consume(token)
        if self.presence_penalty or self.frequency_penalty:
            self.counts[token] = self.counts.get(token, 0) + 1

    def send(self, kind: str, text: str, entries: list) -> None:
        self.sink(Event(self.index, kind, text, entries))

    def end(self, reason: str, entries: list | None = None) -> None:
        self.finish_reason, self.status = reason, Status.FINISHED
        self.send("done", reason, self.take_entries() if entries is None else entries)

    def take_entries(self) -> list:
        entries, self.entries = self.entries, []
        return entries


@dataclass
class Row:
    """One row of the cache: the request it runs (None: free), the tokens its cache holds at slots 0.., the slot its
    next token goes to and the token it feeds next."""
    request: Request | None = None
    tokens: list[int] = field(default_factory=list)
    position: int = 0
    last: int = 0
    used: int = 0  # when a request last took it (the scheduler's count of admissions): least recently used first


class Scheduler:
    """Owns the model: admits waiting requests into free cache rows (a prefill each), then runs one decode step over
    every row, until stopped. Under tensor parallel, rank 0 runs it and the other ranks make the same model calls."""

    def __init__(self, model: dense.DenseDecoder, vocab: Vocabulary, max_batch: int, max_seq_len: int,
                 compile: bool, draft=None, speculate_k: int = 4, metrics=None, reuse: bool = True,
                 prefill_chunk: int = PREFILL_BUDGET, prefix_cache_mb: int | None = None,
                 prefix_disk_mb: int | None = 0, prefix_block: int = BLOCK, load: LoadRecord | None = None) -> None:
        self.model, self.vocab, self.draft, self.speculate_k = model, vocab, draft, speculate_k
        self.metrics, self.reuse, self.prefill_chunk = metrics, reuse, prefill_chunk
        self.slots = [Row() for _ in range(max_batch)]
        self.speculation = None  # (the token generator of the request speculating in row 0)
        self.admitted = 0  # requests given a row so far (Row.used)
        self.waiting: queue.Queue[Request] = queue.Queue()
        self.tasks: queue.Queue = queue.Queue()  # (function, Future): run on this thread between turns (slots.py)
        self.vocab_limit = vocab.size if vocab.size < model.config.vocab_size else None
        self.stopping = threading.Event()
        self.idle_generator = torch.Generator(model.device)  # (an idle row's noise, never used)
        load = load or LoadRecord()  # (the kind of cache, and how the background compiler loads the model again)
        caches.setup_cache(model, max_batch, max_seq_len, load.kv_dtype)
        self.max_seq_len = max_seq_len
        steps = steps_for_program(model, max_batch, max_seq_len, load) if compile else None
        self.calls = ModelCalls(generate.Runner(model, steps))
        self.key: str | None = None  # (model_key)
        if prefix_cache_mb is None:
            prefix_cache_mb = default_capacity_mb()
        self.store = PrefixStore(prefix_cache_mb << 20, token_bytes(model), prefix_block) \
            if reuse and prefix_cache_mb else None
        self.disk = None  # the store's disk tier: prefixes used more than once, kept across restarts
        if self.store is not None and prefix_disk_mb != 0 and tp.world()[1] == 1 and machine.unwritable_cache() is None:
            self.disk = DiskStore(os.path.join(machine.cache_dir(), "prefixes"), (prefix_disk_mb or default_disk_mb())
                                  << 20, lambda: f"{self.model_key()}-{prefix_block}")
            self.calls.disk = self.disk
        self.thread = threading.Thread(target=self.run, name="scheduler", daemon=True)

    def model_key(self) -> str:
        """caches.model_key of the model and its cache, made once (the disk tier's folder, slot files)."""
        if self.key is None:
            self.key = caches.model_key(self.model)
        return self.key

    @property
    def rows(self) -> list[Request | None]:
        """The request in each cache row (None: free)."""
        return [row.request for row in self.slots]

    def submit(self, request: Request) -> None:
        self.waiting.put(request)

    def forget(self) -> None:
        """Drop what the rows' caches and the prefix store hold (after a warm-up: no later prompt reuses its
        throwaway tokens)."""
        for row in self.slots:
            row.tokens = []
        if self.store is not None:
            self.calls.call("keep", row=0, blocks=[], size=self.store.block, drop=self.store.clear())

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
        except Exception as e:
            traceback.print_exc()
            self.fail(e)

    def call_soon(self, function: Callable[[], object]) -> concurrent.futures.Future:
        """Run function() on the scheduler's thread before its next turn (it owns the model and the rows): a
        Future of its result."""
        done = concurrent.futures.Future()
        self.tasks.put((function, done))
        return done

    def turn(self) -> None:
        """Run the tasks asked for, admit waiting requests into free rows, prefill up to the budget, a speculative
        round, then one decode step of the decoding rows."""
        while not self.tasks.empty():
            function, done = self.tasks.get_nowait()
            try:
                done.set_result(function())
            except Exception as e:  # (the asker is told)
                done.set_exception(e)
        self.admit()
        self.prefill()
        if self.speculation is not None:
            self.speculate()
        busy = [r for r, row in enumerate(self.slots) if row.request and row.request.status is Status.DECODING]
        if busy:
            self.decode(busy)
        elif not any(self.rows) and self.tasks.empty():
            try:  # idle: wait for a request
                self.waiting.put(self.waiting.get(timeout=0.1))
            except queue.Empty:
                pass

    def fail(self, e: Exception) -> None:
        message = f"internal error: {type(e).__name__}: {first_line(e)}"
        for request in self.rows:
            if request is not None and request.finish_reason is None:
                request.finish_reason, request.status = "error", Status.FINISHED
                request.send("error", message, [])
        self.slots = [Row() for _ in self.slots]  # (what a failed step left in the cache is not known)
        self.speculation = None

    # ---- admit -> prefill -> decode -> deliver

    def admit(self) -> None:
        """Give waiting requests the free rows (their prompts are prefilled by `prefill`). A row keeps the tokens of
        its last request in its cache: a new request takes the free row whose tokens share the longest prefix with
        its prompt, and only the rest is prefilled (a conversation's next turn, a shared system prompt). What the
        row held is kept in the prefix store first, and a longer prefix from the store (or its disk) is copied in.
        With a draft, a request the sampler alone decides takes row 0 to speculate, when no other request does."""
        while None in self.rows:
            try:
                request = self.waiting.get_nowait()
            except queue.Empty:
                return
            if request.cancelled:
                continue
            if self.draft is not None and self.speculation is None and self.slots[0].request is None \
                    and not request.shaped and request.min_p is None and request.typical_p is None:
                self.start_speculation(request)
                continue
            row, common = self.pick_row(request)
            slot = self.slots[row]
            self.keep(row, common)
            stored = self.restore(row, request, common)
            self.admitted += 1
            slot.request, slot.used = request, self.admitted
            slot.tokens = request.prompt[:stored] if stored > common else slot.tokens[:common]
            self.persist(row)
            if self.metrics is not None and max(common, stored):
                self.metrics.prefix_hits.inc()
                self.metrics.reused_tokens.inc(max(common, stored))
                self.metrics.stored_tokens.inc(max(0, stored - common))
            request.status, request.filled = Status.PREFILLING, max(common, stored)

    def pick_row(self, request: Request) -> tuple[int, int]:
        """(the free row to prefill into, how many of the prompt's first tokens its cache already holds): the row
        sharing the longest prefix when that is at least REUSE_SHARE of what it holds (a conversation's next turn);
        else an empty row; else the least recently used one (its conversation the least likely to come back)."""
        free = [r for r, row in enumerate(self.slots) if row.request is None]
        if not self.reuse or request.echo:  # (echo's logprobs need every prompt position computed)
            return free[0], 0
        shared = {r: common_prefix(self.slots[r].tokens, request.prompt) for r in free}
        best = max(free, key=lambda r: (shared[r], -r))
        if shared[best] and shared[best] >= REUSE_SHARE * len(self.slots[best].tokens):
            return best, shared[best]
        empty = [r for r in free if not self.slots[r].tokens]
        row = empty[0] if empty else min(free, key=lambda r: self.slots[r].used)
        return row, shared[row]

    def keep(self, row: int, common: int) -> None:
        """Before row's cache is overwritten past its first `common` tokens: its whole blocks into the prefix
        store (those not there yet; the least recently used go to make room)."""
        tokens = self.slots[row].tokens
        if self.store is None or len(tokens) <= common or len(tokens) < self.store.block:
            return
        self.keep_blocks(row, tokens)

    def keep_blocks(self, row: int, tokens: list[int]) -> None:
        """The whole blocks of `tokens` (row's first ones) into the store, those not there yet."""
        blocks, evicted = self.store.add(tokens)
        if blocks or evicted:
            self.calls.call("keep", row=row, blocks=blocks, size=self.store.block, drop=evicted)
        if self.metrics is not None:
            self.metrics.evictions.inc(len(evicted))

    def persist(self, row: int) -> None:
        """A prefix used again (what the new request found in its row or the store): its whole blocks onto the
        disk, those not there yet (the writer's thread writes them)."""
        tokens, size = self.slots[row].tokens, self.store.block if self.store else 0
        if self.disk is None or len(tokens) < size or self.disk.folder is None:
            return
        self.keep_blocks(row, tokens)
        chain = self.store.match(tokens, len(tokens))
        new = [(i, b) for i, b in enumerate(chain) if not b.on_disk]
        if not new:
            return
        self.calls.call("write_blocks", blocks=[(b.id, self.disk.path(tokens[:(i + 1) * size]),
                                                 tokens[:(i + 1) * size]) for i, b in new])
        for _, b in new:
            b.on_disk = True

    def restore(self, row: int, request: Request, common: int) -> int:
        """How many of the prompt's first tokens row holds once the prefix store's longest match is copied in (when
        it is longer than the `common` ones the row holds already); 0 when the store has nothing longer."""
        if self.store is None or request.echo:
            return 0
        limit = len(request.prompt) - 1  # (the last token is prefilled: its logits give the first new token)
        chain = self.store.match(request.prompt, limit)
        if self.disk is not None and self.disk.folder is not None and self.read_disk(request.prompt, len(chain), limit):
            chain = self.store.match(request.prompt, limit)
        size = self.store.block
        if len(chain) * size <= common:
            return 0
        first = common // size  # (blocks before it: the row holds them already)
        self.calls.call("restore", row=row, blocks=[b.id for b in chain[first:]], start=first * size)
        return len(chain) * size

    def read_disk(self, prompt: list[int], have: int, limit: int) -> int:
        """Read into the store the blocks that follow the prompt's first `have` stored ones, as far as the disk has
        them (within `limit` tokens): how many were read."""
        size, ends = self.store.block, []
        for end in range((have + 1) * size, limit + 1, size):
            if not os.path.exists(self.disk.path(prompt[:end])):
                break
            ends.append(end)
        if not ends:
            return 0
        new, evicted = self.store.add(prompt[:ends[-1]])
        files = [(i, self.disk.path(prompt[:start + size]), prompt[:start + size]) for i, start in new]
        read = self.calls.call("read_blocks", blocks=files, size=size, drop=evicted)
        self.store.drop([i for i, _ in new[read:]][::-1])  # (missing or damaged: not kept)
        for block in self.store.match(prompt, ends[-1]):
            block.on_disk = True
        if self.metrics is not None:
            self.metrics.evictions.inc(len(evicted))
            self.metrics.disk_tokens.inc(read * size)
        return read

    def prefill(self) -> None:
        """Prefill the admitted prompts, oldest first. While other rows decode, at most `prefill_chunk` tokens a turn:
        a long prompt goes in chunks between their steps (no stream waits for a whole long prefill); with none
        decoding, every prompt whole. Chunks of several prompts go in one pass (the weights are read once)."""
        group = self.prefill_group()
        if not group:
            return
        if len(group) == 1 or any(end - start <= generate.PREFILL_CHUNK for _, start, end in group):
            for row, start, end in group:  # (a short chunk runs a compiled step, alone)
                request = self.slots[row].request
                self.prefilled(row, end, self.calls.call("prefill", row=row, prompt=request.prompt[start:end],
                                                         every=request.echo, start=start))
            return
        logits = self.calls.call("prefill_rows", rows=[row for row, _, _ in group],
                                 chunks=[self.slots[r].request.prompt[s:e] for r, s, e in group],
                                 starts=[s for _, s, _ in group])
        for i, (row, _, end) in enumerate(group):
            self.prefilled(row, end, logits[i:i + 1])

    def prefill_group(self) -> list[tuple[int, int, int]]:
        """This turn's chunks, (row, start, end) each, within the budget; cancelled requests' rows freed."""
        filling = sorted((r for r, q in enumerate(self.rows) if q is not None and q.status is Status.PREFILLING),
                         key=lambda r: self.slots[r].request.arrived)
        running = sum(q is not None for q in self.rows)  # (a speculating row 0 among them)
        budget = self.prefill_chunk if self.prefill_chunk and len(filling) < running else None
        group = []
        for row in filling:
            request = self.slots[row].request
            if request.cancelled:  # (the cache keeps what was prefilled)
                self.slots[row].request = None
                continue
            if budget is not None and budget <= 0:
                break
            end = len(request.prompt) if budget is None else min(len(request.prompt), request.filled + budget)
            if request.echo:  # every position's logits: alone, whole
                return group or [(row, request.filled, len(request.prompt))]
            group.append((row, request.filled, end))
            budget = None if budget is None else budget - (end - request.filled)
        return group

    def prefilled(self, row: int, end: int, logits: torch.Tensor) -> None:
        """A chunk of row's prompt is in the cache, up to `end`; logits: the last token's [1, V] (echo: every token's
        [1, T, V]). At the prompt's end, the first token is drawn and the row decodes from the next step."""
        slot = self.slots[row]
        request = slot.request
        request.filled, slot.tokens = end, list(request.prompt[:end])
        if request.echo:  # [1, T, V]: position p's logits rate prompt token p + 1
            request.prompt_entries = [None] + [logprob_entry(logits[0, p], request.prompt[p + 1],
                                                             request.logprobs or 0)
                                               for p in range(len(request.prompt) - 1)]
            logits = logits[:, -1]
        if end < len(request.prompt):
            return
        request.status = Status.DECODING
        if request.max_tokens == 0:  # (echo alone: the prompt's logprobs, nothing generated)
            request.end("length", [])
            slot.request = None
            return
        V = logits.shape[-1]
        token = int(sample_one(logits, request, self.vocab_limit, request.bias(V), request.penalty(V)))
        slot.position, slot.last = len(request.prompt), token
        self.deliver(row, token, logits[0])

    def decode(self, busy: list[int]) -> None:
        """One step of every decoding row: each feeds its last token at its own position. A request alone (admitted
        to row 0, the first free one) decodes in a batch-1 step, at batch 1's speed; otherwise every row steps (two
        compiled graphs in all, whatever the load); an idle, prefilling or speculating row writes to the scratch
        slot, which nothing reads."""
        width = 1 if busy == [0] else len(self.slots)
        rows = [self.slots[r].request if r in busy else None for r in range(width)]
        tokens = [self.slots[r].last if r in busy else 0 for r in range(width)]
        positions = [self.slots[r].position if r in busy else self.max_seq_len for r in range(width)]
        with_logits = any(r is not None and r.logprobs is not None for r in rows)
        out = self.calls.call("decode", tokens=tokens, positions=positions, sampling=self.sampling(rows),
                              with_logits=with_logits)
        out, logits = out if with_logits else (out, None)
        out = out[:, 0].tolist()
        for row in busy:
            slot = self.slots[row]
            slot.tokens.append(tokens[row])  # (fed at its position: now in the cache)
            slot.position, slot.last = slot.position + 1, out[row]
            self.deliver(row, out[row], None if logits is None else logits[row])

    def sampling(self, rows: list[Request | None]) -> generate.Sampling:
        """Each row's sampling settings, inputs of the compiled step; a bias [B, V] only when a row has one (a
        constrained, biased or penalized row: else the plain step runs)."""
        V = self.model.config.vocab_size

        def stacked(make, empty) -> torch.Tensor | None:  # [B, V], or None when no row has one
            got = [make(r) if r is not None else None for r in rows]
            if all(g is None for g in got):
                return None
            return torch.stack([g if g is not None else empty(V) for g in got]).to(self.model.device)

        return generate.Sampling(
            tuple(r.temperature if r else 0.0 for r in rows), tuple(r.top_k if r else None for r in rows),
            tuple(r.top_p if r else None for r in rows), self.vocab_limit,
            tuple(r.generator if r else self.idle_generator for r in rows),
            stacked(lambda r: r.bias(V), torch.zeros), tuple(r.min_p if r else None for r in rows),
            tuple(r.typical_p if r else None for r in rows), stacked(lambda r: r.penalty(V), torch.ones))

    def deliver(self, row: int, token: int, logits: torch.Tensor | None = None) -> None:
        """A row's new token (and the logits it was drawn from, when the request wants logprobs): its text to the
        client (held back while it may start a stop string), and the row freed when the request is done."""
        request = self.slots[row].request
        if request.logprobs is not None and logits is not None and token not in self.vocab.stop_ids:
            request.entries.append(logprob_entry(logits, token, request.logprobs))
        request.chose(token, self.vocab.stop_ids)
        reason = finish(self.vocab, request, token)
        if self.metrics is not None:
            self.metrics.token(request)
            if reason or request.cancelled:
                self.metrics.prompt_tokens.inc(len(request.prompt))
        if reason or request.cancelled:
            request.end(reason or "cancelled")
            self.slots[row].request = None

    # ---- speculative decoding, beside the batch

    def start_speculation(self, request: Request) -> None:
        """The request takes row 0 (its cache from slot 0) and the draft: a round of draft tokens checked by the
        target each turn, the exact output of speculative decoding in fewer target steps."""
        self.keep(0, 0)
        self.slots[0].request, self.slots[0].tokens, request.status = request, [], Status.SPECULATING
        self.speculation = speculative.generate_rounds(
            self.model, torch.tensor([request.prompt], device=self.model.device), request.max_tokens, self.draft,
            speculate_k=self.speculate_k, temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
            steps=self.calls.runner.steps, vocab_limit=self.vocab_limit)

    def speculate(self) -> None:
        """The tokens of one round (the first: the prompt's prefill and its token), delivered one by one; row 0 and
        the draft are free again when the request ends."""
        request = self.slots[0].request
        new = None if request.cancelled else next(self.speculation, None)
        for token in new or []:
            self.deliver(0, token)
            if request.status is Status.FINISHED:
                break
        if new is None and request.status is not Status.FINISHED:  # (cancelled, or no more tokens)
            request.end("cancelled" if request.cancelled else "length")
        if request.status is Status.FINISHED:
            self.speculation.close()
            self.speculation, self.slots[0] = None, Row()


def token_bytes(model: dense.DenseDecoder) -> int:
    """Bytes of one slot's keys and values (and an int8 cache's scales) in every layer's cache."""
    parts = [t for layer in caches.like(model, 16) for t in layer]  # (16 slots: whole key blocks)
    return sum(t.numel() * t.element_size() for t in parts) // 16


def logprob_entry(logits: torch.Tensor, token: int, top: int) -> tuple:
    """(token, its logprob, [(id, logprob)] of the `top` likeliest): the float32 log-softmax of the model's logits
    [V], before temperature or any filter, as OpenAI reports them."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = logprobs.topk(top) if top else None
    alternatives = list(zip(best.indices.tolist(), best.values.tolist())) if top else []
    return token, float(logprobs[token]), alternatives


def sample_one(logits: torch.Tensor, request: Request, vocab_limit: int | None, bias: torch.Tensor | None = None,
               penalty: torch.Tensor | None = None) -> torch.Tensor:
    """The first token of a request, from its prefill's logits [1, V] (its penalties and bias applied, as the decode
    step applies them), with its own noise."""
    logits = generate.shape_logits(logits, None if bias is None else bias.to(logits.device),
                                   None if penalty is None else penalty.to(logits.device))
    noise = torch.empty_like(logits).exponential_(1, generator=request.generator)
    return dense.sample(logits, request.temperature, request.top_k, request.top_p, vocab_limit, noise,
                        request.min_p, request.typical_p)


def finish(vocab: Vocabulary, request: Request, token: int) -> str | None:
    """Take one generated token and send its text (what a stop string cannot still claim); returns the finish
    reason once the request is done ("stop": an end-of-text token, a stop string, or a complete grammar; "length")."""
    if request.text is None:
        request.text, request.held = TextStream(vocab), StopText(request.stop)
    if token in vocab.stop_ids:
        send_text(request, request.held.flush())
        return "stop"
    request.generated.append(token)
    shown = request.held.push(request.text.push(token))
    if request.held.stopped:  # a stop string ends the text before it
        send_text(request, shown)
        return "stop"
    complete = request.constraint is not None and request.constraint.done  # the grammar takes no more tokens
    if len(request.generated) >= request.max_tokens or complete:
        send_text(request, shown + request.held.flush() + request.text.finish())
        return "length" if len(request.generated) >= request.max_tokens else "stop"
    send_text(request, shown)
    return None


def send_text(request: Request, text: str) -> None:
    if text:  # (logprob entries wait for the text their tokens make)
        request.send("text", text, request.take_entries())
