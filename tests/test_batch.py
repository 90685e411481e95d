"""Ragged batches (generate.py) against each prompt alone at batch 1: greedy tokens row for row (eager and compiled,
rows finishing early at eos, a row of one token), and logits that padding never moves beyond 1e-5."""

import pytest
import torch
from conftest import expected, fixture_path, rel_err

from dense_engine.formats.load import from_pretrained
from dense_engine.runtime import generate

LENGTHS = [7, 1, 12, 4]  # row 1 is a single token


def prompts_of(layout):
    ids = expected(layout)["input_ids"].reshape(-1)
    return [ids[i:i + n] for i, n in enumerate(LENGTHS)]


def alone(model, prompt, n, **kw):
    return generate.generate(model, [prompt], n, **kw)[0]


@pytest.mark.parametrize("layout", ["llama", "gptneox", "openelm"])
def test_each_row_of_a_ragged_batch_equals_its_prompt_alone(layout):
    model = from_pretrained(fixture_path(layout))
    prompts = prompts_of(layout)
    want = [alone(model, p, 20) for p in prompts]
    got = generate.generate(model, prompts, 20)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@pytest.mark.slow
def test_compiled_ragged_batch_equals_prompts_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = from_pretrained(fixture_path("llama"))
    prompts = prompts_of("llama")
    want = [alone(model, p, 20) for p in prompts]  # eager, batch 1
    got = generate.generate(model, prompts, 20, compile=True)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_rows_stop_at_their_own_eos_while_the_others_go_on():
    model = from_pretrained(fixture_path("llama"))
    prompts = prompts_of("llama")
    free = [alone(model, p, 20) for p in prompts]
    eos = int(free[1][3])  # the fourth token of the one-token row
    want = [alone(model, p, 20, eos_id=eos) for p in prompts]
    got = generate.generate(model, prompts, 20, eos_id=eos)
    assert len(got[1]) <= 4 and int(got[1][-1]) == eos
    assert any(len(row) == 20 for row in got)  # some row did not meet the eos and ran to the length
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@pytest.mark.parametrize("layout", ["llama", "gptneox"])
def test_padding_never_changes_a_rows_logits(layout):
    model = from_pretrained(fixture_path(layout))
    prompts = prompts_of(layout)
    ids, row_start, lengths = generate.as_batch(prompts, model.device)
    model.setup_cache(len(prompts), 64)
    runner = generate.Runner(model, None)
    batched = runner.logits(ids, 0, row_start)  # [B, T, V]
    T = ids.shape[1]
    for b, p in enumerate(prompts):
        model.setup_cache(1, 64)
        solo = runner.logits(p[None], 0)[0]
        assert rel_err(batched[b, T - lengths[b]:], solo) < 1e-5
    # then one decode step for every row at once, each at its own next position
    model.setup_cache(len(prompts), 64)
    runner.logits(ids, 0, row_start)
    nxt = torch.tensor([[int(p[-1])] for p in prompts])
    step = runner.logits(nxt, T, row_start)[:, 0]
    for b, p in enumerate(prompts):
        model.setup_cache(1, 64)
        solo = runner.logits(torch.cat([p, p[-1:]])[None], 0)[0, -1]
        assert rel_err(step[b], solo) < 1e-5


def test_sampled_ragged_batch_is_reproducible_with_a_seed():
    model = from_pretrained(fixture_path("llama"))
    prompts = prompts_of("llama")
    torch.manual_seed(3)
    a = generate.generate(model, prompts, 12, temperature=1.0, top_k=50)
    torch.manual_seed(3)
    b = generate.generate(model, prompts, 12, temperature=1.0, top_k=50)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    greedy = generate.generate(model, prompts, 12)
    assert not all(torch.equal(x, y) for x, y in zip(a, greedy))
