"""The scheduler: one thread owns the model and runs requests in the cache's rows, continuous batching.

A turn, in nano-vllm's shape: schedule() says what runs (it decides only, on the records: which waiting requests get
which free rows, the prompt chunks prefilled, a speculative round, the rows that decode), the Scheduler runs it
through runner.ModelCalls (every tensor-parallel rank makes the same calls by name), and postprocess() delivers
each new token (its text to the client, the row freed when the request ends). A row's cache keeps its last
request's tokens; a new request takes the free row sharing the longest prefix of its prompt, and the prefix store
keeps what a row held (prefixes.py). Prompts prefill in chunks while other rows decode. With a draft (--draft,
--lookup) one request at a time decodes speculatively in row 0, a round a turn, beside the batch.
Records: a Request (its Output and Shaping, what it asks of the sampler), a Row per cache row, a Plan per turn, an
Event per thing a client is told."""

from __future__ import annotations

import concurrent.futures
import enum
import os
import queue
import threading
import time
import traceback
from dataclasses import InitVar, dataclass, field
from typing import Callable, NamedTuple

import torch

import dense
from dense_engine.formats.load import LoadRecord
from dense_engine.formats.vocab import StopText, TextStream, Vocabulary
from dense_engine.runtime import caches, generate, speculative, tp
from dense_engine.runtime.sampling import SamplerSettings
from dense_engine.runtime.session import common_prefix, steps_for_program
from dense_engine.server import prefixes
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
class Output:
    """What a request's client is sent so far: its stop strings, the generated text decoded as it grows, cut at a
    stop string (a tail that may start one held back), and the logprob entries of tokens whose text is not sent."""
    stop: list[str]
    text: TextStream | None = None
    held: StopText | None = None
    entries: list = field(default_factory=list)


@dataclass
class Shaping:
    """What moves a request's logits besides its sampler settings: its grammar (a grammar.Constraint: the tokens it
    allows), its DRY sampler (SamplerSettings.dry_for), and each generated token's count (presence and frequency)."""
    constraint: object = None
    dry: object = None
    counts: dict = field(default_factory=dict)


@dataclass
class Timing:
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None


@dataclass
class Request:
    """One completion: its prompt ids, what it asks of the sampler (and its own noise: its sampled text depends on
    nothing else), and `sink`, which takes the Events its client is told (the HTTP side puts them on an asyncio
    queue of its loop). stop goes into its Output."""
    prompt: list[int]
    max_tokens: int
    sampler: SamplerSettings
    stop: InitVar[list[str]]
    generator: torch.Generator
    sink: Callable[[Event], None]
    index: int = 0  # its choice's index (a completion request may carry several prompts)
    follows: Request | None = None  # the first of n choices of its prompt: prefilled once, in that one's row, whose
    #                                 cache this one's row copies (Scheduler.share_prefills)
    row: int = -1  # the cache row it was given
    logprobs: int | None = None  # the alternatives to report per token (0: only the chosen one); None: no logprobs
    echo: bool = False  # (completions) the prompt's own logprobs too
    status: Status = Status.WAITING
    cancelled: bool = False  # the client went away: free the row
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_entries: list = field(default_factory=list)  # (echo) one per prompt token, the first None
    shaping: Shaping = field(default_factory=Shaping)
    output: Output = None
    timing: Timing = field(default_factory=Timing)
    adapters: tuple[float, ...] = ()  # the scale of each LoRA adapter served by name (lora.switch); (): none

    def __post_init__(self, stop) -> None:
        self.output = Output(list(stop))

    @property
    def constraint(self):
        return self.shaping.constraint

    @property
    def shaped(self) -> bool:
        """Whether something but the sampler picks its tokens (logprobs, echo, a grammar, a bias or penalties)."""
        s = self.sampler
        return (self.logprobs is not None or self.echo or self.constraint is not None or bool(s.logit_bias)
                or bool(s.presence_penalty or s.frequency_penalty) or s.penalized or self.shaping.dry is not None)

    def penalty(self, vocab: int) -> torch.Tensor | None:
        """[V] float32 repetition penalties (generate.shape_logits' rule), or None: none."""
        s = self.sampler
        if not s.penalized:
            return None
        seen = self.prompt + self.generated
        seen = seen if s.repeat_last_n < 0 else seen[-s.repeat_last_n:]
        out = torch.ones(vocab)
        out[seen] = s.repetition_penalty
        return out

    def bias(self, vocab: int) -> torch.Tensor | None:
        """[V] float32 added to this request's logits before sampling (OpenAI's semantics), or None: none."""
        s, shaping = self.sampler, self.shaping
        penalties = shaping.counts and (s.presence_penalty or s.frequency_penalty)
        if shaping.constraint is None and not s.logit_bias and not penalties and shaping.dry is None:
            return None
        bias = shaping.constraint.bias("cpu") if shaping.constraint is not None else torch.zeros(vocab)
        if s.logit_bias:
            bias[list(s.logit_bias)] += torch.tensor(list(s.logit_bias.values()))
        if penalties:
            counts = torch.tensor(list(shaping.counts.values()), dtype=torch.float32)
            bias[list(shaping.counts)] -= s.presence_penalty + s.frequency_penalty * counts
        if shaping.dry is not None:
            bias -= shaping.dry.penalty(self.prompt + self.generated, vocab)
        return bias

    def chose(self, token: int, stop_ids) -> None:
        """A token was chosen: the grammar and (for the penalties) the counts move on."""
        if token in stop_ids:
            return
        if self.constraint is not None:
            self.constraint.consume(token)
        if self.sampler.presence_penalty or self.sampler.frequency_penalty:
            self.shaping.counts[token] = self.shaping.counts.get(token, 0) + 1

    def send(self, kind: str, text: str, entries: list) -> None:
        self.sink(Event(self.index, kind, text, entries))

    def end(self, reason: str, entries: list | None = None) -> None:
        self.finish_reason, self.status = reason, Status.FINISHED
        self.send("done", reason, self.take_entries() if entries is None else entries)

    def take_entries(self) -> list:
        entries, self.output.entries = self.output.entries, []
        return entries


