"""generate.py: generation over dense.py's static KV cache: a prefill, then one fixed-shape decode step per token.

    from dense_engine.formats import load
    from dense_engine.runtime import generate
    model = load.from_pretrained("path/to/ckpt")
    out = generate.generate(model, input_ids, 64, temperature=0.0, eos_id=None, compile=True)     # [B, T + 64]
    rows = generate.generate(model, [[1, 2, 3], [4, 5]], 64, eos_id=2)                            # ragged: a list

What makes it fast, in order:
  * Decode cost follows the conversation, not the cache size. A compiled step has fixed shapes, so SDPA in it
    attends over a fixed number of cache slots: instead of the whole cache (the model's context, 8192 for SmolLM2)
    it attends over the smallest bucket that holds the positions in use, 256, 512, 1024, ... up to the cache
    length, one graph per bucket, compiled when first reached (CUDA graphs replay one per bucket). On CPU the cache
    is caches.CPUKVCache, whose attention reads only the slots in use: one graph serves every position.
  * Saved steps (steps.py): each graph is compiled once per machine and loaded by every later process.
  * A short prefill (a chat turn, up to PREFILL_CHUNK tokens) is one compiled step too, whose graph takes any number
    of tokens (a dynamic dimension: one graph, no padding; a CUDA graph is padded to one size, the padding written
    to the cache's scratch slot); a long prompt is one eager pass, whose large matmuls are its whole cost.
Ragged batches: prompts are left-padded to a common length; row_start tells each row where its tokens begin, so its
positions start at 0 and padding is never attended to. Speculative decoding (speculative.py) stands on this file's
Runner. Stands on dense.py, caches.py and steps.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

import dense
from dense_engine.runtime import caches
from dense_engine.runtime.sampling import GREEDY, SamplerSettings
from dense_engine.runtime.sampling import sample as draw
from dense_engine.runtime.steps import Steps, steps_for

MIN_BUCKET = 256
PREFILL_CHUNK = 32  # prompts up to this long prefill in one compiled step (any length); longer ones in one eager pass


def buckets(cache_len: int) -> list[int]:
    """Attention widths a cache of cache_len slots is compiled for: powers of two from 256, and cache_len itself."""
    out, b = [], MIN_BUCKET
    while b < cache_len:
        out.append(b)
        b *= 2
    return out + [cache_len]


def bucket_for(length: int, cache_len: int) -> int:
    """The smallest bucket holding `length` slots."""
    return next(b for b in buckets(cache_len) if b >= length)


def attend_width(model: dense.DenseDecoder, length: int) -> int:
    """How many slots a compiled step over `length` slots in use attends: the bucket, or the whole cache when the
    cache's attention reads only the slots in use anyway (caches.CPUKVCache: one graph serves every position)."""
    if isinstance(caches.kv_memory(model), caches.CPUKVCache):
        return model.max_seq_len
    return bucket_for(length, model.max_seq_len)


def cache_length(needed: int, context: int) -> int:
    """Cache sizes come in powers of two (>= 256) so prompts of different lengths reuse one compiled step."""
    return min(context, max(MIN_BUCKET, 1 << (needed - 1).bit_length()))


