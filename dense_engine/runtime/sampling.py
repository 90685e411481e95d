"""sampling.py: SamplerSettings, what one request asks of the sampler. Each front end makes one (the server from a
body, protocol.py; chat.py from its flags and /set, cli/flags.py and cli/repl.py; the Python API from its keywords,
api.py) and hands it whole to generation: generate.Sampling.of turns it (one, or one per row of a server's batch)
into the inputs of a step, and generate.sample / generate.next_token are the one rule every token is drawn by."""

from __future__ import annotations

from dataclasses import dataclass, field

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
        """Whether temperature, top-k and top-p are all it asks (what a speculative round serves)."""
        return (not self.min_p and self.typical_p is None and not self.penalized and not self.dry_multiplier
                and not self.logit_bias and not self.presence_penalty and not self.frequency_penalty)

    def dry_for(self, vocab) -> dry.Dry | None:
        """The DRY sampler with its breakers as the vocabulary's token ids; None when off (or no vocabulary)."""
        if not self.dry_multiplier or not self.dry_penalty_last_n or vocab is None:
            return None
        return dry.Dry.for_vocab(vocab, self.dry_multiplier, self.dry_base, self.dry_allowed_length,
                                 self.dry_penalty_last_n, self.dry_sequence_breakers)
