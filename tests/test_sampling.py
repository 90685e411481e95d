"""The one sampling record and the one route to the sampler; the server's schedule() on plain records."""

import torch
from conftest import random_model

from dense_engine.runtime import caches, generate, sampling, speculative
from dense_engine.runtime.sampling import SamplerSettings
from dense_engine.server.scheduler import Request, Row, Status, schedule

ASKED = SamplerSettings(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)


def seeded(seed: int = 5) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def plain(logits: torch.Tensor, sampler: SamplerSettings, noise: torch.Tensor) -> int:
    """One plain sampler call: sampling.sample with the record's values as numbers."""
    return int(sampling.sample(logits, sampler.temperature, sampler.top_k, sampler.top_p, None, noise, sampler.min_p,
                               sampler.typical_p))


def test_a_first_token_is_the_plain_sampler_call():
    logits = torch.randn(1, 512) * 3
    got = generate.sample(logits, generate.Sampling.of(ASKED, None, generators=(seeded(),)))
    assert int(got) == plain(logits, ASKED, torch.empty(1, 512).exponential_(1, generator=seeded()))


def test_a_decode_step_draws_the_plain_sampler_call():
    """The step (with its logits out, as a server's logprobs take them) against one plain call on those logits with
    the same noise."""
    model = random_model()
    caches.setup_cache(model, 1, 256)
    runner = generate.Runner(model, None)
    runner.prefill(torch.tensor([[5, 17, 99, 3]]), 0, None)
    for seed in range(4):
        sampling = generate.Sampling.of(ASKED, None, generators=(seeded(seed),))
        token, logits = runner.decode(torch.tensor([[7]]), 4, None, sampling, with_logits=True)
        V = logits.shape[-1]
        assert int(token) == plain(logits, ASKED, torch.empty(1, V).exponential_(1, generator=seeded(seed)))


def test_a_speculative_round_draws_the_plain_sampler_call():
    """Every draft kept (the target is sure of each): the round's own token is the plain call on its last logits
    with the noise drawn after the acceptance draws; greedy: the argmax of each position."""
    V, drafts = 512, [11, 22, 33]
    logits = torch.randn(4, V)
    logits[torch.arange(3), drafts] = 1e4  # (p = 1 at each draft)
    sampling = generate.Sampling.of(SamplerSettings(temperature=0.8, top_k=40), None)
    torch.manual_seed(3)
    new, kept = speculative.accept(logits, drafts, None, sampling)
    torch.manual_seed(3)
    torch.rand(3)  # (the acceptance draws)
    noise = torch.empty(1, V).exponential_(1)
    assert kept == 3 and new == drafts + [plain(logits[3:], SamplerSettings(temperature=0.8, top_k=40), noise)]
    greedy = generate.Sampling.of(SamplerSettings(), None)
    new, kept = speculative.accept(logits, drafts, None, greedy)
    assert new == drafts + [int(logits[3].argmax())]


# ---- schedule(): a turn's choices, on records, without a model


def waiting(prompt, sampler=SamplerSettings(), **fields) -> Request:  # noqa: B008 (a frozen dataclass)
    return Request(prompt, 8, sampler, [], seeded(), lambda event: None, **fields)


def running(prompt, status, **fields) -> Row:
    request = waiting(prompt)
    request.status = status
    return Row(request, list(prompt), **fields)


def test_schedule_admits_into_the_row_holding_the_prompt_s_prefix():
    rows = [Row(tokens=[9, 9, 9], used=1), Row(tokens=[1, 2, 3, 4], used=2), Row()]
    first, second = waiting([1, 2, 3, 4, 5, 6]), waiting([7, 8])
    plan = schedule(rows, [first, second])
    assert plan.taken == 2 and plan.admit == [(1, first, 4), (2, second, 0)]  # (second: the empty row)
    assert plan.prefill == [(1, 4, 6), (2, 0, 2)] and plan.decode == [1, 2]  # (whole prompts: none decodes yet)
    assert rows[1].request is None and first.status is Status.WAITING  # (nothing changed)


def test_schedule_reuses_a_row_only_whole_where_layers_keep_a_state():
    """A state holds where it ends: a prompt that goes on from all of a row is reused; one that shares only part of
    it starts again (the KV cache would keep the shared part)."""
    rows = [Row(tokens=[1, 2, 3, 4], used=1), Row(tokens=[5, 6, 7, 8, 9], used=2)]
    on, apart = waiting([1, 2, 3, 4, 10]), waiting([5, 6, 7, 11, 12])
    assert schedule(rows, [on, apart]).admit == [(0, on, 4), (1, apart, 3)]
    plan = schedule(rows, [on, apart], whole_rows=True)
    assert plan.admit == [(0, on, 4), (1, apart, 0)] and plan.prefill == [(0, 4, 5), (1, 0, 5)]


def test_schedule_prefills_in_chunks_beside_decoding_rows():
    rows = [running([1, 2], Status.DECODING), Row(), Row()]
    long = waiting(list(range(100, 200)))
    plan = schedule(rows, [long], prefill_chunk=64)
    assert plan.admit == [(1, long, 0)] and plan.prefill == [(1, 0, 64)] and plan.decode == [0]
    plan = schedule(rows, [long], prefill_chunk=64, stored=lambda request: 48)  # (the store holds 48 tokens)
    assert plan.prefill == [(1, 48, 100)] and plan.decode == [0, 1]


def test_schedule_skips_the_cancelled_and_waits_when_no_row_is_free():
    rows = [running([1, 2], Status.DECODING), Row()]
    gone, next_one, later = waiting([3]), waiting([4, 5]), waiting([6, 7])
    gone.cancelled = True
    plan = schedule(rows, [gone, next_one, later])
    assert plan.taken == 2 and plan.admit == [(1, next_one, 0)]  # (later waits: no free row left)
    cancelled = running([8, 9, 10], Status.PREFILLING)
    cancelled.request.cancelled = True
    assert schedule([cancelled, Row()], []).freed == [0]


def test_schedule_speculates_a_plain_request_in_row_0():
    rows = [Row(), Row()]
    plain_one, penalized = waiting([1, 2, 3]), waiting([4, 5], SamplerSettings(repetition_penalty=1.2))
    plan = schedule(rows, [penalized, plain_one], drafting=True)
    assert plan.admit == [(0, penalized, 0), (1, plain_one, 0)] and plan.speculate is None  # (row 0 taken first)
    plan = schedule(rows, [plain_one, penalized], drafting=True)
    assert plan.speculate is plain_one and plan.round and plan.admit == [(1, penalized, 0)]
    assert schedule(rows, [plain_one], drafting=True, speculating=True).speculate is None
