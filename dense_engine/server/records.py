"""The server's records: a Request (what it asks of the sampler, its Status), its Shaping (what moves its logits
besides the sampler) and its Output (what its client is sent, as Events), its Timing; a Row per cache row. The
scheduler (scheduler.py), its runner (runner.py) and its prefix cache (prefixes.py) read and write them; the HTTP
side makes the Requests (app.py) and reads their Events (responses.py)."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import NamedTuple

import torch

from dense_engine.formats.vocab import StopText, TextStream
from dense_engine.runtime.sampling import SamplerSettings


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
    """What a request's client is sent so far: Events, to `sink` (the HTTP side puts them on an asyncio queue of its
    loop), with its choice's `index`; its stop strings, the generated text decoded as it grows, cut at a stop string
    (a tail that may start one held back), and the logprob entries of tokens whose text is not sent."""
    stop: list[str]
    sink: Callable[[Event], None]
    index: int = 0
    text: TextStream | None = None
    held: StopText | None = None
    entries: list = field(default_factory=list)

    def send(self, kind: str, text: str, entries: list) -> None:
        self.sink(Event(self.index, kind, text, entries))

    def send_text(self, text: str) -> None:
        if text:  # (logprob entries wait for the text their tokens make)
            self.send("text", text, self.take_entries())

    def take_entries(self) -> list:
        entries, self.entries = self.entries, []
        return entries


@dataclass
class Shaping:
    """What moves a request's logits besides its sampler settings: its grammar (a grammar.Constraint: the tokens it
    allows), its DRY sampler (SamplerSettings.dry_for), and each generated token's count (presence and frequency).
    Its rules take the request's sampler settings and its tokens so far (prompt, generated)."""
    constraint: object = None
    dry: object = None
    counts: dict = field(default_factory=dict)

    def moves(self, s: SamplerSettings) -> bool:
        """Whether it (or a bias or penalty of the settings) moves the logits: the plain sampler does not pick."""
        return (self.constraint is not None or bool(s.logit_bias) or bool(s.presence_penalty or s.frequency_penalty)
                or s.penalized or self.dry is not None)

    def penalty(self, s: SamplerSettings, prompt: list[int], generated: list[int], vocab: int
                ) -> torch.Tensor | None:
        """[V] float32 repetition penalties (generate.shape_logits' rule), or None: none."""
        if not s.penalized:
            return None
        seen = prompt + generated
        seen = seen if s.repeat_last_n < 0 else seen[-s.repeat_last_n:]
        out = torch.ones(vocab)
        out[seen] = s.repetition_penalty
        return out

    def bias(self, s: SamplerSettings, prompt: list[int], generated: list[int], vocab: int) -> torch.Tensor | None:
        """[V] float32 added to the logits before sampling (OpenAI's semantics), or None: none."""
        penalties = self.counts and (s.presence_penalty or s.frequency_penalty)
        if self.constraint is None and not s.logit_bias and not penalties and self.dry is None:
            return None
        bias = self.constraint.bias("cpu") if self.constraint is not None else torch.zeros(vocab)
        if s.logit_bias:
            bias[list(s.logit_bias)] += torch.tensor(list(s.logit_bias.values()))
        if penalties:
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            bias[list(self.counts)] -= s.presence_penalty + s.frequency_penalty * counts
        if self.dry is not None:
            bias -= self.dry.penalty(prompt + generated, vocab)
        return bias

    def chose(self, s: SamplerSettings, token: int, stop_ids) -> None:
        """A token was chosen: the grammar and (for the penalties) the counts move on."""
        if token in stop_ids:
            return
        if self.constraint is not None:
            self.constraint.consume(token)
        if s.presence_penalty or s.frequency_penalty:
            self.counts[token] = self.counts.get(token, 0) + 1


@dataclass
class Timing:
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None


@dataclass
class Request:
    """One completion: its prompt ids, what it asks of the sampler (and its own noise: its sampled text depends on
    nothing else), its Shaping and its Output (stop and sink go into it: sink takes the Events its client is told)."""
    prompt: list[int]
    max_tokens: int
    sampler: SamplerSettings
    stop: InitVar[list[str]]
    generator: torch.Generator
    sink: InitVar[Callable[[Event], None]]
    index: int = 0  # its choice's index (a completion request may carry several prompts)
    follows: Request | None = None  # the first of n choices of its prompt: prefilled once, in that one's row, whose
    #                                 cache this one's row copies (PrefixCache.share_prefills)
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

    def __post_init__(self, stop, sink) -> None:
        self.output = Output(list(stop), sink, self.index)

    @property
    def constraint(self):
        return self.shaping.constraint

    @property
    def shaped(self) -> bool:
        """Whether something but the sampler picks its tokens (logprobs, echo, a grammar, a bias or penalties)."""
        return self.logprobs is not None or self.echo or self.shaping.moves(self.sampler)

    @property
    def waits(self) -> bool:
        """Whether a choice waits for the first choice of its prompt to finish prefilling it (n > 1)."""
        leader = self.follows
        return leader is not None and leader.status in (Status.WAITING, Status.PREFILLING) and not leader.cancelled

    def penalty(self, vocab: int) -> torch.Tensor | None:
        """[V] float32 repetition penalties (its Shaping's rule), or None: none."""
        return self.shaping.penalty(self.sampler, self.prompt, self.generated, vocab)

    def bias(self, vocab: int) -> torch.Tensor | None:
        """[V] float32 added to its logits before sampling (its Shaping's), or None: none."""
        return self.shaping.bias(self.sampler, self.prompt, self.generated, vocab)

    def send(self, kind: str, text: str, entries: list) -> None:
        self.output.send(kind, text, entries)

    def end(self, reason: str, entries: list | None = None) -> None:
        self.finish_reason, self.status = reason, Status.FINISHED
        self.output.send("done", reason, self.output.take_entries() if entries is None else entries)


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
