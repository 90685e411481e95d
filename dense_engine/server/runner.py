"""The scheduler's model side. ModelRunner runs a turn's Plan: its model calls (prefill chunks, a speculative round,
a decode step), each output yielded to the scheduler's postprocess as it comes; it holds the decode step launched
ahead (one step behind) and the speculation in row 0. ModelCalls makes the calls by name: under tensor parallel
(torchrun) rank 0 sends each call's name and arguments to the other ranks, which make the same call on their shards
(follow); one process: the call alone."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

import dense
from dense_engine.formats import lora
from dense_engine.runtime import caches, generate, speculative, tp
from dense_engine.server import prefix_store
from dense_engine.server.records import Plan, Request, Row, Status


class ModelCalls:
    """prefill, prefill_rows and decode over one generate.Runner (its eager or compiled steps), made on every rank;
    keep and restore: the prefix store's blocks (prefix_store.py), this rank's keys and values of them."""

    def __init__(self, runner: generate.Runner) -> None:
        self.runner = runner
        self.device = runner.model.device
        self.kept: dict[int, list[tuple[torch.Tensor, ...]]] = {}  # block id -> each layer's (k, v[, their scales])
        self.states: dict[int, list[torch.Tensor]] = {}  # block id -> a state model's row states after its end
        self.disk: prefix_store.DiskStore | None = None  # (one process only: no disk tier under tensor parallel)
        self.switches = lora.switches(runner.model)  # the linears with LoRA adapters served by name

    def call(self, name: str, **args):
        """Make the call `name` (a method below) here and, under tensor parallel, on every other rank."""
        if tp.world()[1] > 1:
            tp.broadcast((name, args))
        return getattr(self, name)(**args)

    def stop(self) -> None:
        """Rank 0 is done: the other ranks' follow() returns."""
        if tp.world()[1] > 1:
            tp.broadcast(("stop", {}))

    def follow(self) -> None:
        """Ranks other than 0: make every call rank 0 makes, until it stops."""
        while True:
            name, args = tp.broadcast(None)
            if name == "stop":
                return
            getattr(self, name)(**args)

    def prefill(self, row: int, prompt: list[int], every: bool, start: int, adapters: list = ((),)
                ) -> torch.Tensor:
        """A prompt (or a chunk of it) into cache row `row` from slot `start`: the last token's logits [1, V] (every:
        each token's, [1, T, V]). adapters: [the row's adapters' scales] (Request.adapters)."""
        self.switch(adapters)
        return self.runner.prefill(torch.tensor([prompt], device=self.device), start, None,
                                   rows=torch.tensor([row], device=self.device), every=every)

    def prefill_rows(self, rows: list[int], chunks: list[list[int]], starts: list[int], adapters: list = ()
                     ) -> torch.Tensor:
        """Several rows' chunks in one pass: each chunk's last logits [B, V]."""
        self.switch(adapters)
        return self.runner.prefill_rows(chunks, starts, torch.tensor(rows, device=self.device))

    def decode(self, tokens: list[int] | torch.Tensor, positions: list[int], sampling: generate.Sampling,
               with_logits: bool, rows: list[int] | None = None, adapters: list = ()):
        """One step of cache rows `rows` (None: 0..B-1), token b at positions[b]: the next tokens [B, 1] (and the
        logits [B, V]). tokens: ids, or the step before's next tokens [B, 1] on the device (one step behind)."""
        self.switch(adapters)
        token = tokens if torch.is_tensor(tokens) else torch.tensor(tokens, device=self.device)[:, None]
        return self.runner.decode(token, positions, None, sampling, with_logits,
                                  None if rows is None else torch.tensor(rows, device=self.device))

    def switch(self, adapters: list[tuple[float, ...]]) -> None:
        """The next call's rows with their LoRA adapters served by name (lora.switch): adapters[b] for row b of its
        input, () or missing: none."""
        if self.switches:
            lora.switch(self.switches, list(adapters) + [()] * (self.runner.model.max_batch_size - len(adapters)))

    def keep(self, row: int, blocks: list[tuple[int, int]], size: int, drop: list[int], state: int | None = None
             ) -> None:
        """Forget the blocks `drop`, then copy row's slots start..start + size of each new block (id, start) into
        host memory (a state model: its attention layers'); state: the block whose end row's state is at now."""
        for i in drop:
            del self.kept[i]
            self.states.pop(i, None)
        for i, start in blocks:
            self.kept[i] = caches.copy_keys(self.runner.model, row, start, start + size)
        if state is not None:
            self.states[state] = caches.row_states(self.runner.model, row)

    def restore(self, row: int, blocks: list[int], start: int) -> None:
        """Kept blocks, in order, into row's slots from `start` on (a state model: and the last one's state)."""
        layers = [tuple(torch.cat(parts, dim=1) for parts in zip(*(self.kept[i][n] for i in blocks)))  # (dim 1: the
                  for n in range(len(self.kept[blocks[0]]))]  # slots of keys, values, scales in every layout)
        caches.put_keys(self.runner.model, row, start, layers)
        if caches.has_state(self.runner.model):
            caches.put_row_states(self.runner.model, row, self.states[blocks[-1]])

    def copy_row(self, source: int, row: int, end: int) -> None:
        """Row `source`'s keys and values at slots 0..end-1 (a multiple of 16) into row `row`."""
        caches.put_keys(self.runner.model, row, 0, caches.copy_keys(self.runner.model, source, 0, end))

    def read_blocks(self, blocks: list[tuple[int, str, list[int]]], size: int, drop: list[int]) -> int:
        """Forget the blocks `drop`, then read blocks of `size` tokens (id, file, the tokens of the prefix it ends)
        from the disk, in order, until one is missing or not whole: how many were read."""
        for i in drop:
            del self.kept[i]
        like = caches.like(self.runner.model, size)  # (shapes, dtypes)
        for n, (i, path, tokens) in enumerate(blocks):
            layers = prefix_store.read_block(path, tokens, like)
            if layers is None:
                return n
            self.kept[i] = layers
        return len(blocks)

    def write_blocks(self, blocks: list[tuple[int, str, list[int]]]) -> None:
        """Queue kept blocks (id, file, the tokens of the prefix it ends) for the disk."""
        for i, path, tokens in blocks:
            self.disk.write(path, tokens, self.kept[i])

    def row_slots(self, row: int, end: int) -> list[tuple[torch.Tensor, ...]]:
        """Copies, in host memory, of row's keys and values at slots 0..end-1 (end: a multiple of 16)."""
        return caches.copy_slots(self.runner.model, row, 0, end)

    def put_row(self, row: int, layers: list[tuple[torch.Tensor, ...]]) -> None:
        """row_slots' copies into row's slots from 0 on."""
        caches.put_slots(self.runner.model, row, 0, layers)


