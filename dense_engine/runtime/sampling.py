"""sampling.py: SamplerSettings, what one request asks of the sampler. Each front end makes one (the server from a
body, protocol.py; chat.py from its flags and /set, cli/flags.py and cli/repl.py; the Python API from its keywords,
api.py) and hands it whole to generation: generate.Sampling.of turns it (one, or one per row of a server's batch)
into the inputs of a step, and generate.sample / generate.next_token are the one rule every token is drawn by.
Also here: the sampler itself (sample, probabilities): temperature, top-k, top-p, then the filters the APIs ask for
beyond them (min-p, typical: last_filters), as numbers or as [B] tensors (a compiled step's inputs)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dense_engine.runtime import dry


@dataclass(frozen=True)
class SamplerSettings:
    """temperature 0 is greedy; a filter set to None is off (top_k, top_p, min_p, typical_p), and so is a
    repetition_penalty of 1, a dry_multiplier of 0 and a penalty of 0. seed: the server's noise of a request (chat.py
    seeds the process instead)."""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float = 1.0  # of the tokens among the last repeat_last_n (-1: all) of prompt and reply
    repeat_last_n: int = 64
    dry_multiplier: float = 0.0  # DRY (dry.py): what would repeat the context loses this times base ** excess
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = dry.BREAKERS
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # ... times how often it was generated
    logit_bias: dict = field(default_factory=dict)  # token id -> added to its logit
    seed: int | None = None

    @property
    def penalized(self) -> bool:
        """Whether a repetition penalty acts."""
        return self.repetition_penalty != 1 and self.repeat_last_n != 0

    @property
    def plain(self) -> bool:
        """Whether temperature and the filters (top-k, top-p, min-p, typical) are all it asks: what a speculative round
        serves (the target's and the draft's distributions both filtered alike)."""
        return (not self.penalized and not self.dry_multiplier and not self.logit_bias and not self.presence_penalty
                and not self.frequency_penalty)

    def dry_for(self, vocab) -> dry.Dry | None:
        """The DRY sampler with its breakers as the vocabulary's token ids; None when off (or no vocabulary)."""
        if not self.dry_multiplier or not self.dry_penalty_last_n or vocab is None:
            return None
        return dry.Dry.for_vocab(vocab, self.dry_multiplier, self.dry_base, self.dry_allowed_length,
                                 self.dry_penalty_last_n, self.dry_sequence_breakers)


GREEDY = SamplerSettings()  # the generators' default sampler: temperature 0, no filter, no penalty


# ----------------------------------------------------------------------------------------------------------------
# Defaults: what a request that does not say is sampled with. The checkpoint's own recommendation first
# (generation_config.json, or a GGUF file's general.sampling.* keys), else llama.cpp's defaults (common/common.h):
# temperature alone samples the long tail of a small model's vocabulary, and its answers are nonsense.

LLAMA_CPP = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
DECLARED = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty")  # what a checkpoint may say
LLAMA_CPP_SOURCE = "llama.cpp's default"