@dataclass(frozen=True)
class Sampling:
    """How a step picks the next token: settings for every row, or tuples with one per row (a server's requests),
    made from SamplerSettings by of(). A compiled step depends only on kind() and vocab_limit; the values are its
    inputs (settings(), noise()), so a new temperature reuses the step. generators: one torch.Generator per row for
    the noise (a request's seed)."""
    temperature: float | tuple = 0.0
    top_k: int | None | tuple = None
    top_p: float | None | tuple = None
    vocab_limit: int | None = None
    generators: tuple | None = None
    bias: torch.Tensor | None = None  # [B, V] float32 added to the logits (a grammar's -inf, logit_bias, penalties)
    min_p: float | None | tuple = None
    typical_p: float | None | tuple = None
    penalty: torch.Tensor | None = None  # [B, V] float32 repetition penalties (1: none), before the bias

    @classmethod
    def of(cls, asked: SamplerSettings | Sequence[SamplerSettings | None], vocab_limit: int | None,
           generators: tuple | None = None, bias: torch.Tensor | None = None,
           penalty: torch.Tensor | None = None) -> Sampling:
        """The filters a request asks for, for every row; or a list with each row's (None: an idle row, greedy)."""
        def value(name: str, idle):
            if isinstance(asked, SamplerSettings):
                return getattr(asked, name)
            return tuple(getattr(a, name) if a is not None else idle for a in asked)

        return cls(value("temperature", 0.0), value("top_k", None), value("top_p", None), vocab_limit, generators,
                   bias, value("min_p", None), value("typical_p", None), penalty)

    def per_row(self, name: str, batch: int) -> list:
        value = getattr(self, name)
        return list(value) if isinstance(value, tuple) else [value] * batch

    def kind(self, batch: int = 1) -> str:
        """"greedy" (no noise, no sort), "sampled", or "filtered" (top-k or top-p: a sort of each row), then
        "+min-p" and "+typical" when a row uses them: a graph holds the filters some row asks for, no others."""
        if all(t == 0 for t in self.per_row("temperature", batch)):
            return "greedy"
        filtered = (any(self.per_row("top_k", batch))
                    or any(p is not None and p < 1 for p in self.per_row("top_p", batch)))
        kind = "filtered" if filtered else "sampled"
        if any(self.per_row("min_p", batch)):
            kind += "+min-p"
        if any(p is not None and p < 1 for p in self.per_row("typical_p", batch)):
            kind += "+typical"
        return kind

    def settings(self, batch: int, device) -> tuple:
        """(temperature, top_k (0: off), top_p (1: off), min_p (0: off), typical_p (1: off)), each [B]: inputs of a
        step of kind "sampled" or "filtered", with noise()."""
        def values(name: str, off: float) -> torch.Tensor:
            return torch.tensor([off if v is None else v for v in self.per_row(name, batch)], dtype=torch.float32,
                                device=device)

        temperature = torch.tensor(self.per_row("temperature", batch), dtype=torch.float32, device=device)
        top_k = torch.tensor([k or 0 for k in self.per_row("top_k", batch)], device=device)
        return temperature, top_k, values("top_p", 1.0), values("min_p", 0.0), values("typical_p", 1.0)

    def noise(self, batch: int, vocab: int, device) -> torch.Tensor:
        """Exp(1) draws [B, V] on `device`, each row from its generator (drawn on the generator's own device)."""
        noise = torch.empty(batch, vocab, device=device)
        if self.generators is None:
            return noise.exponential_(1)
        for row, generator in zip(noise, self.generators):
            if generator.device.type == noise.device.type:
                row.exponential_(1, generator=generator)
            else:
                row.copy_(torch.empty(vocab, device=generator.device).exponential_(1, generator=generator))
        return noise


# ----------------------------------------------------------------------------------------------------------------
# The step functions (traced whole by torch.compile; every Python number in them is a constant of the graph)


def decode_step(model, token, input_pos, row_start, rows, attend: int, kind: str, vocab_limit: int | None,
                temperature, top_k, top_p, min_p, typical_p, noise, bias=None, penalty=None):
    """token [B, 1] at slot input_pos [1] (or [B, 1]: a slot per row) of cache rows `rows` [B] (None: 0..B-1) -> the
    next token [B, 1]. kind and vocab_limit
    shape the graph; the sampling values (Sampling.settings and noise, or None when greedy) are its inputs, and so are
    bias and penalty [B, V] when a row is constrained or penalized (a graph of its own: other batches run the step
    without them)."""
    logits = model(token, input_pos, attend=attend, row_start=row_start, rows=rows)[:, -1]
    return next_token(logits, kind, vocab_limit, temperature, top_k, top_p, min_p, typical_p, noise, bias, penalty)


def decode_logits_step(model, token, input_pos, row_start, rows, attend: int, kind: str, vocab_limit: int | None,
                       temperature, top_k, top_p, min_p, typical_p, noise, bias=None, penalty=None):
    """decode_step that also returns the float32 logits [B, V] of the model (before the bias: a server's logprobs)."""
    logits = model(token, input_pos, attend=attend, row_start=row_start, rows=rows)[:, -1]
    return next_token(logits, kind, vocab_limit, temperature, top_k, top_p, min_p, typical_p, noise, bias,
                      penalty), logits