@dataclass
class Row:
    """One row of the cache: the request it runs (None: free), the tokens its cache holds at slots 0.. (while a
    prompt prefills: its first ones so far), the slot its next token goes to and the token it feeds next."""
    request: Request | None = None
    tokens: list[int] = field(default_factory=list)
    position: int = 0
    last: int = 0
    used: int = 0  # when a request last took it (the scheduler's count of admissions): least recently used first
    adapters: tuple[float, ...] = ()  # the adapters its cache was computed with (Request.adapters)


@dataclass
class Ahead:
    """A decode step launched and not read yet (one step behind: the next step is launched before the host reads this
    one's tokens). Its rows (busy, each with the request it ran for), the cache rows it stepped, its new tokens on
    the device and their copy on the way to host memory."""
    busy: list[int]
    requests: list[Request]
    stepped: list[int]
    out: torch.Tensor
    copied: tuple  # (generate.to_host)


@dataclass
class Plan:
    """What one turn runs, decided by schedule(): `taken` requests off the head of the line (the cancelled among
    them dropped); admissions (row, request, prompt tokens the row holds); the request that starts speculating in
    row 0; rows freed (their prefilling request was cancelled); prompt chunks (row, start, end) to prefill; whether
    a speculative round runs; the rows that decode (those still running once the prefill's first tokens are out)."""
    taken: int = 0
    admit: list[tuple[int, Request, int]] = field(default_factory=list)
    speculate: Request | None = None
    freed: list[int] = field(default_factory=list)
    prefill: list[tuple[int, int, int]] = field(default_factory=list)
    round: bool = False
    decode: list[int] = field(default_factory=list)


