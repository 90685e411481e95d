"""embedding.py: a decoder as an embedding model and as a reranker. Texts run in batches of similar length, padded
on the right: attention is causal, so a token never sees the padding after it and each text's hidden states are
its own. An embedding pools a text's final hidden states (formats/pooling.py: its last token, the mean, or the
first); a reranker (Qwen3-Reranker) scores a query and a document by its head's "yes" against "no" after its
instruction format. Eager calls, no cache: their lengths vary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dense_engine.cpu import kernels
from dense_engine.formats.pooling import Pooling

BATCH_TOKENS = 8192  # padded tokens a forward pass (a batch of short texts: up to this many texts)

# Qwen3-Reranker's format (its model card): a system line asking for yes or no, the pair, an empty thinking
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def plain_linears(model) -> None:
    """The float32 linears back to PyTorch's own. kernels.Linear keeps a row's bits whatever the rows beside it, which
    a cache filled in chunks needs; whole texts need no such thing, and PyTorch's GEMM is faster for a batch of them.
    (A server that embeds runs no generation.)"""
    for module in model.modules():
        if type(module) is kernels.Linear:
            module.__class__ = nn.Linear


def hidden_batches(model, texts: list[list[int]]):
    """(indices, [B, T, C] final hidden states) for batches of the texts (token ids), shortest first."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end + 1 - start) * len(texts[order[end]]) <= BATCH_TOKENS:
            end += 1
        rows = order[start:end]
        T = len(texts[rows[-1]])
        ids = torch.tensor([texts[i] + [texts[i][-1]] * (T - len(texts[i])) for i in rows], device=model.device)
        yield rows, model.hidden_states(ids)
        start = end


@torch.inference_mode()
def embed(model, texts: list[list[int]], pooling: Pooling, dimensions: int | None = None) -> torch.Tensor:
    """[N, C] float32 (C: dimensions when given): each text pooled; cut to `dimensions` and then normalized when
    asked (Matryoshka), else normalized as the folder says."""
    out = torch.empty(len(texts), model.config.hidden_size)
    for rows, hidden in hidden_batches(model, texts):
        for r, i in enumerate(rows):
            h = hidden[r, :len(texts[i])].float()  # [n, C]
            out[i] = h[-1] if pooling.kind == "lasttoken" else h[0] if pooling.kind == "cls" else h.mean(0)
    if dimensions is not None:
        out = out[:, :dimensions]
    return F.normalize(out, dim=-1) if pooling.normalize or dimensions is not None else out


@dataclass(frozen=True)
class Reranker:
    """Qwen3-Reranker's scoring: the ids of its answer tokens and of the format's fixed parts."""
    yes: int
    no: int
    prefix: list[int]
    suffix: list[int]

    @classmethod
    def of(cls, vocab) -> Reranker | None:
        """None when the vocabulary has no single "yes" and "no" tokens."""
        yes, no = vocab.tokenizer.token_to_id("yes"), vocab.tokenizer.token_to_id("no")
        if yes is None or no is None:
            return None
        return cls(yes, no, vocab.encode(RERANK_PREFIX, special=False), vocab.encode(RERANK_SUFFIX, special=False))

    def pair(self, vocab, query: str, document: str, instruction: str | None = None) -> list[int]:
        text = f"<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        return self.prefix + vocab.encode(text, special=False) + self.suffix

    @torch.inference_mode()
    def scores(self, model, pairs: list[list[int]]) -> list[float]:
        """P(yes) against no, from the head's two logits at each pair's last token."""
        out = [0.0] * len(pairs)
        for rows, hidden in hidden_batches(model, pairs):
            last = torch.stack([hidden[r, len(pairs[i]) - 1] for r, i in enumerate(rows)])  # [B, C]
            logits = model.logits(last)[:, [self.no, self.yes]]  # [B, 2]
            for r, i in enumerate(rows):
                out[i] = float(logits[r].log_softmax(-1)[1].exp())
        return out