# ---- the outputs of a turn's model calls, each yielded to the scheduler's postprocess

@dataclass
class Prefilled:
    """A chunk of row's prompt in its cache, up to `end`: the last token's logits [1, V] (echo: every token's
    [1, T, V]) and, where the chunk ends the prompt, the first token drawn from them (None: not the end, or
    max_tokens 0)."""
    row: int
    request: Request
    end: int
    logits: torch.Tensor
    token: int | None


@dataclass
class Drafted:
    """A speculative round of row 0's request: its tokens (the first round: the prompt's prefill and its token);
    None: no more, or the request was cancelled."""
    request: Request
    tokens: list[int] | None


@dataclass
class Decoded:
    """A decode step's tokens: fed[i] (now in the cache), out[i] (new) and logits[i] [V] of row rows[i]; logits None
    unless a row wants logprobs."""
    rows: list[int]
    fed: list[int]
    out: list[int]
    logits: torch.Tensor | None


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


class ModelRunner:
    """A turn's model calls, over the rows the scheduler gives (read as each call is made), on its thread: run()
    yields each call's output; the next call is made once postprocess has delivered it. It holds the decode step
    launched ahead and the speculation in row 0 (a draft's rounds)."""

    def __init__(self, model: dense.DenseDecoder, steps, max_seq_len: int, vocab_limit: int | None, draft,
                 speculate_k: int) -> None:
        self.model, self.max_seq_len, self.vocab_limit = model, max_seq_len, vocab_limit
        self.calls = ModelCalls(generate.Runner(model, steps))
        self.draft, self.speculate_k = draft, speculate_k
        self.speculation = None  # (the token generator of the request speculating in row 0)
        # On a GPU a decode step of rows whose tokens only the sampler picks is launched before the host reads the
        # step before it (its tokens fed from the device): the device is not idle while the host delivers text. (Not
        # with state layers: a token fed after a request's last would move its row's state, which a next turn reuses)
        self.one_step_behind = model.device.type == "cuda" and tp.world()[1] == 1 and not caches.has_state(model)
        self.ahead: Ahead | None = None
        self.idle_generator = torch.Generator(model.device)  # (an idle row's noise, never used)

    def run(self, plan: Plan, rows: list[Row]) -> Iterator[Prefilled | Drafted | Decoded]:
        """The plan's prompt chunks, speculative round and decode step, each output yielded as it comes. Lazily: a
        row whose prompt ends this turn decodes in this turn's step, unless its request ended at its first token."""
        # (a chunk starts where its row's cache ends: an admission may have found less stored than planned)
        yield from self.prefill(rows, [(row, len(rows[row].tokens), end) for row, _, end in plan.prefill])
        if plan.round:
            yield from self.speculate(rows)
        busy = [r for r in plan.decode if rows[r].request and rows[r].request.status is Status.DECODING]
        if busy:
            yield from self.decode(rows, busy)

    def prefill(self, rows: list[Row], group: list[tuple[int, int, int]]) -> Iterator[Prefilled]:
        """Prompt chunks (row, start, end) into the rows' caches; chunks of several prompts go in one pass (the
        weights are read once), a short chunk runs a compiled step alone."""
        if not group:
            return
        if len(group) == 1 or any(end - start <= generate.PREFILL_CHUNK for _, start, end in group):
            for row, start, end in group:
                request = rows[row].request
                logits = self.calls.call("prefill", row=row, prompt=request.prompt[start:end], every=request.echo,
                                         start=start, adapters=[request.adapters])
                yield self.prefilled(row, request, end, logits)
            return
        requests = [rows[row].request for row, _, _ in group]
        logits = self.calls.call("prefill_rows", rows=[row for row, _, _ in group],
                                 chunks=[r.prompt[s:e] for r, (_, s, e) in zip(requests, group)],
                                 starts=[s for _, s, _ in group], adapters=[r.adapters for r in requests])
        for i, (row, _, end) in enumerate(group):
            yield self.prefilled(row, requests[i], end, logits[i:i + 1])

    def prefilled(self, row: int, request: Request, end: int, logits: torch.Tensor) -> Prefilled:
        """A chunk's output; at the prompt's end, its first token drawn (echo: from the last of [1, T, V])."""
        if end < len(request.prompt) or request.max_tokens == 0:  # (echo alone: the prompt's logprobs, no token)
            return Prefilled(row, request, end, logits, None)
        last = logits[:, -1] if request.echo else logits  # [1, V]
        return Prefilled(row, request, end, logits, int(generate.sample(last, self.sampling([request]))))

    def start_speculation(self, request: Request) -> None:
        """The request takes the draft (in row 0, its cache from slot 0): a round of draft tokens checked by the
        target each turn, the exact output of speculative decoding in fewer target steps."""
        model = self.model
        self.speculation = speculative.generate_rounds(
            model, torch.tensor([request.prompt], device=model.device), request.max_tokens, self.draft,
            speculate_k=self.speculate_k, sampler=request.sampler, steps=self.calls.runner.steps,
            vocab_limit=self.vocab_limit)

    def speculate(self, rows: list[Row]) -> Iterator[Drafted]:
        """One round of row 0's request; the draft is free again once postprocess has ended the request."""
        request = rows[0].request
        yield Drafted(request, None if request.cancelled else next(self.speculation, None))
        if request.status is Status.FINISHED:
            self.speculation.close()
            self.speculation = None

    def decode(self, rows: list[Row], busy: list[int]) -> Iterator[Decoded]:
        """One step of every decoding row: each feeds its last token at its own position. A request alone decodes in
        a batch-1 step on the row it holds, at batch 1's speed; otherwise every row steps (two compiled graphs in
        all, whatever the load); an idle, prefilling or speculating row writes to the scratch slot, which nothing
        reads. One step behind (rows of plain requests): the step is launched, then the step before it read; with a
        step ahead, each row feeds that step's token (on the device) one slot past its own."""
        lone = len(busy) == 1
        stepped = busy if lone else list(range(len(rows)))  # the cache rows of the step's rows
        requests = [rows[r].request if r in busy else None for r in stepped]
        ahead, S = self.ahead, self.max_seq_len
        tokens = ahead.out if ahead is not None else [rows[r].last if r in busy else 0 for r in stepped]
        positions = [min(rows[r].position + (ahead is not None), S) if r in busy else S for r in stepped]
        with_logits = any(r is not None and r.logprobs is not None for r in requests)
        out = self.calls.call("decode", tokens=tokens, positions=positions, sampling=self.sampling(requests),
                              with_logits=with_logits, rows=busy if lone else None,
                              adapters=[r.adapters if r is not None else () for r in requests])
        if ahead is not None or (self.one_step_behind and not any(r is not None and r.shaped for r in requests)):
            self.ahead = Ahead(busy, [rows[r].request for r in busy], stepped, out, generate.to_host(out))
            if ahead is not None:  # (the step before, read while this one runs)
                yield self.read(ahead, rows)
            return
        out, logits = out if with_logits else (out, None)
        at = [stepped.index(r) for r in busy]
        out = out[:, 0].tolist()
        yield Decoded(busy, [tokens[i] for i in at], [out[i] for i in at], None if logits is None else logits[at])

    def keeps_pace(self, plan: Plan, rows: list[Row]) -> bool:
        """Whether the plan is the step ahead's rows decoding again and nothing else (no admission, prefill, freed row
        or speculative round), each with the same plain request: then the next step goes on from the device's
        tokens."""
        ahead = self.ahead
        return (not plan.taken and not plan.admit and not plan.freed and not plan.prefill and not plan.round
                and plan.decode == ahead.busy and all(rows[r].request is q and not q.cancelled and not q.shaped
                                                      for r, q in zip(ahead.busy, ahead.requests)))

    def read_ahead(self, rows: list[Row]) -> Decoded:
        ahead, self.ahead = self.ahead, None
        return self.read(ahead, rows)

    def read(self, ahead: Ahead, rows: list[Row]) -> Decoded:
        """A step launched ahead: its tokens, read (a row whose request ended meanwhile: dropped)."""
        out = generate.wait(ahead.copied)
        busy = [r for r, request in zip(ahead.busy, ahead.requests)
                if rows[r].request is request and request.status is Status.DECODING]
        return Decoded(busy, [rows[r].last for r in busy], [out[ahead.stepped.index(r)] for r in busy], None)

    def sampling(self, requests: list[Request | None]) -> generate.Sampling:
        """Each row's sampling, inputs of the compiled step; a bias [B, V] only when a row has one (a constrained,
        biased or penalized row: else the plain step runs)."""
        V = self.model.config.vocab_size

        def stacked(make, empty) -> torch.Tensor | None:  # [B, V], or None when no row has one
            got = [make(r) if r is not None else None for r in requests]
            if all(g is None for g in got):
                return None
            return torch.stack([g if g is not None else empty(V) for g in got]).to(self.model.device)

        generators = tuple(r.generator if r else self.idle_generator for r in requests)
        return generate.Sampling.of([r.sampler if r else None for r in requests], self.vocab_limit, generators,
                                    stacked(lambda r: r.bias(V), torch.zeros),
                                    stacked(lambda r: r.penalty(V), torch.ones))

    def reset(self) -> None:
        """After a failed turn: no step ahead, no speculation (what a failed step left in the cache is not known)."""
        self.speculation = self.ahead = None