def next_token(logits, kind: str, vocab_limit: int | None, temperature, top_k, top_p, min_p, typical_p, noise,
               bias=None, penalty=None) -> torch.Tensor:
    logits = shape_logits(logits, bias, penalty)
    if kind == "greedy":
        return draw(logits, 0.0, vocab_limit=vocab_limit)
    base, *extra = kind.split("+")
    top_k, top_p = (top_k, top_p) if base == "filtered" else (None, None)
    min_p = min_p if "min-p" in extra else None
    typical_p = typical_p if "typical" in extra else None
    return draw(logits, temperature, top_k, top_p, vocab_limit, noise, min_p, typical_p)


def sample(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits [B, V] -> the next tokens [B, 1], eagerly, by the compiled decode step's rule (next_token) with the
    same inputs: a first token after a prefill, a speculative round's token of the target's own."""
    B, V = logits.shape
    kind = sampling.kind(B)
    values = (None,) * 6 if kind == "greedy" else (*sampling.settings(B, logits.device),
                                                   sampling.noise(B, V, logits.device))
    bias = None if sampling.bias is None else sampling.bias.to(logits.device)
    penalty = None if sampling.penalty is None else sampling.penalty.to(logits.device)
    return next_token(logits, kind, sampling.vocab_limit, *values, bias, penalty)


def shape_logits(logits, bias=None, penalty=None):
    """logits [B, V] with the repetition penalties [B, V] (a token's positive logit divided by its penalty, a negative
    one multiplied: CTRL's rule, as transformers and llama.cpp apply it), then the bias [B, V] added."""
    if penalty is not None:
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return logits if bias is None else logits + bias


def prefill_step(model, tokens, input_pos, row_start, attend: int, last, rows=None):
    """tokens [B, T] at slots input_pos [T] (of cache rows `rows`) -> hidden state [B, C] of the token at index
    `last` [1] (the head is applied to one position only, by the caller)."""
    hidden = model.hidden_states(tokens, input_pos, attend, row_start, rows)
    return hidden.index_select(1, last)[:, 0]


def logits_step(model, tokens, input_pos, row_start, attend: int):
    """tokens [B, T] at slots input_pos [T] -> float32 logits [B, T, V] and the hidden states [B, T, C] they come from
    (speculative decoding's verify step: an MTP draft goes on from the hidden states)."""
    hidden = model.hidden_states(tokens, input_pos, attend, row_start)
    return model.logits(hidden), hidden


# ----------------------------------------------------------------------------------------------------------------
# Prefill and decode


class Runner:
    """Feeds one model: eager calls, or the compiled steps of `steps` (None: eager)."""

    def __init__(self, model: dense.DenseDecoder, steps: Steps | None) -> None:
        self.model, self.steps = model, steps
        self.sampling_inputs: dict = {}  # (settings, batch) -> their tensors, made once (no copy to the GPU per token)
        self.slot_ids = torch.empty(0, dtype=torch.long)

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Slot numbers start..end-1 [end - start], a view of one tensor on the model's device: a step's positions
        without a host-to-device copy (on a GPU, one per token would wait for the queue to drain)."""
        if self.slot_ids.numel() < end or self.slot_ids.device != self.model.device:
            self.slot_ids = torch.arange(max(end, self.model.max_seq_len + 1), device=self.model.device)
        return self.slot_ids[start:end]

    def sampling_values(self, sampling: Sampling, batch: int) -> tuple:
        """The step's sampling inputs: (None,) * 6 when greedy, else the settings' tensors (kept) and fresh noise."""
        if sampling.kind(batch) == "greedy":
            return (None,) * 6
        V, device = self.model.config.vocab_size, self.model.device
        key = (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.typical_p, batch)
        if key not in self.sampling_inputs:
            self.sampling_inputs = {key: sampling.settings(batch, device)}
        return (*self.sampling_inputs[key], sampling.noise(batch, V, device))

    @torch.no_grad()  # (compiled steps are inference graphs: the cache key assumes no autograd)
    def prefill(self, tokens: torch.Tensor, start: int, row_start: torch.Tensor | None,
                rows: torch.Tensor | None = None, every: bool = False) -> torch.Tensor:
        """Write tokens [B, T] at slots start.. (of cache rows `rows`, default 0..B-1), return the float32 logits of
        the last one, [B, V] (every: of every one, [B, T, V], eagerly). Up to PREFILL_CHUNK tokens (a chat turn, a
        short prompt) run one compiled step; a longer prompt runs one eager pass: its large matmuls are the whole
        cost and run best in one piece (measured: BENCHMARKS.md)."""
        model, device = self.model, tokens.device
        B, T = tokens.shape
        fn = None
        if self.steps is not None and T <= PREFILL_CHUNK and not every:
            if self.steps.saved:  # (CPU) one graph for lengths 2..PREFILL_CHUNK (1 is padded: Dynamo compiles 1 apart)
                n, dynamic = max(T, 2), {"dims": [[1, 1], [2, 0]], "range": [2, PREFILL_CHUNK]}  # chunk, slots
            else:  # a CUDA graph replays one length
                n, dynamic = PREFILL_CHUNK, None
            slots = torch.arange(start, start + n, device=device)
            slots[T:] = model.max_seq_len  # padding goes to the scratch slot
            chunk = torch.nn.functional.pad(tokens, (0, n - T))
            attend = attend_width(model, start + T)
            args = (model, chunk, slots, row_start, attend, self.slots(T - 1, T), rows)
            fn = self.steps.get("prefill", prefill_step, args, batch=B, tokens=PREFILL_CHUNK, attend=attend,
                                ragged=row_start is not None, rows=rows is not None, dynamic=dynamic)
        if fn is None:  # eager (also while the step compiles in the background)
            causal = start == 0 and row_start is None  # nothing else in the cache: SDPA's causal kernel on its own keys
            hidden = model.hidden_states(tokens, torch.arange(start, start + T, device=device), row_start=row_start,
                                         rows=rows, causal=causal)
            return model.logits(hidden if every else hidden[:, -1])
        return model.logits(fn(*args))

    @torch.no_grad()
    def prefill_rows(self, chunks: list[list[int]], starts: list[int], rows: torch.Tensor) -> torch.Tensor:
        """Several rows' prompts (or chunks of them) in one eager pass, the weights read once: chunk b at slots
        starts[b].. of cache row rows[b] -> float32 logits [B, V] of each chunk's last token. A shorter chunk is
        padded at its end with tokens at the scratch slot (written, never read; a state layer leaves its state as it
        was for them)."""
        model, device = self.model, rows.device
        T = max(len(c) for c in chunks)
        tokens = torch.tensor([c + [0] * (T - len(c)) for c in chunks], device=device)  # [B, T]
        offsets = torch.arange(T, device=device)
        positions = torch.where(offsets < torch.tensor([len(c) for c in chunks], device=device)[:, None],
                                torch.tensor(starts, device=device)[:, None] + offsets, model.max_seq_len)  # [B, T]
        attend = max(s + len(c) for s, c in zip(starts, chunks))  # (the padding sees what its row holds)
        hidden = model.hidden_states(tokens, positions, attend, rows=rows)  # [B, T, C]
        last = torch.tensor([len(c) - 1 for c in chunks], device=device)
        return model.logits(hidden[torch.arange(len(chunks), device=device), last])

    @torch.no_grad()
    def decode(self, token: torch.Tensor, pos, row_start, sampling: Sampling, with_logits: bool = False,
               rows: torch.Tensor | None = None):
        """token [B, 1] at slot pos (an int, or a list: a slot per row) of cache rows `rows` [B] (None: 0..B-1) -> next
        token [B, 1] (with_logits: and the float32 logits [B, V] it was sampled from)."""
        model, B = self.model, token.shape[0]
        per_row = isinstance(pos, (list, tuple))  # (a server's rows: one small copy per step)
        input_pos = torch.tensor([[p] for p in pos], device=token.device) if per_row else self.slots(pos, pos + 1)
        kind = sampling.kind(B)
        values = self.sampling_values(sampling, B)
        last = max((p for p in pos if p < model.max_seq_len), default=0) if per_row else pos  # (idle rows: scratch)
        attend = None if self.steps is None else attend_width(model, min(last + 1, model.max_seq_len))
        biased = sampling.bias is not None or sampling.penalty is not None
        if biased:  # (one graph takes both: a row without one gets zeros / ones)
            V = model.config.vocab_size
            bias = sampling.bias if sampling.bias is not None else torch.zeros(B, V, device=token.device)
            penalty = sampling.penalty if sampling.penalty is not None else torch.ones(B, V, device=token.device)
        args = (model, token, input_pos, row_start, rows, attend, kind, sampling.vocab_limit, *values,
                *((bias, penalty) if biased else ()))
        step_fn = decode_logits_step if with_logits else decode_step
        fn = None if self.steps is None else self.steps.get(
            "decode_logits" if with_logits else "decode", step_fn, args, batch=B, attend=attend, sampling=kind,
            vocab_limit=sampling.vocab_limit, ragged=row_start is not None, per_row=per_row,
            **({"biased": True} if biased else {}), **({"rows": True} if rows is not None else {}))
        if self.steps is not None:
            self.steps.decoded["eager" if fn is None else "compiled"] += 1
        if fn is None:  # eager (also while the step compiles in the background): attend over the slots in use
            return step_fn(model, token, input_pos, row_start, rows, None, *args[6:])
        out = fn(*args)  # (cloned: a CUDA graph reuses its output buffers)
        return tuple(t.clone() for t in out) if with_logits else out.clone()

    @torch.no_grad()
    def prefill_hidden(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """prefill's writes, eagerly, returning the hidden states of every token [B, T, C] (an MTP draft reads them)."""
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        return self.model.hidden_states(tokens, positions, causal=start == 0)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, pos: int, row_start=None, real: int | None = None, hidden: bool = False):
        """Logits [B, T, V] of tokens [B, T] at slots pos.. (the verify step of speculative decoding); real: only the
        first `real` tokens count, the rest (a fixed width's padding) go to the scratch slot and change no state.
        hidden: (logits, the hidden states [B, T, C])."""
        model, T = self.model, tokens.shape[1]
        input_pos = torch.arange(pos, pos + T, device=tokens.device)
        input_pos = torch.where(input_pos < pos + (T if real is None else real), input_pos, model.max_seq_len).clamp(
            max=model.max_seq_len)
        fn = None
        if self.steps is not None:
            attend = attend_width(model, min(pos + T, model.max_seq_len))
            args = (model, tokens, input_pos, row_start, attend)
            fn = self.steps.get("verify", logits_step, args, batch=tokens.shape[0], tokens=T, attend=attend,
                                ragged=row_start is not None)
            self.steps.decoded["eager" if fn is None else "compiled"] += 1
        if fn is None:  # (the slots its real tokens reach: padding at the scratch slot attends no further)
            out = logits_step(model, tokens, input_pos, row_start, min(pos + T, model.max_seq_len))
        else:
            out = fn(*args)
        return out if hidden else out[0]


def as_batch(prompts, device) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """A [B, T] tensor as is, or a list of prompts (lists or 1-D tensors of ids) left-padded with id 0 ->
    (ids [B, T], row_start [B] or None when no row is padded, lengths)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got {list(prompts.shape)}")
        return prompts, None, [prompts.shape[1]] * prompts.shape[0]
    rows = [torch.as_tensor(p, dtype=torch.long, device="cpu").reshape(-1) for p in prompts]
    if not rows or any(r.numel() == 0 for r in rows):
        raise ValueError("every prompt needs at least one token")
    lengths = [r.numel() for r in rows]
    T = max(lengths)
    ids = torch.zeros(len(rows), T, dtype=torch.long, device="cpu")  # (filled on the host, then moved once)
    for i, r in enumerate(rows):
        ids[i, T - r.numel():] = r
    start = torch.tensor([T - n for n in lengths], device=device)
    return ids.to(device), (start if int(start.max()) > 0 else None), lengths


@torch.no_grad()
def generate_tokens(model: dense.DenseDecoder, prompts, max_new_tokens: int, *,
                    sampler: SamplerSettings = GREEDY, compile: bool = False, start_pos: int = 0,
                    vocab_limit: int | None = None, steps: Steps | None = None, constraint=None,
                    dry=None) -> Iterator[torch.Tensor]:
    """Yield max_new_tokens new tokens [B, 1], one per step. prompts: [B, T] ids, or a list of prompts of any
    lengths (left-padded; every row's positions start at 0). The prompt is prefilled at slots start_pos..; slots
    before start_pos must already hold this conversation (a chat continuing it). The last token yielded has not been
    fed to the model yet. compile=True (or steps) runs compiled, bucketed steps. sampler: what to draw with (its
    repetition penalty is a [B, V] input of the step, made on the device, over the last repeat_last_n tokens of the
    prompt and the reply). constraint (batch 1; grammar.py): every token is one its grammar allows (a host read per
    token). dry (sampler.dry_for(vocab)) penalizes what would repeat the context, in the bias (a host read per
    token)."""
    runner, ids, row_start = prepare(model, prompts, max_new_tokens, start_pos, compile, steps)
    T = ids.shape[1]
    V = model.config.vocab_size
    recent = Recent(ids, row_start, sampler.repetition_penalty, sampler.repeat_last_n, V)
    rows = ([row[int(row_start[i]) if row_start is not None else 0:].tolist() for i, row in enumerate(ids)] if dry
            else [])

    def bias_now() -> torch.Tensor | None:  # [B, V]: the grammar's and DRY's
        bias = constraint.bias(ids.device)[None] if constraint is not None else None
        if dry is not None:
            penalties = -torch.stack([dry.penalty(row, V) for row in rows]).to(ids.device)
            bias = penalties if bias is None else bias + penalties
        return bias

    logits = runner.prefill(ids, start_pos, row_start)
    sampling = Sampling.of(sampler, vocab_limit, bias=bias_now(), penalty=recent.penalties())
    token = sample(logits, sampling)
    yield token
    for i in range(max_new_tokens - 1):  # the token stays on the device: nothing here waits for the GPU
        if constraint is not None:
            constraint.consume(int(token))
        for row, t in zip(rows, token[:, 0].tolist() if dry is not None else []):
            row.append(t)
        if constraint is not None or dry is not None:
            sampling = dataclasses.replace(sampling, bias=bias_now())
        if recent.on:
            recent.add(token)
            sampling = dataclasses.replace(sampling, penalty=recent.penalties())
        token = runner.decode(token, start_pos + T + i, row_start, sampling)
        yield token


class Recent:
    """The tokens a repetition penalty looks at: the last `window` (-1: all) of each row's prompt and reply, on the
    device; penalties() is the step's [B, V] input (penalty at those tokens, 1 elsewhere), or None when off."""

    def __init__(self, ids: torch.Tensor, row_start: torch.Tensor | None, penalty: float, window: int, V: int) -> None:
        self.on, self.penalty, self.window, self.V = penalty != 1 and window != 0, penalty, window, V
        if row_start is not None:  # a left-padded row's padding counts as no token (column V, dropped)
            ids = ids.masked_fill(torch.arange(ids.shape[1], device=ids.device) < row_start[:, None], V)
        self.tokens = ids

    def add(self, token: torch.Tensor) -> None:
        self.tokens = torch.cat([self.tokens, token], dim=1)
        if self.window > 0:
            self.tokens = self.tokens[:, -self.window:]

    def penalties(self) -> torch.Tensor | None:
        if not self.on:
            return None
        seen = self.tokens if self.window < 0 else self.tokens[:, -self.window:]
        out = torch.ones(seen.shape[0], self.V + 1, device=seen.device)
        return out.scatter_(1, seen, self.penalty)[:, :self.V]


def ahead(tokens: Iterable[torch.Tensor], late: bool = True) -> Iterator[list[int]]:
    """Each token [B, 1] of a stream as host ints, one step late: the next step is queued before the host waits for
    this one's copy, so a GPU never idles while the host prints (on the CPU there is nothing to overlap: as is).
    late=False: as is on any device (a state layer's model: a token the reader stops at must not have been fed)."""
    pending = None
    for token in tokens:
        if token.device.type == "cpu" or not late:
            yield token[:, 0].tolist()
            continue
        copied = to_host(token)
        if pending is not None:
            yield wait(pending)
        pending = copied
    if pending is not None:
        yield wait(pending)


def to_host(token: torch.Tensor) -> tuple:
    """token [B, 1]'s copy into host memory, queued after what the device runs now (pinned, not waited for on a GPU),
    and the event that says it is there (None on the CPU): wait() reads it."""
    if token.device.type != "cuda":
        return token[:, 0], None
    done = torch.cuda.Event()
    copy = token[:, 0].to("cpu", non_blocking=True)
    done.record()
    return copy, done


def wait(pending: tuple) -> list[int]:
    """to_host's copy as host ints, once it is there."""
    copy, done = pending
    if done is not None:
        done.synchronize()
    return copy.tolist()


def prepare(model: dense.DenseDecoder, prompts, max_new_tokens: int, start_pos: int, compile: bool,
          steps: Steps | None) -> tuple[Runner, torch.Tensor, torch.Tensor | None]:
    """What every generation loop does first: check the lengths, make sure the cache holds the prompt and the new
    tokens, and pick eager or compiled steps. Returns (runner, ids [B, T], row_start or None)."""
    ids, row_start, _ = as_batch(prompts, model.device)
    B, T = ids.shape
    needed = start_pos + T + max_new_tokens - 1
    if needed > model.config.max_position_embeddings:
        raise ValueError(f"{start_pos + T} tokens + {max_new_tokens} new exceed the context of "
                         f"{model.config.max_position_embeddings}")
    cache = caches.memories(model)[0]
    held = next(cache.buffers(), None)  # (None: no cache set up yet)
    moved = held is not None and held.device != model.device  # (after model.to())
    if model.max_seq_len < needed or model.max_batch_size < B or moved:
        if start_pos:
            raise ValueError(f"the cache ({model.max_seq_len} tokens) is too small to continue to {needed} tokens")
        length = cache_length(needed, model.config.max_position_embeddings)
        caches.setup_cache(model, max(B, model.max_batch_size), length, kv_dtype=None)  # (the kind it holds now)
    if row_start is not None and start_pos:
        raise ValueError("a ragged batch starts a new cache (start_pos must be 0)")
    return Runner(model, steps or (steps_for(model) if compile else None)), ids, row_start


@torch.no_grad()
def generate(model: dense.DenseDecoder, prompts, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | Sequence[int] | None = None,
             compile: bool = False, vocab_limit: int | None = None, steps: Steps | None = None):
    """[B, T] prompt -> [B, T + new] ids; rows that produced an eos id are padded with it, and generation stops once
    every row has. A list of prompts -> a list of 1-D tensors of each row's new ids, up to and including its eos."""
    tokens = generate_tokens(model, prompts, max_new_tokens, sampler=SamplerSettings(temperature, top_k, top_p),
                             compile=compile, vocab_limit=vocab_limit, steps=steps)
    return collect(tokens, prompts, eos_id, model.device)


def collect(tokens: Iterable[torch.Tensor], prompts, eos_id: int | Sequence[int] | None, device,
            check_every: int | None = None):
    """generate()'s result from a stream of new tokens [B, 1] (this file's, or speculative.py's). Whether every row
    is done is read every check_every tokens (default: 1 on the CPU, 8 elsewhere, where a read waits for the device);
    the result is the same either way."""
    ids, _, _ = as_batch(prompts, device)
    eos = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id or []), device=device)
    done = torch.zeros(ids.shape[0], 1, dtype=torch.bool, device=device)
    check_every = check_every or (1 if torch.device(device).type == "cpu" else 8)
    new = []
    for token in tokens:
        if len(eos):
            if new:
                token = torch.where(done, new[-1], token)  # a finished row repeats its eos
            done = done | torch.isin(token, eos)
        new.append(token)
        if len(eos) and len(new) % check_every == 0 and bool(done.all()):
            break
    out = torch.cat(new, dim=1) if new else ids[:, :0]
    if len(eos) and len(new) and bool(done.all()):  # (tokens past the step where the last row finished: dropped)
        out = out[:, : int(torch.isin(out, eos).int().argmax(dim=1).max()) + 1]
    if isinstance(prompts, torch.Tensor):
        return torch.cat([ids, out], dim=1)
    rows = []
    for row in out:
        hits = torch.isin(row, eos).nonzero() if len(eos) else []
        rows.append(row[: int(hits[0]) + 1] if len(hits) else row)
    return rows