def schedule(rows: list[Row], waiting: list[Request], *, drafting: bool = False, speculating: bool = False,
             reuse: bool = True, prefill_chunk: int = PREFILL_BUDGET,
             stored: Callable[[Request], int] = lambda request: 0, whole_rows: bool = False,
             snapshots: Callable[[Request], list[int]] = lambda request: []) -> Plan:
    """This turn's Plan, from the rows and the line of waiting requests (changes neither). With a draft, a request
    the sampler alone decides takes row 0 to speculate, when no other request does. stored(request): how many of its
    prompt's first tokens the prefix store holds (prefixes.stored). whole_rows: a row's cache is reused only whole
    (a state layer holds where it ends: a prompt that goes on from all of it, or none); snapshots(request): where a
    state model's prefill stops to keep its state (prefixes.snapshots)."""
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
               if row.request is not None and row.request.status is Status.PREFILLING and not waits(row.request)]
    filling += [(row, request, starts[row]) for row, request, _ in plan.admit if not waits(request)]
    running = sum(row.request is not None for row in rows) + len(taken)  # (a speculating row 0 among them)
    prompts = {row: request.prompt for row, request, _ in filling}
    plan.freed, plan.prefill = prefill_group(sorted(filling, key=lambda f: f[1].timing.arrived), running,
                                             prefill_chunk, snapshots)
    done = {row for row, _, end in plan.prefill if end == len(prompts[row])}  # (their first token comes first)
    plan.decode = sorted({r for r, row in enumerate(rows) if row.request is not None
                          and row.request.status is Status.DECODING} | done)
    return plan


