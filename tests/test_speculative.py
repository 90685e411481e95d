"""Speculative decoding (speculative.py) against plain decoding: greedy output token for token for every kind of
draft, eager and compiled, with drafts that are always wrong, always right, and right for exactly j tokens for every
j in 0..k; the sampling rule's output distribution against the target's (chi-square); and the cache after rejections."""


import pytest
import torch
from conftest import fixture_path, random_model
from rich.console import Console

import chat
import quantize
from dense_engine.cli import flags
from dense_engine.formats import convert, load
from dense_engine.formats import vocab as vocab_module
from dense_engine.runtime import caches, generate, session, speculative
from dense_engine.runtime.sampling import SamplerSettings
from dense_engine.runtime.steps import Steps

K = 4


def plain(model, ids, n):
    return torch.cat([ids, *generate.generate_tokens(model, ids, n)], dim=1)


def spec(model, ids, n, draft, compile=False, k=K):
    stats = {}
    out = torch.cat([ids, *speculative.generate_tokens(model, ids, n, draft, speculate_k=k, compile=compile,
                                                      stats=stats)], dim=1)
    return out, stats


class ScriptedDraft:
    """Proposes the target's own greedy continuation for `right` tokens, then a wrong token: acceptance stops there."""

    def __init__(self, reference: list[int], right: int) -> None:
        self.reference, self.right = reference, right

    def reset(self):
        pass

    def attach(self, runner):
        pass

    def propose(self, context, k, sampling):
        truth = self.reference[len(context):len(context) + k]
        truth = truth + [0] * (k - len(truth))
        wrong = [(t + 1) % 512 for t in truth]
        return truth[:self.right] + wrong[self.right:k], None


@pytest.fixture(scope="module")
def target():
    return random_model()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 512, (1, 11), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("right", range(K + 1))
def test_acceptance_stopping_at_every_position_gives_plain_greedy(target, prompt, right):
    want = plain(target, prompt, 30)
    out, stats = spec(target, prompt, 30, ScriptedDraft(want[0].tolist(), right))
    assert torch.equal(out, want)
    ratio = stats["accepted"] / stats["proposed"]
    assert ratio == 1.0 if right == K else ratio == 0.0 if right == 0 else 0 < ratio < 1


@pytest.mark.parametrize("kind", ["wrong", "right", "self-int8", "self-int4", "lookup"])
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.slow
def test_every_draft_gives_plain_greedy(target, prompt, kind, compile):
    want = plain(target, prompt, 40)
    if kind == "wrong":  # another random model: its proposals are almost never the target's
        draft = speculative.ModelDraft(random_model(seed=7))
    elif kind == "right":  # the target itself: every proposal is accepted
        draft = speculative.ModelDraft(random_model())
    elif kind == "lookup":
        draft = speculative.LookupDraft(max_ngram=3)
    else:
        draft = speculative.ModelDraft(speculative.quantized_copy(target, kind.removeprefix("self-")))
    out, stats = spec(target, prompt, 40, draft, compile=compile)
    assert torch.equal(out, want)
    if kind == "right":
        assert stats["accepted"] == stats["proposed"] and stats["target_steps"] < 40 / K + 2
    if kind == "wrong":
        assert stats["accepted"] < 0.2 * stats["proposed"]


def test_self_draft_shares_the_embedding_and_loads_nothing(target):
    draft = speculative.quantized_copy(target, "int4")
    assert draft.embed_tokens is target.embed_tokens
    assert type(target.layers[0].mixer.qkv_proj).__name__ == "Linear"  # the target is untouched
    assert type(draft.layers[0].mixer.qkv_proj).__name__ == "Int4Linear"


