"""session.py: Session, generation over a KV cache that outlives a reply (a conversation's turns prefill only what
is new), with its Settings record (what it asks of the sampler: sampling.py); a program's model by its load record
and the compiled steps it runs.
chat.py, the Python API (dense_engine/api.py), benchmark.py and the server share it; the flags that make one are the
CLI's (dense_engine/cli/flags.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

import dense
from dense_engine.formats import load as loading
from dense_engine.formats.load import LoadRecord
from dense_engine.formats.vocab import TextStream, Vocabulary
from dense_engine.runtime import background, caches, generate, speculative, tp
from dense_engine.runtime.sampling import SamplerSettings
from dense_engine.runtime.steps import Steps
from dense_engine.system import machine
from dense_engine.system.errors import UsageError

# ----------------------------------------------------------------------------------------------------------------
# A conversation over one static KV cache


@dataclass
class ReplyStats:
    tokens: int = 0
    prefilled: int = 0
    reused: int = 0  # prompt tokens the cache held already (not prefilled)
    ttft_s: float = 0.0
    total_s: float = 0.0
    compile_s: float | None = None
    interrupted: bool = False
    speculation: dict | None = None  # proposed, accepted, target_steps
    eager_steps: int = 0  # decode (or verify) steps run eagerly (no compiled step, or while it compiles elsewhere)
    compiled_steps: int = 0

    def line(self) -> str:
        decode_s = self.total_s - self.ttft_s
        rate = f"{(self.tokens - 1) / decode_s:.1f} tok/s" if self.tokens > 1 and decode_s > 0 else "- tok/s"
        text = (f"{self.tokens} tokens, {rate}{self.steps()}, first token {self.ttft_s * 1000:.0f} ms, "
                f"prefilled {self.prefilled} tokens")
        spec = self.speculation
        if spec and spec.get("target_steps"):
            rate = spec["accepted"] / spec["proposed"] if spec["proposed"] else 0.0
            text += (f", drafts accepted {rate:.0%} ({(self.tokens - 1) / spec['target_steps']:.2f} tokens per "
                     "target step)")
        if self.compile_s:
            text += f", steps compiled in {self.compile_s:.1f} s"
        return text + (" (interrupted)" if self.interrupted else "")

    def steps(self) -> str:
        """Which steps made the tokens after the first (speculation: the target's verify steps)."""
        eager, compiled = self.eager_steps, self.compiled_steps
        if not eager and not compiled:
            return ""
        if not eager or not compiled:
            return " (compiled step)" if compiled else " (eager)"
        return f" (eager for {eager} {'steps' if self.speculation is not None else 'tokens'}, then the compiled step)"


def load_model(record: LoadRecord, checkpoint=None) -> dense.DenseDecoder:
    """The model a load record describes (checkpoint: the one load.plan read, so it is not read again); under
    torchrun, this rank's shard."""
    loader = tp.from_pretrained if tp.world()[1] > 1 else loading.from_pretrained
    if checkpoint is None and record.lora:  # (the background compiler's load: the same adapters merged)
        checkpoint = loading.read_with_adapters(record.path, record.lora)
    return loader(checkpoint or record.path, device=record.device, dtype=record.dtype, quant=record.quant or "none")


def steps_for_program(model, batch: int, seq_len: int, record: LoadRecord, status=None, note=None) -> Steps:
    """The compiled steps of a program's model: a step not compiled yet on this machine is compiled by a background
    process while the program answers eagerly (background.py), where that can be done (a model loaded from a
    checkpoint, on the CPU, in one process): the process loads it again by its record; else compiled here, before
    answering. note(message): one line about background compiles."""
    compiler = None
    if (background.enabled() and record.path and model.device.type == "cpu" and tp.world()[1] == 1
            and machine.unwritable_cache() is None):
        compiler = background.Compiler(record, batch=batch, seq_len=seq_len, status=note)
    return Steps(model, status=status, background=compiler)


@dataclass
class Settings:
    """How a Session answers: what it asks of the sampler, the longest reply, and the draft tokens a speculative step
    checks. (The cache's length and compiled steps are the load's: LoadRecord.)"""
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    max_new_tokens: int = 512
    speculate_k: int = 4
    sources: dict = field(default_factory=dict)  # where each of the sampler's values came from (sampling.describe)


def common_prefix(cached: list[int], prompt: list[int], whole: bool = False) -> int:
    """How many of prompt's first tokens a cache holding `cached` already has: the shared prefix, leaving at least
    one token of the prompt to prefill (its logits give the first new token). whole: all of `cached` or nothing (a
    state layer holds where it ends: it goes on from there or starts again, never from before)."""
    n, limit = 0, min(len(cached), len(prompt) - 1)
    while n < limit and cached[n] == prompt[n]:
        n += 1
    return 0 if whole and n < len(cached) else n


class Session:
    """Generation over a cache that outlives a reply: `cached` lists the tokens whose keys/values sit in the cache
    at positions 0.. len(cached) - 1, so the next prompt prefills only what follows its common prefix with them."""

    def __init__(self, model, vocab: Vocabulary, settings: Settings | None = None, load: LoadRecord | None = None,
                 status=None, draft=None, note=None) -> None:
        self.model, self.vocab, self.settings, self.draft = model, vocab, settings or Settings(), draft
        load = load or LoadRecord()
        self.max_seq_len = caches.fitting_cache(model, 1, load.max_seq_len, load.kv_dtype)
        caches.setup_cache(model, 1, self.max_seq_len, load.kv_dtype)
        self.steps = steps_for_program(model, 1, self.max_seq_len, load, status, note) if load.compile else None
        if load.compile and getattr(draft, "record", None) is not None:  # a draft loaded from the checkpoint
            draft.steps = steps_for_program(draft.model, 1, self.max_seq_len, draft.record, status, note)
        self.cached: list[int] = []
        self.prefilled = self.reused = 0  # prompt tokens prefilled by the replies / found in the cache, in all (/stats)
        self.compile_s: float | None = None
        self.last, self.reply_ids = ReplyStats(), []  # the last reply's stats and tokens
        self.stop = None  # a function called after each token (every rank, under torchrun); True stops the reply
        self.constraint = None  # a function making each reply's grammar.Constraint (chat.py --json-schema)

    def warm_up(self) -> float:
        """Load (or compile: in the background the first time on this machine) the prefill and decode steps a first
        reply needs, and run the eager prefill once (its first call sets up the matmul libraries: 0.3 s), on
        throwaway tokens, so that the first reply is not slowed by it. Returns the seconds spent compiling here."""
        list(self.generate([0] * (generate.PREFILL_CHUNK + 1), 2, start_pos=0))
        list(self.generate([0], 3, start_pos=0))
        self.cached = []
        if self.draft is not None:
            self.draft.reset()
        compiled = self.steps.compile_s if self.steps is not None else 0.0
        return compiled + (self.draft_steps_compile_s() if self.draft is not None else 0.0)

    def draft_steps_compile_s(self) -> float:
        runner = getattr(self.draft, "runner", None)
        return runner.steps.compile_s if runner is not None and runner.steps is not None else 0.0

    def generate(self, new_ids: list[int], max_new: int, start_pos: int, context: list[int] | None = None,
                 stats: dict | None = None):
        sampler = self.settings.sampler
        ids = torch.tensor([new_ids], device=self.model.device)
        vocab_limit = self.vocab.size if self.vocab.size < self.model.config.vocab_size else None
        if self.draft is None:
            constraint = self.constraint() if self.constraint is not None else None
            return generate.generate_tokens(self.model, ids, max_new, sampler=sampler, start_pos=start_pos,
                                            vocab_limit=vocab_limit, steps=self.steps, constraint=constraint,
                                            dry=sampler.dry_for(self.vocab))
        if not sampler.plain:
            raise UsageError("repetition-penalty, DRY and the other penalties are not served with speculative decoding")
        return speculative.generate_tokens(self.model, ids, max_new, self.draft, speculate_k=self.settings.speculate_k,
                                           sampler=sampler, start_pos=start_pos, vocab_limit=vocab_limit,
                                           steps=self.steps, stats=stats,
                                           context=self.cached[:start_pos] if context is None else context)

    def room(self, prompt_len: int) -> int:
        return min(self.settings.max_new_tokens, self.max_seq_len - prompt_len)

    def stream(self, prompt_ids: list[int]) -> Iterator[str]:
        """Generate after prompt_ids, yielding the reply's text as it grows (pieces that are whole characters). When
        it ends (a stop token, the length, Ctrl-C, or the consumer closing it), self.last holds its ReplyStats and
        self.reply_ids its tokens. Ctrl-C stops the reply, not the session."""
        stateful = caches.has_state(self.model)
        common = common_prefix(self.cached, prompt_ids, whole=stateful)
        stats = ReplyStats(prefilled=len(prompt_ids) - common, reused=common, compile_s=self.compile_s,
                           speculation={} if self.draft is not None else None)
        self.prefilled += stats.prefilled
        self.reused += common
        self.compile_s, self.last, self.reply_ids = None, stats, []
        text, generated, yielded = TextStream(self.vocab), self.reply_ids, 0
        decoded = dict(self.steps.decoded) if self.steps is not None else None
        start = time.perf_counter()
        try:
            tokens = self.generate(prompt_ids[common:], self.room(len(prompt_ids)), common, prompt_ids[:common],
                                   stats.speculation)
            for (token,) in generate.ahead(tokens, late=not stateful):  # (on a GPU the next step is queued
                # before this one is read; a state must not take a token the reply stops at)
                yielded += 1
                if yielded == 1:
                    stats.ttft_s = time.perf_counter() - start
                if token in self.vocab.stop_ids:
                    break
                generated.append(token)
                if piece := text.push(token):
                    yield piece
                if self.stop is not None and self.stop():
                    stats.interrupted = True
                    break
        except KeyboardInterrupt:
            stats.interrupted = True
        finally:  # (also when the consumer stops early: the cache's bookkeeping stays right)
            stats.total_s, stats.tokens = time.perf_counter() - start, yielded
            if decoded is None:
                stats.eager_steps = max(yielded - 1, 0) if stats.speculation is None else 0
            else:
                stats.eager_steps = self.steps.decoded["eager"] - decoded["eager"]
                stats.compiled_steps = self.steps.decoded["compiled"] - decoded["compiled"]
            # every yielded token but the last was fed back, so the cache now holds these positions
            self.cached = (prompt_ids + generated)[: len(prompt_ids) + max(yielded - 1, 0)]
            if stateful and self.draft is not None:  # (a round's accepted drafts past the reply's end are in the
                self.cached = []  # state: the next prompt starts again)
        if rest := text.finish():
            yield rest

    def save_cache(self, path: str, tokens: int | None = None) -> int:
        """The first `tokens` (default all) the cache holds, with their keys and values, into a cache file
        (caches.write: sealed, the model's key in it): how many."""
        n = len(self.cached) if tokens is None else min(tokens, len(self.cached))
        layers = caches.copy_slots(self.model, 0, 0, caches.whole_slots(n))
        caches.write(path, self.cached[:n], layers, {"model": self.model_key()})
        return n

    def load_cache(self, path: str) -> int:
        """A cache file's tokens and their keys and values into the cache (the next prompt that starts with them
        prefills only the rest): how many; ValueError (or OSError) saying why it cannot be used."""
        tokens, layers = caches.read_whole(path, caches.like(self.model), self.model_key(), self.max_seq_len)
        caches.put_slots(self.model, 0, 0, layers)
        self.cached = tokens
        if self.draft is not None:
            self.draft.reset()  # (a draft model's own cache does not hold them)
        return len(tokens)

    def model_key(self) -> str:
        if getattr(self, "_model_key", None) is None:
            self._model_key = caches.model_key(self.model)
        return self._model_key

    def reply(self, prompt_ids: list[int], write) -> tuple[list[int], ReplyStats]:
        """stream(), each piece through write(str); Ctrl-C while a piece is written stops the reply there too."""
        pieces = self.stream(prompt_ids)
        try:
            for piece in pieces:
                write(piece)
        except KeyboardInterrupt:
            pieces.close()
            self.last.interrupted = True
        return self.reply_ids, self.last