def waits(request: Request) -> bool:
    """Whether a choice waits for the first choice of its prompt to finish prefilling it (n > 1)."""
    leader = request.follows
    return leader is not None and leader.status in (Status.WAITING, Status.PREFILLING) and not leader.cancelled


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
    """Owns the model: each turn runs schedule()'s Plan through the model calls and delivers its tokens, until
    stopped. Under tensor parallel, rank 0 runs it and the other ranks make the same model calls."""

    def __init__(self, model: dense.DenseDecoder, vocab: Vocabulary, max_batch: int, max_seq_len: int,
                 compile: bool, draft=None, speculate_k: int = 4, metrics=None, reuse: bool = True,
                 prefill_chunk: int = PREFILL_BUDGET, prefix_cache_mb: int | None = None,
                 prefix_disk_mb: int | None = 0, prefix_block: int = BLOCK, load: LoadRecord | None = None) -> None:
        self.model, self.vocab, self.draft, self.speculate_k = model, vocab, draft, speculate_k
        self.metrics, self.reuse, self.prefill_chunk = metrics, reuse, prefill_chunk
        self.slots = [Row() for _ in range(max_batch)]
        self.speculation = None  # (the token generator of the request speculating in row 0)
        # On a GPU a decode step of rows whose tokens only the sampler picks is launched before the host reads the
        # step before it (its tokens fed from the device): the device is not idle while the host delivers text. (Not
        # with state layers: a token fed after a request's last would move its row's state, which a next turn reuses)
        self.one_step_behind = model.device.type == "cuda" and tp.world()[1] == 1 and not caches.has_state(model)
        self.ahead: Ahead | None = None
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
        self.whole_rows = caches.has_state(model)  # (a row's state is where it ends: the row reused whole or not)
        self.store = PrefixStore(prefix_cache_mb << 20, token_bytes(model), prefix_block, caches.states_bytes(model)) \
            if reuse and prefix_cache_mb else None
        self.states_kept = self.store is not None and self.whole_rows  # (at snapshot points: prefixes.keep_state)
        self.disk = None  # the store's disk tier: prefixes used more than once, kept across restarts (no states yet)
        if self.store is not None and prefix_disk_mb != 0 and tp.world()[1] == 1 and machine.unwritable_cache() is None \
                and not self.whole_rows:
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
        """Run the tasks asked for, then this turn's Plan: admissions, prefill, a speculative round, a decode step.
        A step launched ahead is read first unless the plan is that step's rows decoding again, nothing else."""
        if self.ahead is not None and not self.tasks.empty():
            self.read_ahead()
        while not self.tasks.empty():
            function, done = self.tasks.get_nowait()
            try:
                done.set_result(function())
            except Exception as e:  # (the asker is told)
                done.set_exception(e)
        self.share_prefills()
        with self.waiting.mutex:  # (the line as it is now: only this thread takes from it)
            line = list(self.waiting.queue)
        plan = self.plan(line)
        if self.ahead is not None and not keeps_pace(plan, self.ahead, self.slots):
            self.read_ahead()  # (its tokens delivered: rows freed, requests ended, then planned again)
            plan = self.plan(line)
        admit(self, plan)
        for row in plan.freed:
            self.slots[row].request = None
        # (a chunk starts where its row's cache ends: an admission may have found less stored than planned)
        prefill(self, [(row, len(self.slots[row].tokens), end) for row, _, end in plan.prefill])
        if plan.round:
            speculate(self)
        busy = [r for r in plan.decode if self.slots[r].request and self.slots[r].request.status is Status.DECODING]
        if busy:
            decode(self, busy)
        elif not any(self.rows) and self.tasks.empty():
            try:  # idle: wait for a request
                self.waiting.put(self.waiting.get(timeout=0.1))
            except queue.Empty:
                pass

    def plan(self, line: list[Request]) -> Plan:
        return schedule(self.slots, line, drafting=self.draft is not None, speculating=self.speculation is not None,
                        reuse=self.reuse, prefill_chunk=self.prefill_chunk,
                        stored=lambda request: prefixes.stored(self, request), whole_rows=self.whole_rows,
                        snapshots=lambda request: prefixes.snapshots(self, request))

    def read_ahead(self) -> None:
        ahead, self.ahead = self.ahead, None
        self.read(ahead)

    def read(self, ahead: Ahead) -> None:
        """A step launched ahead: its tokens read and delivered (a row whose request ended meanwhile: dropped)."""
        out = generate.wait(ahead.copied)
        kept = [i for i, (r, request) in enumerate(zip(ahead.busy, ahead.requests)) if self.slots[r].request is request
                and request.status is Status.DECODING]
        busy = [ahead.busy[i] for i in kept]
        self.postprocess(busy, [self.slots[r].last for r in busy], [out[ahead.stepped.index(r)] for r in busy], None)

    def share_prefills(self) -> None:
        """Rows whose request is a later choice of a prompt the first choice has prefilled: that row's keys and values
        copied in, whole blocks of 16 slots up to the prompt's last token (prefilled here: its logits start this
        choice), when that row still holds them; else the choice prefills its prompt itself."""
        for row, slot in enumerate(self.slots):
            request = slot.request
            if request is None or request.follows is None or request.status is not Status.PREFILLING or waits(request):
                continue
            source, end = request.follows.row, (len(request.prompt) - 1) // 16 * 16
            if len(slot.tokens) < end and source >= 0 and self.slots[source].tokens[:end] == request.prompt[:end]:
                self.calls.call("copy_row", source=source, row=row, end=end)
                slot.tokens = request.prompt[:end]
            request.follows = None  # (done: it prefills the rest)

    def fail(self, e: Exception) -> None:
        message = f"internal error: {type(e).__name__}: {first_line(e)}"
        for request in self.rows:
            if request is not None and request.finish_reason is None:
                request.finish_reason, request.status = "error", Status.FINISHED
                request.send("error", message, [])
        self.slots = [Row() for _ in self.slots]  # (what a failed step left in the cache is not known)
        self.speculation = self.ahead = None

    # ---- postprocess: the new tokens delivered

    def postprocess_prefill(self, row: int, end: int, logits: torch.Tensor) -> None:
        """A chunk of row's prompt is in the cache, up to `end`; logits: the last token's [1, V] (echo: every token's
        [1, T, V]). At the prompt's end, the first token is drawn and the row decodes from the next step."""
        slot = self.slots[row]
        request = slot.request
        slot.tokens = list(request.prompt[:end])
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
        token = int(generate.sample(logits, sampling(self, [request])))
        slot.position, slot.last = len(request.prompt), token
        self.deliver(row, token, logits[0])

    def postprocess(self, busy: list[int], fed: list[int], out: list[int], logits: torch.Tensor | None) -> None:
        """A decode step's tokens, fed[i], out[i] and logits[i] of row busy[i]: each busy row's fed token is now in
        its cache, its new one delivered."""
        for i, row in enumerate(busy):
            slot = self.slots[row]
            slot.tokens.append(fed[i])
            slot.position, slot.last = slot.position + 1, out[i]
            self.deliver(row, out[i], None if logits is None else logits[i])

    def deliver(self, row: int, token: int, logits: torch.Tensor | None = None) -> None:
        """A row's new token (and the logits it was drawn from, when the request wants logprobs): its text to the
        client (held back while it may start a stop string), and the row freed when the request is done."""
        request = self.slots[row].request
        if request.logprobs is not None and logits is not None and token not in self.vocab.stop_ids:
            request.output.entries.append(logprob_entry(logits, token, request.logprobs))
        request.chose(token, self.vocab.stop_ids)
        reason = finish(self.vocab, request, token)
        if self.metrics is not None:
            self.metrics.token(request)
            if reason or request.cancelled:
                self.metrics.prompt_tokens.inc(len(request.prompt))
        if reason or request.cancelled:
            request.end(reason or "cancelled")
            self.slots[row].request = None