def normal(name: str, value):
    """A declared or given value as SamplerSettings holds it (a filter at its neutral value is off: top_k 0, top_p 1,
    min_p 0, typical_p 1; repetition_penalty 1), or ValueError when it is not a valid one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or isinstance(value, float) and math.isnan(value):
        raise ValueError(f"{name} {value!r} is not a number")
    if name == "top_k":
        if value < 0 or value != int(value):
            raise ValueError(f"top_k {value!r} is not a whole number >= 0")
        return int(value) or None
    low, high = {"temperature": (0, 100), "top_p": (0, 1), "min_p": (0, 1), "typical_p": (0, 1),
                 "repetition_penalty": (0, 10)}[name]
    if not low <= value <= high or (value == 0 and name in ("top_p", "typical_p", "repetition_penalty")):
        raise ValueError(f"{name} {value!r} is out of range")
    neutral = {"top_p": 1, "min_p": 0, "typical_p": 1}
    if name in neutral and value == neutral[name]:
        return None
    return float(value)


@dataclass(frozen=True)
class Defaults:
    """A model's sampling where nothing else says: values (SamplerSettings' fields) and sources (where each came
    from: its file, or llama.cpp's default)."""
    values: dict
    sources: dict

    @classmethod
    def of(cls, declared: dict, source: str, notes=None) -> Defaults:
        """From a checkpoint's declared fields (transformers' names; do_sample false: greedy), the rest llama.cpp's.
        A value that is not valid is left out, with a note."""
        values, sources = dict(LLAMA_CPP), dict.fromkeys(LLAMA_CPP, LLAMA_CPP_SOURCE)
        for name in DECLARED:
            if declared.get(name) is None:
                continue
            try:
                values[name], sources[name] = normal(name, declared[name]), source
            except ValueError as e:
                if notes is not None:
                    notes(f"{source}: {e}; ignored")
        if declared.get("do_sample") is False:  # (transformers: greedy, whatever the temperature says)
            values["temperature"], sources["temperature"] = 0.0, f"{source} (do_sample false)"
        return cls(values, sources)

    @classmethod
    def of_vocab(cls, vocab, notes=None) -> Defaults:
        """A checkpoint's defaults, from what its Vocabulary read (vocab.py: generation_config.json, or a GGUF's
        general.sampling.*)."""
        return cls.of(vocab.sampling, vocab.sampling_source, notes)

    def settings(self, said: str = "given", **given) -> tuple[SamplerSettings, dict]:
        """SamplerSettings of the given fields (None: not given; top_k, top_p, min_p, typical_p and repetition_penalty
        at their neutral values are off) over these defaults, and each field's source (a given one's: `said`).
        ValueError names a given value that is not valid."""
        fields = {name: value for name, value in given.items() if name not in DECLARED and value is not None}
        sources = {}
        for name in DECLARED:
            if given.get(name) is not None:
                fields[name], sources[name] = normal(name, given[name]), said
            elif name in self.values:
                fields[name], sources[name] = self.values[name], self.sources[name]
        if fields.get("repetition_penalty") is None:
            fields.pop("repetition_penalty", None)
        return SamplerSettings(**fields), sources


def describe(sampler: SamplerSettings, sources: dict) -> str:
    """The sampling a reply gets, each value with where it came from (/set, --verbose)."""
    parts = []
    for name in DECLARED:
        value = getattr(sampler, name)
        shown = "off" if value is None or (name == "repetition_penalty" and value == 1) else value
        parts.append(f"{name.replace('_', '-')} {shown} ({sources.get(name, 'off by default')})")
    return ", ".join(parts)


# ----------------------------------------------------------------------------------------------------------------
# The sampler: numbers, or [B] tensors (a compiled step's inputs: top_k 0, top_p 1, min_p 0 and typical_p 1 are off)


def sample(logits: torch.Tensor, temperature=0.0, top_k=None, top_p=None, vocab_limit: int | None = None,
           noise: torch.Tensor | None = None, min_p=None, typical_p=None) -> torch.Tensor:
    """logits [B, V] -> next ids [B, 1]. temperature, top_k, top_p: numbers, or [B] tensors (a compiled step's inputs:
    new values, no new graph; temperature 0 is greedy, top_k 0 and top_p 1 are off). No host sync: argmax(p / q) with
    q ~ Exp(1) samples from p without torch.multinomial; noise [B, V] gives those draws (default: torch's generator).
    min_p and typical_p run after top-p (last_filters)."""
    probs = probabilities(logits, temperature, top_k, top_p, vocab_limit, min_p, typical_p)
    if probs is None:
        return mask_vocab(logits, vocab_limit).argmax(dim=-1, keepdim=True)
    noise = torch.empty_like(probs).exponential_(1) if noise is None else noise
    sampled = (probs / noise).argmax(dim=-1, keepdim=True)
    if not torch.is_tensor(temperature):
        return sampled
    greedy = mask_vocab(logits, vocab_limit).argmax(dim=-1, keepdim=True)  # the rows whose temperature is 0
    return torch.where(temperature[:, None] == 0, greedy, sampled)


def mask_vocab(logits: torch.Tensor, vocab_limit: int | None) -> torch.Tensor:
    """Padded embedding rows (ids >= vocab_limit, the tokenizer's size) are never sampled."""
    if vocab_limit is None or vocab_limit >= logits.shape[-1]:
        return logits
    return logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= vocab_limit, -math.inf)


