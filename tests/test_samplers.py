"""The samplers local front-ends send (min_p, typical_p, repetition_penalty with its window), each against a
plain-PyTorch reference of its rule written here in float64, and against transformers' own logits processors; per-row
settings of a batch equal each row alone, an "off" value leaves a row's distribution bit for bit; the server's
fields reach the sampler (and a bad value is a 400 naming the field)."""

import math

import pytest
import torch

from dense_engine.runtime import generate, sampling
from dense_engine.runtime.sampling import SamplerSettings
from dense_engine.server.protocol import BadRequest, parse_request
from dense_engine.server.scheduler import Request

V = 50


def logits_rows(n=6, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(n, V, generator=g) * 3
    out[0, :5] += 6  # a peaked row
    out[1] = out[1].round()  # ties
    return out


def min_p_reference(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep the tokens whose probability is at least min_p times the largest (float64)."""
    p = torch.softmax(logits.double(), dim=-1)
    kept = p >= min_p * p.amax(dim=-1, keepdim=True)
    return torch.where(kept, logits.double(), -math.inf)


def typical_reference(logits: torch.Tensor, mass: float) -> torch.Tensor:
    """Meister et al.'s rule, one token at a time: sort by |surprise - entropy|, keep tokens until their
    probabilities reach `mass` (the one that reaches it included), and every token tied with the last one kept."""
    logits = logits.double()
    p = torch.softmax(logits, dim=-1)
    logp = torch.log(p)
    entropy = -sum(float(p[i] * logp[i]) for i in range(len(p)) if p[i] > 0)
    distance = [abs(-float(logp[i]) - entropy) if p[i] > 0 else math.inf for i in range(len(p))]
    order = sorted(range(len(p)), key=lambda i: distance[i])
    total, last = 0.0, order[-1]
    for i in order:
        total += float(p[i])
        if total >= mass:
            last = i
            break
    kept = torch.tensor([distance[i] <= distance[last] for i in range(len(p))])
    return torch.where(kept, logits, -math.inf)


def penalty_reference(logits: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    out = logits.double().clone()
    for t in set(seen):
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


def kept(probs: torch.Tensor) -> torch.Tensor:
    return probs > 0


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.1, 0.5, 1.0])
def test_min_p_keeps_what_the_rule_keeps(min_p):
    logits = logits_rows()
    for temperature in (1.0, 0.7):
        ours = sampling.probabilities(logits, temperature, min_p=min_p)
        ref = torch.softmax(min_p_reference(logits / temperature, min_p), dim=-1)
        assert torch.equal(kept(ours), kept(ref)) and torch.allclose(ours.double(), ref, atol=1e-6)


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_typical_p_keeps_what_the_rule_keeps(mass):
    logits = logits_rows()
    ours = sampling.probabilities(logits, 1.0, typical_p=mass)
    ref = torch.softmax(torch.stack([typical_reference(row, mass) for row in logits]), dim=-1)
    assert torch.equal(kept(ours), kept(ref)) and torch.allclose(ours.double(), ref, atol=1e-6)


def test_repetition_penalty_is_ctrls_rule():
    logits = logits_rows()
    seen = [3, 3, 7, 11, 0, 49]
    penalty = torch.ones(V)
    penalty[seen] = 1.3
    ours = generate.shape_logits(logits, None, penalty.expand(len(logits), V))
    ref = torch.stack([penalty_reference(row, seen, 1.3) for row in logits])
    assert torch.allclose(ours.double(), ref, atol=1e-6)
    assert torch.equal(generate.shape_logits(logits, None, torch.ones(len(logits), V)), logits)  # 1: the same bits


def test_against_transformers_processors():
    """The same settings through transformers' warpers, in the order transformers chains them."""
    tf = pytest.importorskip("transformers")
    logits = logits_rows()
    ids = torch.tensor([[3, 3, 7, 11, 0, 49]] * len(logits))
    chain = [tf.RepetitionPenaltyLogitsProcessor(1.3), tf.TemperatureLogitsWarper(0.8),
             tf.TopKLogitsWarper(30), tf.MinPLogitsWarper(0.02), tf.TypicalLogitsWarper(0.9)]
    expected = logits.clone()
    for step in chain:
        expected = step(ids, expected)
    penalty = torch.ones(len(logits), V).scatter_(1, ids, 1.3)
    ours = sampling.probabilities(generate.shape_logits(logits, None, penalty), 0.8, top_k=30, min_p=0.02,
                               typical_p=0.9)
    ref = torch.softmax(expected, dim=-1)
    assert torch.equal(kept(ours), kept(ref)) and torch.allclose(ours, ref, atol=1e-6)


def test_per_row_settings_equal_each_row_alone_and_off_is_bit_for_bit():
    logits = logits_rows()
    rows = [(0.7, 0.1, 0.9), (1.0, 0.0, 1.0), (1.3, 0.05, 0.5), (0.9, 0.0, 0.95), (1.1, 0.3, 1.0), (1.0, 0.0, 1.0)]
    temperature, min_p, typical = (torch.tensor(v, dtype=torch.float32) for v in zip(*rows))
    batch = sampling.probabilities(logits, temperature, torch.zeros(len(rows), dtype=torch.long),
                                torch.ones(len(rows)), min_p=min_p, typical_p=typical)
    for i, (t, m, p) in enumerate(rows):
        alone = sampling.probabilities(logits[i:i + 1], t, min_p=m or None, typical_p=None if p == 1 else p)
        assert torch.allclose(batch[i], alone[0], atol=1e-6), rows[i]
        if m == 0 and p == 1:
            assert torch.equal(batch[i], sampling.probabilities(logits[i:i + 1], torch.tensor([t]))[0])


def test_the_step_samples_from_that_distribution():
    """next_token with min_p / typical_p / penalties draws only kept tokens, and as often as their probability."""
    logits = logits_rows()[2:3].expand(20000, V).contiguous()
    penalty = torch.ones_like(logits).scatter_(1, torch.tensor([[0, 1]] * 20000), 2.0)
    n = len(logits)
    tokens = generate.next_token(logits, "sampled+min-p+typical", None, torch.full((n,), 0.9),
                                 torch.zeros(n, dtype=torch.long),
                                 torch.ones(n), torch.full((n,), 0.05), torch.full((n,), 0.95),
                                 torch.empty_like(logits).exponential_(1, generator=torch.Generator().manual_seed(1)),
                                 None, penalty)
    p = sampling.probabilities(generate.shape_logits(logits[:1], None, penalty[:1]), 0.9, min_p=0.05, typical_p=0.95)[0]
    counts = torch.bincount(tokens[:, 0], minlength=V).float() / 20000
    assert torch.all(counts[p == 0] == 0) and torch.allclose(counts, p, atol=0.015)


class FakeVocab:
    size, chat_template, stop_ids = 1000, None, {2}
    sampling, sampling_source = {}, "generation_config.json"

    def encode(self, text, special=False):
        return [min(ord(c), 999) for c in text]


@pytest.mark.parametrize("body,field", [({"min_p": 1.5}, "min_p"), ({"typical_p": 0}, "typical_p"),
                                        ({"repetition_penalty": 0}, "repetition_penalty"),
                                        ({"repeat_penalty": "x"}, "repeat_penalty"),
                                        ({"repeat_last_n": -2}, "repeat_last_n"),
                                        ({"repeat_penalty": 1.1, "repetition_penalty": 1.2}, "repeat_penalty"),
                                        ({"dry_multiplier": -1}, "dry_multiplier"),
                                        ({"dry_multiplier": 0.8, "dry_sequence_breakers": "\n"},
                                         "dry_sequence_breakers"),
                                        ({"dry_multiplier": 0.8, "dry_base": 0.5}, "dry_base"),
                                        ({"mirostat": 2}, "mirostat")])
def test_a_bad_sampler_value_is_a_400_naming_it(body, field):
    with pytest.raises(BadRequest) as e:
        parse_request({"prompt": "hi", **body}, "completion", FakeVocab(), 256)
    assert e.value.param == field and e.value.status == 400


def test_the_fields_reach_the_request_and_its_penalties():
    settings = parse_request({"prompt": "abcab", "min_p": 0.1, "typical_p": 0.9, "repeat_penalty": 1.25,
                              "repeat_last_n": 3, "dry_multiplier": 0, "mirostat": 0}, "completion", FakeVocab(), 256)
    assert (settings.sampler.min_p, settings.sampler.typical_p, settings.sampler.repetition_penalty,
            settings.sampler.repeat_last_n) == \
        (0.1, 0.9, 1.25, 3)
    off = parse_request({"prompt": "abcab", "min_p": 0, "typical_p": 1}, "completion", FakeVocab(), 256)
    assert (off.sampler.min_p, off.sampler.typical_p, off.sampler.repetition_penalty) == (None, None, 1.0)
    request = Request(settings.prompts[0], 4, SamplerSettings(0.8, repetition_penalty=1.25, repeat_last_n=3), [],
                      torch.Generator(), print)
    request.generated = [ord("z")]
    penalty = request.penalty(1000)  # the last 3 of "abcab" + "z": a, b, z
    assert set(torch.nonzero(penalty != 1)[:, 0].tolist()) == {ord("a"), ord("b"), ord("z")}
    assert request.shaped and torch.all(penalty[penalty != 1] == 1.25)


def test_greedy_generation_with_a_penalty_equals_a_slow_loop():
    """generate_tokens' penalty (on the device, a window of the prompt and the reply) against a loop with no cache
    that runs the whole sequence each step and applies the rule to the last repeat_last_n tokens."""
    from conftest import random_model

    model = random_model()
    prompt = [5, 17, 99, 3, 250, 7, 17, 17]
    plain = [int(t) for t in generate.generate_tokens(model, torch.tensor([prompt]), 12)]
    # (penalties below 1 favour the tokens seen: a random model's greedy text rarely repeats by itself)
    for penalty, window in ((0.7, 4), (0.7, -1), (0.8, 2), (1.5, 64)):
        ours = [int(t) for t in generate.generate_tokens(model, torch.tensor([prompt]), 12, sampler=SamplerSettings(
            repetition_penalty=penalty, repeat_last_n=window))]
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(12):
                logits = model(torch.tensor([ids]))[0, -1].double()
                seen = ids if window < 0 else ids[-window:]
                ids.append(int(penalty_reference(logits, seen, penalty).argmax()))
        assert ours == ids[len(prompt):], (penalty, window)
        assert ours != plain or penalty > 1, (penalty, window)


def test_set_takes_the_new_sampler_settings():
    from dense_engine.cli.repl import set_option
    from dense_engine.runtime.session import Settings
    from dense_engine.system.errors import UsageError

    settings = Settings()
    for line in ("min-p 0.1", "typical-p 0.9", "repetition-penalty 1.2", "repeat-last-n -1", "dry-multiplier 0.8",
                 "dry-base 2"):
        set_option(settings, line)
    assert settings.sampler == SamplerSettings(min_p=0.1, typical_p=0.9, repetition_penalty=1.2,
                                               repeat_last_n=-1, dry_multiplier=0.8, dry_base=2.0)
    assert settings.sources["min_p"] == "/set" and "min_p 0.1 (/set)".replace("_", "-") in set_option(settings, "")
    set_option(settings, "top-k 0")  # (a neutral value: off)
    assert settings.sampler.top_k is None
    set_option(settings, "repetition-penalty none")
    set_option(settings, "dry-multiplier none")
    assert settings.sampler.repetition_penalty == 1.0 and settings.sampler.dry_multiplier == 0
    for bad in ("typical-p 0", "min-p 2", "repeat-last-n -2", "repetition-penalty x", "dry-base 0.5"):
        with pytest.raises(UsageError):
            set_option(settings, bad)


def dry_reference(tokens, V, multiplier, base, allowed, breakers):
    """text-generation-webui's DRY, one earlier position at a time."""
    out = [0.0] * V
    if len(tokens) < 2 or tokens[-1] in breakers:
        return out
    longest = {}
    for i in range(len(tokens) - 1):
        if tokens[i] != tokens[-1] or tokens[i + 1] in breakers:
            continue
        n = 1
        while i - n >= 0 and tokens[i - n] == tokens[-1 - n] and tokens[i - n] not in breakers:
            n += 1
        longest[tokens[i + 1]] = max(longest.get(tokens[i + 1], 0), n)
    for token, n in longest.items():
        if n >= allowed:
            out[token] = multiplier * base ** (n - allowed)
    return out


def test_dry_penalizes_what_the_rule_penalizes():
    import random

    from dense_engine.runtime.dry import Dry

    rng = random.Random(0)
    for trial in range(200):
        V = rng.choice([5, 12, 40])
        phrase = [rng.randrange(V) for _ in range(rng.randint(2, 8))]
        tokens = [rng.randrange(V) for _ in range(rng.randint(0, 30))]
        for _ in range(rng.randint(1, 4)):  # repetitions of a phrase, with noise between
            tokens += phrase + [rng.randrange(V) for _ in range(rng.randint(0, 5))]
        tokens += phrase[:rng.randint(1, len(phrase))]
        breakers = frozenset(rng.sample(range(V), rng.randint(0, 2)))
        allowed, multiplier, base = rng.randint(1, 4), rng.choice([0.5, 0.8, 2.0]), rng.choice([1.5, 1.75])
        ours = Dry(multiplier, base, allowed, -1, breakers).penalty(tokens, V)
        ref = torch.tensor(dry_reference(tokens, V, multiplier, base, allowed, breakers))
        assert torch.allclose(ours, ref.float(), rtol=1e-6), (trial, tokens, breakers, allowed)
    window = Dry(1.0, 2.0, 2, 6).penalty([1, 2, 3, 9, 9, 9, 9, 1, 2], 10)  # the first 1 2 3 is out of the window
    assert torch.all(window == 0)
    assert Dry(1.0, 2.0, 2, -1).penalty([1, 2, 3, 9, 9, 9, 9, 1, 2], 10)[3] == 1.0


def test_greedy_generation_with_dry_equals_a_slow_loop():
    """generate_tokens' DRY against a loop with no cache that applies text-generation-webui's rule to the whole
    sequence each step; a ragged batch's rows each their own."""
    from conftest import random_model

    from dense_engine.runtime.dry import Dry

    model = random_model()
    V = model.config.vocab_size
    # the second: a phrase, the random model's greedy reply to it, the phrase again (its reply would repeat)
    prompts = [[5, 17, 99, 3, 250, 7, 17, 17, 3, 505, 384, 233, 95, 326, 269, 269],
               [5, 17, 99, 3, 250, 486, 460, 146, 437, 397, 288, 283, 355, 5, 17, 99, 3, 250]]
    dry = Dry(0.8, 1.75, 2, -1, frozenset({7}))
    plain = generate.collect(generate.generate_tokens(model, prompts, 24), prompts, None, model.device)
    ours = generate.collect(generate.generate_tokens(model, prompts, 24, dry=dry), prompts, None, model.device)
    for prompt, got, free in zip(prompts, ours, plain):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(24):
                logits = model(torch.tensor([ids]))[0, -1].double()
                ids.append(int((logits - torch.tensor(dry_reference(ids, V, 0.8, 1.75, 2, {7}))).argmax()))
        assert got.tolist() == ids[len(prompt):]
    assert any(got.tolist() != free.tolist() for got, free in zip(ours, plain))  # (DRY changed a reply)