# ---- run: the plan's model calls (runner.ModelCalls), on the scheduler's thread


def admit(scheduler: Scheduler, plan: Plan) -> None:
    """The plan's requests off the line into their rows: what a row held goes to the prefix store first, and a
    longer prefix from the store (or its disk) is copied in."""
    for _ in range(plan.taken):
        scheduler.waiting.get_nowait()
    if plan.speculate is not None:
        start_speculation(scheduler, plan.speculate)
    for row, request, common in plan.admit:
        slot = scheduler.slots[row]
        prefixes.keep(scheduler, row, common)
        stored = prefixes.restore(scheduler, row, request, common)
        scheduler.admitted += 1
        slot.request, slot.used, slot.adapters, request.row = request, scheduler.admitted, request.adapters, row
        slot.tokens = request.prompt[:stored] if stored > common else slot.tokens[:common]
        prefixes.persist(scheduler, row)
        if scheduler.metrics is not None and max(common, stored):
            scheduler.metrics.prefix_hits.inc()
            scheduler.metrics.reused_tokens.inc(max(common, stored))
            scheduler.metrics.stored_tokens.inc(max(0, stored - common))
        request.status = Status.PREFILLING


def prefill(scheduler: Scheduler, group: list[tuple[int, int, int]]) -> None:
    """Prompt chunks (row, start, end) into the rows' caches; chunks of several prompts go in one pass (the
    weights are read once), a short chunk runs a compiled step alone."""
    if not group:
        return
    if len(group) == 1 or any(end - start <= generate.PREFILL_CHUNK for _, start, end in group):
        for row, start, end in group:
            request = scheduler.slots[row].request
            scheduler.postprocess_prefill(row, end, scheduler.calls.call(
                "prefill", row=row, prompt=request.prompt[start:end], every=request.echo, start=start,
                adapters=[request.adapters]))
            prefixes.keep_state(scheduler, row, request, end)
        return
    logits = scheduler.calls.call("prefill_rows", rows=[row for row, _, _ in group],
                                  chunks=[scheduler.slots[r].request.prompt[s:e] for r, s, e in group],
                                  starts=[s for _, s, _ in group],
                                  adapters=[scheduler.slots[r].request.adapters for r, _, _ in group])
    for i, (row, _, end) in enumerate(group):
        request = scheduler.slots[row].request
        scheduler.postprocess_prefill(row, end, logits[i:i + 1])
        prefixes.keep_state(scheduler, row, request, end)


def decode(scheduler: Scheduler, busy: list[int]) -> None:
    """One step of every decoding row: each feeds its last token at its own position. A request alone decodes in a
    batch-1 step on the row it holds, at batch 1's speed; otherwise every row steps (two compiled graphs in all,
    whatever the load); an idle, prefilling or speculating row writes to the scratch slot, which nothing reads.
    One step behind (Scheduler.one_step_behind, rows of plain requests): the step is launched, then the step before
    it read; with a step ahead, each row feeds that step's token (on the device) one slot past its own."""
    lone = len(busy) == 1
    stepped = busy if lone else list(range(len(scheduler.slots)))  # the cache rows of the step's rows
    rows = [scheduler.slots[r].request if r in busy else None for r in stepped]
    ahead, S = scheduler.ahead, scheduler.max_seq_len
    tokens = ahead.out if ahead is not None else [scheduler.slots[r].last if r in busy else 0 for r in stepped]
    positions = [min(scheduler.slots[r].position + (ahead is not None), S) if r in busy else S for r in stepped]
    with_logits = any(r is not None and r.logprobs is not None for r in rows)
    out = scheduler.calls.call("decode", tokens=tokens, positions=positions, sampling=sampling(scheduler, rows),
                               with_logits=with_logits, rows=busy if lone else None,
                               adapters=[r.adapters if r is not None else () for r in rows])
    if ahead is not None or (scheduler.one_step_behind and not any(r is not None and r.shaped for r in rows)):
        scheduler.ahead = Ahead(busy, [scheduler.slots[r].request for r in busy], stepped, out, generate.to_host(out))
        if ahead is not None:  # (the step before, read while this one runs)
            scheduler.read(ahead)
        return
    out, logits = out if with_logits else (out, None)
    at = [stepped.index(r) for r in busy]
    out = out[:, 0].tolist()
    scheduler.postprocess(busy, [tokens[i] for i in at], [out[i] for i in at], None if logits is None else logits[at])