def test_draft_quant_loads_the_saved_variant_with_its_record(tmp_path, prompt, monkeypatch):
    """--draft-quant int4 on a folder with a saved int4 variant: the draft is that variant as stored (no quantizing
    at load), with the record a background compile loads it by; greedy output still the plain one."""
    folder = str(tmp_path / "llama")
    convert.convert(fixture_path("llama"), folder)
    quantize.quantize_checkpoint(folder, "int4")
    args = chat.parse_args(["--ckpt", folder, "--quant", "none", "--draft-quant", "int4"])
    console = Console(quiet=True)
    model, record = flags.load_model(folder, args, console)
    draft = flags.make_draft(args, model, console, record)
    assert draft.record.quant == "int4" and draft.record.path == record.path and record.quant is None
    saved = load.from_pretrained(folder, quant="int4")
    ids = prompt % model.config.vocab_size
    assert draft.model.embed_tokens is not model.embed_tokens  # a load of its own, not quantized_copy's
    assert torch.equal(draft.model(ids), saved(ids))
    assert not torch.equal(draft.model(ids), model(ids))
    out, stats = spec(model, ids, 24, draft)
    assert torch.equal(out, plain(model, ids, 24)) and stats["accepted"] > 0
    # a program's session: the draft's steps compiled in the background by its record; the worker's load of that
    # record (background.compile_job's) has the same step keys, so what it saves is what this process loads
    monkeypatch.setenv("DENSE_BACKGROUND_COMPILE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    chat_session = session.Session(model, vocab_module.load_vocabulary(folder, None), load=record, draft=draft)
    assert draft.steps.background.recipe["quant"] == "int4" and chat_session.steps.background.recipe["quant"] is None
    draft.attach(generate.Runner(model, chat_session.steps))  # (the draft's cache: the target's length)
    worker = load.from_pretrained(draft.record.path, draft.record.device, draft.record.dtype, draft.record.quant)
    caches.setup_cache(worker, 1, chat_session.max_seq_len, draft.record.kv_dtype)
    assert Steps(worker).key("decode", batch=1) == draft.steps.key("decode", batch=1)
    bare = str(tmp_path / "bare")  # no saved variant: quantized in memory, no record
    convert.convert(fixture_path("llama"), bare)
    args = chat.parse_args(["--ckpt", bare, "--quant", "none", "--draft-quant", "int4"])
    model, record = flags.load_model(bare, args, console)
    assert flags.make_draft(args, model, console, record).record is None


def test_lookup_copies_what_followed_the_last_match():
    draft = speculative.LookupDraft(max_ngram=3)
    context = [1, 2, 3, 4, 5, 9, 9, 2, 3]  # "2 3" occurred before, followed by 4 5 9
    assert draft.propose(context, 3, None)[0] == [4, 5, 9]
    assert draft.propose([7, 8], 2, None)[0] == []  # no match: no proposal (a plain decode step)


def test_cache_holds_the_right_keys_after_rejections(target, prompt):
    out, stats = spec(target, prompt, 30, speculative.ModelDraft(random_model(seed=7)))
    assert stats["accepted"] < stats["proposed"]  # there were rejections, whose slots were written then overwritten
    n = out.shape[1]
    cached = target(out[:, -1:], input_pos=torch.tensor([n - 1]))  # the last token, against the cache
    full = target(out)  # no cache
    assert (cached[0, -1] - full[0, -1]).abs().max() <= 1e-4 * full.abs().max()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 5
    return float((((counts - expected) ** 2) / expected)[keep].sum()), int(keep.sum()) - 1


def test_sampling_rule_draws_from_the_target_distribution():
    torch.manual_seed(0)
    V, k, trials = 6, 2, 20000
    target_logits = torch.randn(k + 1, V) * 1.5
    draft_logits = torch.randn(k, V) * 1.5
    sampling = generate.Sampling(temperature=1.0)
    p = target_logits.softmax(-1)
    q = draft_logits.softmax(-1)
    first = torch.zeros(V)
    for _ in range(trials):
        proposal = [int(torch.multinomial(q[i], 1)) for i in range(k)]
        tokens, _ = speculative.accept(target_logits, proposal, q, sampling)
        first[tokens[0]] += 1
    stat, dof = chi_square(first, p[0])
    assert stat < 3 * dof + 20  # the target's distribution (chi-square, dof 5: p-value far from 0)
    stat_q, _ = chi_square(first, q[0])
    assert stat_q > 10 * (3 * dof + 20)  # and clearly not the draft's
    # a deterministic draft (q one-hot, prompt lookup) keeps the same guarantee
    first = torch.zeros(V)
    for _ in range(trials):
        tokens, _ = speculative.accept(target_logits, [3, 1], None, sampling)
        first[tokens[0]] += 1
    stat, dof = chi_square(first, p[0])
    assert stat < 3 * dof + 20


@pytest.mark.slow
def test_sampled_speculative_generation_follows_the_target(target):
    """End to end at temperature 1: the second token (the first one speculated) has the same distribution with a
    draft that is usually wrong as without one (two-sample chi-square over 1500 draws each)."""
    prompt = torch.tensor([[3, 9, 27]])
    sampling = {"sampler": SamplerSettings(temperature=1.0, top_k=4)}
    draft = speculative.ModelDraft(random_model(seed=7))
    torch.manual_seed(1)
    counts = {"plain": torch.zeros(512), "spec": torch.zeros(512)}
    for _ in range(1500):
        counts["plain"][int(list(generate.generate_tokens(target, prompt, 2, **sampling))[1])] += 1
        counts["spec"][int(list(speculative.generate_tokens(target, prompt, 3, draft, speculate_k=1,
                                                           **sampling))[1])] += 1
    keep = (counts["plain"] + counts["spec"]) > 20
    a, b = counts["plain"][keep], counts["spec"][keep]
    stat, dof = float((((a - b) ** 2) / (a + b)).sum()), int(keep.sum()) - 1
    assert dof >= 3 and stat < 3 * dof + 20
