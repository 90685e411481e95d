"""speculative.py: speculative decoding, the target model's exact output in fewer target steps.

At batch 1 a decode step is bound by reading the weights once; checking k + 1 tokens in one step costs little more.
A draft proposes k tokens; the target scores [current token, draft_1 .. draft_k] in one step (k + 1 positions, a
fixed shape, compiled once) and keeps the longest prefix it agrees with, plus one token of its own.

    from dense_engine.runtime import generate
    from dense_engine.runtime import speculative
    draft = speculative.ModelDraft(small_model)                   # a separate small model, same tokenizer
    draft = speculative.ModelDraft(speculative.quantized_copy(target, "int4"))   # self-speculation
    draft = speculative.LookupDraft(max_ngram=3)                   # prompt lookup: copies from the context
    draft = speculative.mtp_draft(target, checkpoint, mode)        # the checkpoint's MTP layers (Qwen3.5)
    out = speculative.generate(target, ids, 128, draft, speculate_k=4)    # as generate.generate, with a draft

Greedy: a draft token is kept when it is the target's argmax, so the output is plain greedy decoding's, token for
token. Sampling: the standard rule (Leviathan et al. 2023): keep draft token x with probability min(1, p(x) / q(x)),
else draw from max(0, p - q) renormalized; q is one-hot for a deterministic draft (prompt lookup). The output
distribution is the target's. Rejected positions stay in the caches and are overwritten when decoding reaches them
(a step attends only to positions up to its own), so nothing is copied or rolled back.
Stands on generate.py (its Runner runs the target's and the draft's steps) and quantized.py.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

import dense
import layer_kinds
from dense_engine.cpu import quantized
from dense_engine.runtime import caches
from dense_engine.runtime.generate import Runner, Sampling, collect, prepare, sample
from dense_engine.runtime.sampling import GREEDY, SamplerSettings, mask_vocab, probabilities
from dense_engine.runtime.steps import Steps, steps_for
from dense_engine.system.errors import UsageError


class ModelDraft:
    """A model that drafts: a separate small model sharing the tokenizer, or a quantized copy of the target.
    `cached` is the token sequence whose keys/values its cache holds at positions 0.. len(cached) - 1."""

    def __init__(self, model: dense.DenseDecoder, record=None) -> None:
        self.model = model
        self.record = record  # how to load the draft again (load.LoadRecord), for its steps' background compiles
        self.steps: Steps | None = None  # its compiled steps when a program gave them; else steps_for's
        self.cached: list[int] = []
        self.runner = None
        self.saved = None  # a state draft: (its tokens, its states) where its last proposal began

    def reset(self) -> None:
        self.cached, self.saved = [], None

    def attach(self, target_runner) -> None:
        """Take the target's cache length and compile setting (called by generate_tokens)."""
        target, model = target_runner.model, self.model
        if model.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft's vocabulary ({model.config.vocab_size}) is not the target's "
                             f"({target.config.vocab_size}): a draft must share the tokenizer")
        if model.config.max_position_embeddings < target.max_seq_len:
            raise ValueError(f"the draft's context ({model.config.max_position_embeddings}) is shorter than the "
                             f"target's cache ({target.max_seq_len})")
        if model.max_seq_len != target.max_seq_len:
            caches.setup_cache(model, 1, target.max_seq_len)
            self.cached = []
        steps = None if target_runner.steps is None else self.steps or steps_for(model)
        if self.runner is None or self.runner.steps is not steps:
            self.runner = Runner(model, steps)

    def sync(self, context: list[int]) -> torch.Tensor:
        """Feed the tokens of `context` its cache lacks (a new prompt, or the target's last accepted tokens);
        return the draft's logits after the last one [V]."""
        common = 0
        while common < min(len(self.cached), len(context) - 1) and self.cached[common] == context[common]:
            common += 1
        if common < len(self.cached) and caches.has_state(self.model):  # a state holds where it ends: back to the
            tokens, states = self.saved or ([], None)  # proposal's start (a prefix of the context), then the accepted
            restored = states is not None and common >= len(tokens) and context[:len(tokens)] == tokens  # tokens
            if restored:
                caches.restore_states(self.model, states)
            common = len(tokens) if restored else 0
        new = context[common:]
        if len(new) <= 2:  # after a verify: its token, and the last draft token when all were accepted
            # one fixed-width step (a padded second token goes to the scratch slot)
            block = torch.tensor([new + new[-1:] * (2 - len(new))], device=self.model.device)
            logits = self.runner.logits(block, common, real=len(new))[0, len(new) - 1]
        else:  # a new prompt, or a chat turn
            logits = self.runner.prefill(torch.tensor([new], device=self.model.device), common, None)[0]
        self.cached = list(context)
        return logits.float()

    def propose(self, context: list[int], k: int, sampling) -> tuple[list[int], torch.Tensor | None]:
        """k draft tokens after context, and their distributions q [k, V] (None when greedy)."""
        logits = self.sync(context)
        if caches.has_state(self.model):
            self.saved = (list(self.cached), caches.saved_states(self.model))
        device = self.model.device
        if sampling.temperature == 0:  # greedy: the ordinary decode step, the argmax inside its graph
            tokens = [int(mask_vocab(logits[None], sampling.vocab_limit).argmax())]
            while len(tokens) < k:
                fed = torch.tensor([[tokens[-1]]], device=device)
                tokens.append(int(self.runner.decode(fed, len(self.cached), None, sampling)))
                self.cached.append(tokens[-2])
            return tokens, None
        tokens, dists = [], []
        for i in range(k):
            q = probabilities(logits[None], sampling.temperature, sampling.top_k, sampling.top_p,
                              sampling.vocab_limit, sampling.min_p, sampling.typical_p)[0]
            tokens.append(int(torch.multinomial(q, 1)))
            dists.append(q)
            if i + 1 < k:
                logits = self.runner.logits(torch.tensor([[tokens[-1]]], device=device), len(self.cached))[0, -1]
                logits = logits.float()
                self.cached.append(tokens[-1])
        return tokens, torch.stack(dists)