def keeps_pace(plan: Plan, ahead: Ahead, rows: list[Row]) -> bool:
    """Whether the plan is the step ahead's rows decoding again and nothing else (no admission, prefill, freed row or
    speculative round), each with the same plain request: then the next step goes on from the device's tokens."""
    return (not plan.taken and not plan.admit and not plan.freed and not plan.prefill and not plan.round
            and plan.decode == ahead.busy and all(rows[r].request is q and not q.cancelled and not q.shaped
                                                  for r, q in zip(ahead.busy, ahead.requests)))


def sampling(scheduler: Scheduler, rows: list[Request | None]) -> generate.Sampling:
    """Each row's sampling, inputs of the compiled step; a bias [B, V] only when a row has one (a constrained,
    biased or penalized row: else the plain step runs)."""
    V = scheduler.model.config.vocab_size

    def stacked(make, empty) -> torch.Tensor | None:  # [B, V], or None when no row has one
        got = [make(r) if r is not None else None for r in rows]
        if all(g is None for g in got):
            return None
        return torch.stack([g if g is not None else empty(V) for g in got]).to(scheduler.model.device)

    generators = tuple(r.generator if r else scheduler.idle_generator for r in rows)
    return generate.Sampling.of([r.sampler if r else None for r in rows], scheduler.vocab_limit, generators,
                                stacked(lambda r: r.bias(V), torch.zeros), stacked(lambda r: r.penalty(V), torch.ones))


def start_speculation(scheduler: Scheduler, request: Request) -> None:
    """The request takes row 0 (its cache from slot 0) and the draft: a round of draft tokens checked by the
    target each turn, the exact output of speculative decoding in fewer target steps."""
    prefixes.keep(scheduler, 0, 0)
    scheduler.slots[0].request, scheduler.slots[0].tokens, request.status = request, [], Status.SPECULATING
    model = scheduler.model
    scheduler.speculation = speculative.generate_rounds(
        model, torch.tensor([request.prompt], device=model.device), request.max_tokens, scheduler.draft,
        speculate_k=scheduler.speculate_k, sampler=request.sampler, steps=scheduler.calls.runner.steps,
        vocab_limit=scheduler.vocab_limit)


def speculate(scheduler: Scheduler) -> None:
    """The tokens of one round (the first: the prompt's prefill and its token), delivered one by one; row 0 and
    the draft are free again when the request ends."""
    request = scheduler.slots[0].request
    new = None if request.cancelled else next(scheduler.speculation, None)
    for token in new or []:
        scheduler.deliver(0, token)
        if request.status is Status.FINISHED:
            break
    if new is None and request.status is not Status.FINISHED:  # (cancelled, or no more tokens)
        request.end("cancelled" if request.cancelled else "length")
    if request.status is Status.FINISHED:
        scheduler.speculation.close()
        scheduler.speculation, scheduler.slots[0] = None, Row()


def token_bytes(model: dense.DenseDecoder) -> int:
    """Bytes of one slot's keys and values (and an int8 cache's scales) in every attention layer's cache."""
    parts = [t for memory in caches.key_memories(model) for t in memory.slots(0, 0, 16)]  # (whole key blocks)
    return sum(t.numel() * t.element_size() for t in parts) // 16


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
        send_text(request, out.held.flush())
        return "stop"
    request.generated.append(token)
    shown = out.held.push(out.text.push(token))
    if out.held.stopped:  # a stop string ends the text before it
        send_text(request, shown)
        return "stop"
    complete = request.constraint is not None and request.constraint.done  # the grammar takes no more tokens
    if len(request.generated) >= request.max_tokens or complete:
        send_text(request, shown + out.held.flush() + out.text.finish())
        return "length" if len(request.generated) >= request.max_tokens else "stop"
    send_text(request, shown)
    return None


def send_text(request: Request, text: str) -> None:
    if text:  # (logprob entries wait for the text their tokens make)
        request.send("text", text, request.take_entries())