def probabilities(logits: torch.Tensor, temperature, top_k=None, top_p=None, vocab_limit: int | None = None,
                  min_p=None, typical_p=None) -> torch.Tensor | None:
    """The distribution sample() draws from, [..., V] float32 (None at temperature 0: greedy). Settings as in
    sample(); [B] tensors apply to the rows of [B, V] logits. The filters run in transformers' order: temperature,
    top-k, top-p, then min-p and typical."""
    per_row = torch.is_tensor(temperature)
    if not per_row and temperature == 0:
        return None
    V = logits.shape[-1]
    logits = mask_vocab(logits.float(), vocab_limit)
    logits = logits / (temperature.clamp(min=1e-6)[:, None] if per_row else temperature)  # (greedy rows: unused)
    if torch.is_tensor(top_k):  # the k-th largest of each row, k = V where off
        k = torch.where(top_k > 0, top_k, V).clamp(max=V)
        kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, -math.inf)
    elif top_k is not None:
        kth = torch.topk(logits, min(top_k, V), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if torch.is_tensor(top_p) or (top_p is not None and top_p < 1.0):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        limit = top_p[:, None] if torch.is_tensor(top_p) else top_p
        drop = probs.cumsum(dim=-1) - probs > limit  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    last = last_filters(min_p, typical_p)
    return (logits if last is None else last(logits)).softmax(dim=-1)


def last_filters(min_p, typical_p):
    """The filters that run after top-p, as one function of the logits [..., V] (None: none is on)."""
    with_min_p = torch.is_tensor(min_p) or (min_p is not None and min_p > 0)
    with_typical = torch.is_tensor(typical_p) or (typical_p is not None and typical_p < 1.0)
    if not with_min_p and not with_typical:
        return None

    def run(logits: torch.Tensor) -> torch.Tensor:
        if with_min_p:  # drop p < min_p * the largest p
            probs = logits.softmax(dim=-1)
            floor = (min_p[:, None] if torch.is_tensor(min_p) else min_p) * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < floor, -math.inf)
        return typical(logits, typical_p) if with_typical else logits

    return run


def typical(logits: torch.Tensor, mass) -> torch.Tensor:
    """Locally typical sampling: keep the tokens whose surprise -log p is closest to the entropy, the fewest whose
    probabilities sum to `mass` (a number, or [B]: rows at 1 are left as they are)."""
    logp = logits.log_softmax(dim=-1)
    entropy = -torch.nan_to_num(logp * logp.exp()).sum(dim=-1, keepdim=True)  # (-inf * 0: a masked token adds 0)
    distance, order = (-logp - entropy).abs().sort(dim=-1)
    sorted_logits = logits.gather(-1, order)
    limit = mass[:, None] if torch.is_tensor(mass) else mass
    last = (sorted_logits.softmax(dim=-1).cumsum(dim=-1) < limit).sum(dim=-1, keepdim=True)
    last = last.clamp(max=logits.shape[-1] - 1)  # the last token kept: the one whose mass reaches `mass`
    drop = distance > distance.gather(-1, last)
    drop[..., 0] = False  # (the most typical token always stays)
    kept = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    return torch.where(limit < 1, kept, logits) if torch.is_tensor(mass) else kept
