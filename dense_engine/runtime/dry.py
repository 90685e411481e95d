"""dry.py: the DRY sampler ("Don't Repeat Yourself", p-e-w's, as llama.cpp and text-generation-webui apply it): a
token that would extend a repetition of what the context already holds is penalized, the more the longer it is.

For the context c[0..N-1] and each earlier position i where c[i] == c[N-1], the match is the longest common suffix
of c[..i] and c[..N-1] (a sequence breaker, such as a newline, ends it); the token that followed it, c[i + 1], would
repeat it. Its logit loses multiplier * base ** (match - allowed_length) once the match reaches allowed_length (the
longest match of each token counts). The matches are found for every i at once, one comparison of shifted arrays a
step of the match (numpy), so a step costs about the longest match times the window, not its square.

    dry = Dry.for_vocab(vocab, multiplier=0.8, base=1.75, allowed_length=2, window=-1, breakers=["\\n", ":"])
    bias[V] -= dry.penalty(tokens, V)      # tokens: the prompt and the reply so far
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's and text-generation-webui's defaults
MAX_MATCH = 64  # a longer repetition is penalized as this long (1.75 ** 62: a ban already), so a step's work is
# bounded by 64 passes over the window whatever the text (a context of one token repeated is the worst)


def breaker_ids(vocab, breakers) -> frozenset[int]:
    """The ids of the tokens whose text holds a sequence breaker (made once per vocabulary and breakers)."""
    kept = vocab.__dict__.setdefault("dry_breakers", {})  # (kept with the vocabulary it was made from)
    key = tuple(breakers)
    if key not in kept:
        decoded = vocab.tokenizer.decode_batch([[i] for i in range(vocab.size)], skip_special_tokens=False)
        kept[key] = frozenset(i for i, text in enumerate(decoded) if any(b in text for b in breakers))
    return kept[key]


@dataclass(frozen=True)
class Dry:
    multiplier: float
    base: float = 1.75
    allowed_length: int = 2
    window: int = -1  # the last `window` tokens are looked at (-1: all)
    breakers: frozenset = frozenset()

    @classmethod
    def for_vocab(cls, vocab, multiplier: float, base: float = 1.75, allowed_length: int = 2, window: int = -1,
                  breakers=BREAKERS) -> Dry:
        """The sampler with its breakers as the vocabulary's token ids."""
        return cls(multiplier, base, allowed_length, window, breaker_ids(vocab, breakers))

    def penalty(self, tokens: list[int], V: int) -> torch.Tensor:
        """[V] float32: what each token's logit loses (0 for most)."""
        out = torch.zeros(V)
        c = np.asarray(tokens if self.window < 0 else tokens[-self.window:], dtype=np.int64)
        N = len(c)
        if N < 2 or int(c[-1]) in self.breakers:
            return out
        broken = np.isin(c, np.fromiter(self.breakers, dtype=np.int64, count=len(self.breakers)))
        ends = np.arange(N - 1)  # i: where an earlier copy of the last token may sit
        alive = (c[:-1] == c[-1]) & ~broken[1:]  # (the token that followed it must not be a breaker)
        match = alive.astype(np.int64)
        for k in range(1, min(N - 1, MAX_MATCH)):
            if not alive.any():
                break
            at = ends - k
            ok = at >= 0
            same = np.zeros(N - 1, dtype=bool)
            same[ok] = (c[at[ok]] == c[N - 1 - k]) & ~broken[at[ok]]
            alive &= same
            match += alive
        hits = match >= self.allowed_length
        if not hits.any():
            return out
        followers, lengths = c[1:][hits], match[hits]
        best = np.zeros(V, dtype=np.int64)
        np.maximum.at(best, followers, lengths)
        penalized = best >= self.allowed_length
        out[torch.from_numpy(np.nonzero(penalized)[0])] = torch.from_numpy(
            self.multiplier * self.base ** (best[penalized] - self.allowed_length).astype(np.float64)).float()
        return out