class LookupDraft:
    """Prompt lookup: the draft is what followed the most recent earlier occurrence of the context's last n tokens
    (n = max_ngram down to 1), copied from the context itself. No model, no cache; q is one-hot."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def reset(self) -> None:
        pass

    def attach(self, target_runner) -> None:
        pass

    def propose(self, context: list[int], k: int, sampling) -> tuple[list[int], None]:
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # the most recent match first
                if context[start:start + n] == tail:
                    follow = context[start + n:start + n + k]
                    if follow:
                        return follow + [follow[-1]] * (k - len(follow)), None  # fixed k: pad the last one
        return [], None  # no match: nothing to check, a plain decode step is cheaper


class MultiTokenPredictor(layer_kinds.Decoder):
    """Qwen3.5's multi-token prediction layers (mtp.*), trained to predict the token after next. At position i it
    reads the target's final hidden state h_i (after the target's last norm) and the embedding of the next token
    t_{i+1}, each normed; fc mixes the two [2C -> C]; then full-attention layers with a KV cache of their own, and a
    norm: a hidden state whose logits (the target's head) are the draft for t_{i+2}, and which stands in for the
    target's hidden state at the next draft step. The model's own layer code: a DenseDecoder without a table or a
    head (the target's serve)."""

    def __init__(self, config: dense.DenseConfig, layers: int) -> None:
        C = config.hidden_size
        super().__init__(dataclasses.replace(config, num_hidden_layers=layers, layer_types=["full_attention"] * layers,
                                             vocab_size=1, tie_word_embeddings=False))
        self.embed_tokens = self.lm_head = None
        self.fc = torch.nn.Linear(2 * C, C, bias=False)
        self.norm_embedding = dense.make_norm(config, C)
        self.norm_hidden = dense.make_norm(config, C)

    def predict(self, embedded: torch.Tensor, hidden: torch.Tensor, input_pos: torch.Tensor, attend: int
                ) -> torch.Tensor:
        """embedded [B, T, C] (the target's embedding of t_{i+1}) and hidden [B, T, C] (h_i), at slots input_pos [T]
        (i) -> hidden states [B, T, C] after the norm."""
        step = dense.make_step(self, embedded.shape[1], input_pos, attend)
        x = self.fc(torch.cat([self.norm_embedding(embedded), self.norm_hidden(hidden)], dim=-1))
        step.rope = {kind: (cos.to(x.dtype), sin.to(x.dtype)) for kind, (cos, sin) in step.rope.items()}
        for layer in self.layers:
            x = layer(x, step)
        return self.norm(x)


def mtp_draft(target: dense.DenseDecoder, checkpoint, mode: str | None) -> MTPDraft:
    """The draft of `--draft mtp`: the checkpoint's multi-token prediction layers (Checkpoint.mtp) beside the target,
    in the target's dtype; quantized as the target when it is int8, int4 or nf4 (a GGUF file's: float)."""
    from dense_engine.formats import load  # (the loader: below this floor, read only here)
    if not checkpoint.mtp:
        raise UsageError(f"--draft mtp: {checkpoint.path} has no multi-token prediction layers (Qwen3.5's mtp.*, "
                         "a GGUF file's nextn block)")
    layers = len({name.split(".")[1] for name in checkpoint.mtp if name.startswith("layers.")})
    with torch.device("meta"), load.no_init():
        predictor = MultiTokenPredictor(checkpoint.config, layers)
    quantized.swap_linears(predictor, None, {})
    load.load_tensors(predictor, checkpoint.mtp, target.device, target.dtype, source=f"{checkpoint.path} (mtp)")
    if mode in ("int8", "int4", "nf4"):
        quantized.quantize_model(predictor, mode)
    return MTPDraft(predictor, target)


class MTPDraft:
    """The target's own multi-token prediction layers draft (MultiTokenPredictor). A draft at position P (the current
    token's) needs the target's hidden states at every position before it: generate_rounds hands them over
    (observe) after the prefill and after each verify step (the kept positions only). The predictor's cache slot j
    holds the entry of (h_j, t_{j+1}); its draft steps write slots P.. with its own hidden states, which the next
    round's entries of the target's overwrite before any later position reads them."""

    needs_hidden = True

    def __init__(self, predictor: MultiTokenPredictor, target: dense.DenseDecoder) -> None:
        self.predictor, self.target = predictor, target
        self.fed = 0  # slots 0..fed-1 hold entries of the target's hidden states
        self.hidden: torch.Tensor | None = None  # [N, C]: the target's hidden states at positions fed.., not fed yet

    def reset(self) -> None:
        self.fed, self.hidden = 0, None

    def attach(self, target_runner) -> None:
        if self.predictor.max_seq_len != target_runner.model.max_seq_len:
            caches.setup_cache(self.predictor, 1, target_runner.model.max_seq_len)
            self.reset()

    def observe(self, hidden: torch.Tensor, start: int) -> None:
        """The target's hidden states [T, C] at positions start..start + T - 1. Positions before start it was never
        given (a conversation the target's cache held before this draft saw it) keep older entries: worse drafts,
        never a different output (the target checks every one)."""
        if self.hidden is not None and self.fed <= start <= self.fed + len(self.hidden):
            hidden = torch.cat([self.hidden[: start - self.fed], hidden])
        else:
            self.fed = start
        self.hidden = hidden

    def run(self, tokens: list[int], hidden: torch.Tensor, start: int) -> torch.Tensor:
        """The predictor's hidden states [T, C] for tokens t_{j+1} and hidden states h_j [T, C] at slots start.."""
        device, T = self.target.device, len(tokens)
        embedded = self.target.embed_tokens(torch.tensor([tokens], device=device))  # (Qwen3.5: no embedding scale)
        slots = torch.arange(start, start + T, device=device)
        return self.predictor.predict(embedded.to(hidden.dtype), hidden[None], slots, start + T)[0]

    @torch.no_grad()
    def propose(self, context: list[int], k: int, sampling) -> tuple[list[int], torch.Tensor | None]:
        P = len(context) - 1  # the current token's position: the target's hidden states are known before it
        if self.hidden is None or self.fed + len(self.hidden) != P:  # (a plain step ran: no hidden state of it)
            return [], None
        h = self.run(context[self.fed + 1:], self.hidden, self.fed)[-1:]  # entries of slots fed..P-1 -> [1, C]
        self.fed, self.hidden = P, self.hidden[:0]
        tokens, dists = [], []
        for i in range(k):
            logits = self.target.logits(h)  # [1, V]
            if sampling.temperature == 0:
                tokens.append(int(mask_vocab(logits, sampling.vocab_limit).argmax()))
            else:
                q = probabilities(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.vocab_limit,
                                  sampling.min_p, sampling.typical_p)[0]
                tokens.append(int(torch.multinomial(q, 1)))
                dists.append(q)
            if i + 1 < k:
                h = self.run(tokens[-1:], h, P + i)
        return tokens, torch.stack(dists) if dists else None


def quantized_copy(model: dense.DenseDecoder, mode: str) -> dense.DenseDecoder:
    """Self-speculation's draft: the target's weights quantized in memory (no second read from disk); the embedding
    table is shared, not copied."""
    embedding = model.embed_tokens
    model.embed_tokens = None  # keep the table out of the deep copy
    try:
        draft = copy.deepcopy(model)
    finally:
        model.embed_tokens = embedding
    draft.embed_tokens = embedding
    for mixer in draft.mixers:
        mixer.memory = dense.NoCache()
    draft.max_batch_size = draft.max_seq_len = 0
    return quantized.quantize_model(draft, mode)


def accept(target_logits: torch.Tensor, draft_tokens: list[int], q: torch.Tensor | None, sampling
           ) -> tuple[list[int], int]:
    """target_logits [k + 1, V] at [current, draft_1 .. draft_k]; -> (new tokens: the accepted drafts and one of the
    target's own, accepted count). Every tensor made here is on the logits' device; the host reads two numbers (how
    many were accepted, and the token drawn), not one per draft."""
    k, device = len(draft_tokens), target_logits.device
    p = probabilities(target_logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.vocab_limit,
                      sampling.min_p, sampling.typical_p)
    if p is None:  # greedy: keep drafts while they are the target's own tokens
        best = sample(target_logits, sampling)[:, 0].tolist()
        n = 0
        while n < k and draft_tokens[n] == best[n]:
            n += 1
        return draft_tokens[:n] + [best[n]], n
    drafts = torch.tensor(draft_tokens, device=device)  # [k]
    if q is None:  # a deterministic draft (prompt lookup): q is one-hot at each draft token
        q = torch.nn.functional.one_hot(drafts, p.shape[-1]).to(p.dtype)
    rows = torch.arange(k, device=device)
    # draft i is kept with probability min(1, p_i(t_i) / q_i(t_i)), while every draft before it was kept
    kept = torch.rand(k, device=device) < (p[rows, drafts] / q[rows, drafts]).clamp(max=1.0)
    n = int(kept.int().cumprod(0).sum()) if k else 0
    if n == k:  # every draft kept: the target's own token after them, as a decode step draws it
        return draft_tokens + [int(sample(target_logits[k:], sampling))], k
    residual = (p[n] - q[n]).clamp(min=0)  # the first rejected draft's replacement: drawn from max(0, p - q)
    residual = torch.where(residual.sum() > 0, residual, p[n])  # (p == q: any draw from p is exact)
    return draft_tokens[:n] + [int(torch.multinomial(residual / residual.sum(), 1))], n


@torch.no_grad()
def generate_tokens(model: dense.DenseDecoder, prompts, max_new_tokens: int, draft, *, speculate_k: int = 4,
                    sampler: SamplerSettings = GREEDY, compile: bool = False, start_pos: int = 0,
                    vocab_limit: int | None = None, steps: Steps | None = None, stats: dict | None = None,
                    context: list[int] | None = None):
    """generate.generate_tokens with a draft: yield new tokens [1, 1] one by one, k at a time from the draft and
    checked by the target (see the module's docstring). sampler: temperature and the filters (sampler.plain).
    stats gets proposed / accepted / target_steps; context: the tokens already in the target's cache at
    0..start_pos - 1 (a chat's conversation), which a draft model needs to follow it."""
    device = model.device
    for new in generate_rounds(model, prompts, max_new_tokens, draft, speculate_k=speculate_k, sampler=sampler,
                               compile=compile, start_pos=start_pos, vocab_limit=vocab_limit, steps=steps,
                               stats=stats, context=context):
        for t in new:
            yield torch.tensor([[t]], device=device)


def generate_rounds(model: dense.DenseDecoder, prompts, max_new_tokens: int, draft, *, speculate_k: int = 4,
                    sampler: SamplerSettings = GREEDY, compile: bool = False, start_pos: int = 0,
                    vocab_limit: int | None = None, steps: Steps | None = None, stats: dict | None = None,
                    context: list[int] | None = None):
    """generate_tokens' tokens a target step at a time: yields a list of token ids per step (the first: the prompt's
    prefill and its token), so a caller may run other work between two rounds (serve.py's other rows)."""
    runner, ids, _ = prepare(model, prompts, max_new_tokens, start_pos, compile, steps)
    if not sampler.plain:
        raise ValueError("speculative decoding serves temperature, top-k, top-p, min-p and typical-p only")
    sampling = Sampling.of(sampler, vocab_limit)
    if ids.shape[0] != 1:
        raise ValueError("speculative decoding runs at batch 1")
    k = speculate_k
    if k < 1:
        raise ValueError(f"speculate_k must be at least 1, got {k}")
    device = ids.device
    context = (list(context) if context is not None else [0] * start_pos) + ids[0].tolist()
    if len(context) != start_pos + ids.shape[1]:
        raise ValueError("the context given to speculative decoding does not match start_pos")
    draft.attach(runner)
    stats = stats if stats is not None else {}
    stats.update(proposed=0, accepted=0, target_steps=0)
    stateful = caches.has_state(model)
    with_hidden = getattr(draft, "needs_hidden", False)  # (an MTP draft goes on from the target's hidden states)
    if with_hidden:
        hidden = runner.prefill_hidden(ids, start_pos)  # [1, T, C]
        draft.observe(hidden[0], start_pos)
        first = model.logits(hidden[:, -1])
    else:
        first = runner.prefill(ids, start_pos, None)
    token = sample(first, sampling)
    produced = 1
    yield [int(token)]
    context.append(int(token))
    while produced < max_new_tokens:
        pos = len(context) - 1  # the current token's position: written by this verify step
        n = min(k, max_new_tokens - produced - 1, model.max_seq_len - 1 - pos)
        proposal, q = draft.propose(context, n, sampling) if n >= 1 else ([], None)
        if not proposal:  # no room to speculate, or nothing proposed: one plain step
            token = runner.decode(torch.tensor([[context[-1]]], device=device), pos, None, sampling)
            new = [int(token)]
        else:
            proposal = proposal + [proposal[-1]] * (k - n)  # the verify step has a fixed width: k + 1
            block = torch.tensor([[context[-1]] + proposal], device=device)
            saved = caches.saved_states(model) if stateful else None
            target_logits, hidden = runner.logits(block, pos, real=n + 1, hidden=True)
            new, accepted = accept(target_logits[0, : n + 1].float(), proposal[:n], None if q is None else q[:n],
                                   sampling)
            if with_hidden:  # the positions kept: the current token's and the accepted drafts'
                draft.observe(hidden[0, : accepted + 1], pos)
            if stateful and accepted < n:  # the rejected drafts went into the state: from its start again, with
                caches.restore_states(model, saved)  # the accepted ones only (the same fixed-width step)
                runner.logits(block, pos, real=accepted + 1)
            stats["proposed"] += n
            stats["accepted"] += accepted
        stats["target_steps"] += 1
        yield new
        context += new
        produced += len(new)


@torch.no_grad()
def generate(model: dense.DenseDecoder, prompts, max_new_tokens: int, draft, *, speculate_k: int = 4,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, eos_id=None,
             compile: bool = False, vocab_limit: int | None = None, stats: dict | None = None,
             steps: Steps | None = None):
    """generate.generate with a draft: the same result (greedy: token for token), in fewer target steps."""
    tokens = generate_tokens(model, prompts, max_new_tokens, draft, speculate_k=speculate_k,
                             sampler=SamplerSettings(temperature, top_k, top_p), compile=compile,
                             vocab_limit=vocab_limit, stats=stats, steps=steps)
    return collect(tokens, prompts, eos_id, model.device)
