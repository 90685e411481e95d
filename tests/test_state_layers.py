"""Layers whose memory is a state (layer_kinds.py section 3): Qwen3.5's Gated DeltaNet, LFM2's short conv and Granite
4.0 H's Mamba2. Tiny random models made with transformers are the oracle; each cached path (chunks with padding, rows,
left-padded batches, a conversation's next turn, the compiled step) is checked against the plain pass."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import FIXTURES, ROOT, answer

import dense
import layer_kinds
from dense_engine.formats import checkpoint, load
from dense_engine.formats.load import LoadRecord
from dense_engine.runtime import caches, generate
from dense_engine.runtime.sampling import SamplerSettings
from dense_engine.runtime.session import Session, Settings

QWEN = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_key_head_dim": 8, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "max_position_embeddings": 512, "eos_token_id": 2}
LFM2 = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "layer_types": ["conv", "full_attention", "conv", "conv", "full_attention"],
        "num_hidden_layers": 5, "eos_token_id": 2}
FALCON_H1 = {"vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "num_hidden_layers": 3, "intermediate_size": 96, "mamba_d_ssm": 128, "mamba_n_heads": 8,
             "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16, "max_position_embeddings": 512,
             "eos_token_id": 2, "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5, "key_multiplier": 0.7,
             "attention_in_multiplier": 1.3, "attention_out_multiplier": 0.8, "ssm_in_multiplier": 1.2,
             "ssm_out_multiplier": 0.9, "ssm_multipliers": [0.5, 1.5, 0.8, 1.2, 0.6], "mlp_multipliers": [1.1, 0.7]}
CASES = {  # name: (transformers class, its config)
    "qwen3_5 3 linear + 1 full": ("Qwen3_5ForCausalLM", transformers.Qwen3_5TextConfig(
        vocab_size=512, num_hidden_layers=4, **QWEN)),
    "qwen3_5 6 layers untied": ("Qwen3_5ForCausalLM", transformers.Qwen3_5TextConfig(
        vocab_size=512, num_hidden_layers=6, tie_word_embeddings=False, **QWEN)),
    "qwen3_5 image-text wrapper": ("Qwen3_5ForConditionalGeneration", transformers.Qwen3_5Config(
        text_config=dict(vocab_size=512, num_hidden_layers=4, **QWEN),
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2})),
    "lfm2": ("Lfm2ForCausalLM", transformers.Lfm2Config(vocab_size=512, **LFM2)),
    # Mamba2 layers (8 heads of 16 channels, B and C in 2 groups of 16) around one attention layer without rope,
    # Granite's four multipliers, the dense form (no experts)
    "granite 4.0 h": ("GraniteMoeHybridForCausalLM", transformers.GraniteMoeHybridConfig(
        vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
        layer_types=["mamba", "mamba", "attention", "mamba"], num_local_experts=0, shared_intermediate_size=96,
        mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=16, mamba_expand=2,
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0,
        position_embedding_type="nope", max_position_embeddings=512, eos_token_id=2)),
    # blocks of Mamba2, attention without rope, squared-ReLU MLPs: (M -) (* -) (M) (M -) as this engine's layers
    "nemotron-h": ("NemotronHForCausalLM", transformers.NemotronHConfig(
        vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layers_block_type=["mamba", "mlp", "attention", "mlp", "mamba", "mamba", "mlp"], intermediate_size=96,
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, max_position_embeddings=512,
        eos_token_id=2)),
    # Gated DeltaNet layers with their own q, k, v, g, a, b projections, beta doubled (negative eigenvalues), Llama's
    # pre-norms, around one attention layer of OLMo 3's (post-norms only, q/k norms over the whole projection)
    "olmo hybrid": ("OlmoHybridForCausalLM", transformers.OlmoHybridConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=4, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=16, max_position_embeddings=512, eos_token_id=2, pad_token_id=0)),
    # LFM2's short convs (a window of 7) between a full layer (proportional rope on half of each head) and a sliding
    # one (a window of 8), a sigmoid gate per head, norms before and after each branch
    "lfm3": ("Lfm3ForCausalLM", transformers.Lfm3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=6, sliding_window=8, max_position_embeddings=512, pad_token_id=0,
        eos_token_id=2, bos_token_id=1)),
    # attention and Mamba2 side by side in each layer (8 heads of 16 channels, 2 groups of B and C), every one of
    # Falcon-H1's muP multipliers away from 1; its releases' two SSM outputs: silu(z)-gated, or then normed by groups
    "falcon-h1": ("FalconH1ForCausalLM", transformers.FalconH1Config(**FALCON_H1)),
    "falcon-h1 normed": ("FalconH1ForCausalLM", transformers.FalconH1Config(
        **FALCON_H1, mamba_rms_norm=True, mamba_norm_before_gate=False)),
}
STATEFUL = ["qwen3_5 3 linear + 1 full", "lfm2", "granite 4.0 h", "nemotron-h", "olmo hybrid", "lfm3", "falcon-h1"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{case: a saved tiny random model}: weights drawn wider than transformers' init (std 0.05; the norms as made)
    so that its greedy tokens vary, and the fixture llama's tokenizer (512 tokens) beside them."""
    made = {}
    for i, (name, (cls, config)) in enumerate(CASES.items()):
        folder = tmp_path_factory.mktemp("state") / name.replace(" ", "_")
        model = save_random(cls, config, i, folder)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(FIXTURES, "llama", f), folder)
        made[name] = (str(folder), model.eval())
    return made


def save_random(cls: str, config, seed: int, folder):
    """A transformers model of the class, its weights drawn with std 0.05 (the norms as made), saved in folder."""
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(config)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" not in key:
                p.normal_(0, 0.05)
    model.save_pretrained(folder)
    return model


def prompt(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_equal_transformers(folders, case):
    folder, reference = folders[case]
    ids = prompt(150, batch=2)  # (three chunks of the chunked rule: 64, 64, 22)
    with torch.no_grad():
        want = reference(input_ids=ids).logits.float()
        want_tokens = reference.generate(ids[:1, :40], max_new_tokens=24, do_sample=False)[0, 40:].tolist()
    model = load.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        got = model(ids)
    assert (got - want).abs().max() < 1e-4
    tokens = generate.generate(model, ids[:1, :40], 24)[0, 40:].tolist()
    tokens = tokens[:tokens.index(2) + 1] if 2 in tokens else tokens  # (transformers stops at eos, 2)
    assert tokens == want_tokens and len(set(tokens)) > 3  # (tokens that vary: the test can tell models apart)


@pytest.mark.parametrize("adjust", [True, False])
def test_an_lfm2_ffn_width_is_read_as_transformers_reads_it(tmp_path, adjust):
    """block_auto_adjust_ff_dim: two thirds of intermediate_size, times the multiplier, rounded up to a multiple;
    without it, intermediate_size as given (the multiplier then changes nothing)."""
    torch.manual_seed(0)
    config = transformers.Lfm2Config(vocab_size=512, block_auto_adjust_ff_dim=adjust, block_ffn_dim_multiplier=1.5,
                                     block_multiple_of=32, **{**LFM2, "intermediate_size": 100})
    reference = transformers.Lfm2ForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    ids = prompt(20)
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    model = load.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert model.config.intermediate_size == (128 if adjust else 100)  # (2/3 of 100 is 66, times 1.5 is 99: 128)
    assert (model(ids) - want).abs().max() < 1e-4


def test_mamba2s_chunked_form_equals_its_recurrence_a_token_at_a_time():
    torch.manual_seed(1)
    B, H, T, P, N = 2, 3, 45, 5, 4
    x, Bm, Cm = (torch.randn(B, H, T, d, dtype=torch.float64) for d in (P, N, N))
    dt, A = torch.rand(B, H, T, dtype=torch.float64), -torch.rand(H, dtype=torch.float64) * 2
    state = torch.randn(B, H, P, N, dtype=torch.float64)
    outs, one = [], state
    for t in range(T):
        out, one = layer_kinds.ssd_step(x[:, :, t:t + 1], dt[:, :, t:t + 1], A, Bm[:, :, t:t + 1], Cm[:, :, t:t + 1],
                                        one)
        outs.append(out)
    chunked, last = layer_kinds.ssd_chunks(x, dt, A, Bm, Cm, state, size=16)  # (chunks of 16, 16 and 13 + padding)
    assert torch.allclose(chunked, torch.cat(outs, dim=2), atol=1e-10) and torch.allclose(last, one, atol=1e-10)


def test_the_chunked_rule_equals_the_rule_a_token_at_a_time():
    torch.manual_seed(0)
    B, H, T, Dk, Dv = 2, 3, 45, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, T, Dk, dtype=torch.float64), dim=-1) for _ in range(2))
    v = torch.randn(B, H, T, Dv, dtype=torch.float64)
    g, beta = -torch.rand(B, H, T, dtype=torch.float64) * 2, torch.rand(B, H, T, dtype=torch.float64)
    state = torch.randn(B, H, Dk, Dv, dtype=torch.float64)
    outs, one = [], state
    for t in range(T):
        out, one = layer_kinds.delta_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], g[:, :, t:t + 1],
                                    beta[:, :, t:t + 1], one)
        outs.append(out)
    chunked, last = layer_kinds.delta_chunks(q, k, v, g, beta, state, size=16)  # (chunks of 16, 16 and 13 + padding)
    assert torch.allclose(chunked, torch.cat(outs, dim=2), atol=1e-10) and torch.allclose(last, one, atol=1e-10)


@pytest.fixture(scope="module")
def models(folders):
    return {name: load.from_pretrained(folders[name][0], dtype=torch.float32)
            for name in STATEFUL}


@pytest.mark.parametrize("case", STATEFUL)
def test_cached_steps_equal_the_plain_pass(models, case):
    """A prompt in chunks whose padding goes to the scratch slot, then decode steps, on row 1 of 3 while rows 0 and
    2 hold other sequences: the plain pass's logits."""
    model = models[case]
    S, chunk = 96, 16
    model.setup_cache(3, S)
    ids, others = prompt(45, seed=1), prompt(45, seed=2, batch=3)
    with torch.no_grad():
        want = model(ids)[0]
        model(others[:, :44], torch.arange(44))  # rows 0..2 hold others' states
        got = []
        for start in range(0, 37, chunk):  # 37 prompt tokens: chunks of 16, 16 and 5 + 11 padding
            n = min(chunk, 37 - start)
            pos = torch.cat([torch.arange(start, start + n), torch.full((chunk - n,), S)])
            piece = torch.cat([ids[:, start:start + n], torch.zeros(1, chunk - n, dtype=torch.long)], 1)
            got.append(model(piece, pos, rows=torch.tensor([1]))[0, :n])
        for t in range(37, 45):  # decode steps of all 3 rows, rows 0 and 2 idle (at the scratch slot)
            step = torch.stack([others[0, :1], ids[0, t:t + 1], others[2, :1]])
            got.append(model(step, torch.tensor([[S], [t], [S]]))[1])
        again = model(others[:, 44:45], torch.tensor([[44], [45], [44]]))  # the idle rows were left as they were
        whole = model(others)[:, -1]
    assert (torch.cat(got) - want).abs().max() < 1e-4
    assert (again[[0, 2], 0] - whole[[0, 2]]).abs().max() < 1e-4


@pytest.mark.parametrize("case", STATEFUL)
def test_a_left_padded_batch_equals_each_prompt_alone(models, case):
    model = models[case]
    prompts = [prompt(9, seed=3)[0], prompt(30, seed=4)[0], prompt(17, seed=5)[0]]
    alone = [generate.generate(model, p[None], 12)[0, len(p):].tolist() for p in prompts]
    together = generate.generate(model, prompts, 12)
    assert [t.tolist() for t in together] == alone


def test_a_conversation_that_changes_its_past_starts_the_state_again(models, folders, tmp_path):
    """A next turn that extends the cached tokens goes on from the state; one that rewrites them (a regenerated
    reply) prefills from the start: the answers equal fresh runs."""
    model = models["qwen3_5 3 linear + 1 full"]
    from dense_engine.formats.vocab import load_vocabulary

    vocab = load_vocabulary(folders["qwen3_5 3 linear + 1 full"][0], None)
    session = Session(model, vocab, Settings(SamplerSettings(0.0), max_new_tokens=8),
                      LoadRecord(max_seq_len=128, compile=False))
    first, second, rewritten = prompt(20, seed=6)[0].tolist(), prompt(10, seed=7)[0].tolist(), prompt(
        25, seed=8)[0].tolist()

    def fresh(ids):
        out = generate.generate(model, torch.tensor([ids]), 8)[0, len(ids):].tolist()
        return out[:next((i for i, t in enumerate(out) if t in vocab.stop_ids), len(out))]

    reply, _ = session.reply(first, lambda s: None)
    assert reply == fresh(first)
    follow = first + reply + second
    reply2, stats = session.reply(follow, lambda s: None)
    assert stats.reused > 0 and reply2 == fresh(follow)
    reply3, stats = session.reply(first[:5] + rewritten, lambda s: None)
    assert stats.reused == 0 and reply3 == fresh(first[:5] + rewritten)
    from dense_engine.cli import repl  # (chat.py's /model and /save: what they say of a state model)

    assert "float32, and state layers" in repl.describe_model(session, "ckpt", "weights: full precision")
    assert "not saved" in repl.save_cache_beside(session, str(tmp_path / "talk"))
    assert not os.path.exists(tmp_path / "talk.cache")


@pytest.mark.parametrize("case", ["qwen3_5 3 linear + 1 full", "granite 4.0 h", "falcon-h1"])
def test_the_compiled_decode_step_equals_eager(models, case):
    model = models[case]
    ids = prompt(21, seed=9)
    eager = generate.generate(model, ids, 16)
    assert torch.equal(generate.generate(model, ids, 16, compile=True), eager)


@pytest.mark.parametrize("case, draft", [("qwen3_5 3 linear + 1 full", "lookup"), ("qwen3_5 3 linear + 1 full", "int4"),
                                         ("granite 4.0 h", "int4"), ("falcon-h1", "int4")])
def test_speculative_decoding_equals_plain_greedy(models, case, draft):
    """A rejected draft token went into the target's state (and the draft's): each round starts again from the
    state it began with, fed only the accepted tokens. Drafts that are partly rejected, so that path runs."""
    from dense_engine.runtime import speculative

    model = models[case]
    ids = prompt(30, seed=11)
    ids = torch.cat([ids, ids[:, :12], ids[:, 5:20]], 1)  # (repeats: prompt lookup finds drafts)
    plain = generate.generate(model, ids, 40)[0, ids.shape[1]:].tolist()
    made = speculative.LookupDraft(3) if draft == "lookup" else speculative.ModelDraft(
        speculative.quantized_copy(model, draft))
    stats = {}
    tokens = [t for step in speculative.generate_rounds(model, ids, 40, made, speculate_k=4, stats=stats)
              for t in step]
    assert tokens == plain and stats["proposed"] > stats["accepted"] + 4


@pytest.mark.parametrize("case", STATEFUL[:3] + ["falcon-h1"])  # (Falcon-H1: a state and keys in each layer)
def test_the_prefix_store_reuses_a_prefix_up_to_its_last_kept_state(models, folders, monkeypatch, case):
    """A state model's prefill stops at snapshot points (every 4 blocks, the prompt's last whole block), where the
    store keeps the blocks and the state after them. A prompt sharing a prefix with an earlier one, on another row,
    starts its prefill at the last snapshot within the shared prefix; its greedy reply equals a cold prefill's. With
    room for few blocks: the same replies, the store full and within its bound, every kept block and state the
    store's."""
    from conftest import run_alone

    from dense_engine.formats import vocab as vocab_module
    from dense_engine.server import runner
    from dense_engine.server.prefix_store import PrefixStore
    from dense_engine.server.scheduler import Request, Scheduler, token_bytes

    model = models[case]
    vocab = vocab_module.load_vocabulary(folders[case][0], None)
    greedy = lambda ids, n: Request(ids, n, SamplerSettings(), [], torch.Generator().manual_seed(0), lambda e: None)
    starts, calls = [], runner.ModelCalls.call

    def counting(self, name, **args):
        if name == "prefill" and self is not cold.calls:
            starts.append(args["start"])
        return calls(self, name, **args)

    monkeypatch.setattr(runner.ModelCalls, "call", counting)
    shared, tails = prompt(100, 1)[0].tolist(), [prompt(20, seed)[0].tolist() for seed in (2, 3, 4)]
    first, other = shared + tails[0], shared + tails[1]
    third = first + tails[2]  # first's prompt again, then more (not the row's tokens: its reply is there)
    cold = Scheduler(load.from_pretrained(folders[case][0], dtype=torch.float32), vocab, 2, 256, compile=False,
                     reuse=False)
    for blocks in (1000, 4):
        scheduler = Scheduler(model, vocab, 2, 256, compile=False)
        state = caches.states_bytes(model)
        scheduler.store = PrefixStore(blocks * 16 * token_bytes(model) + 2 * state, token_bytes(model), block=16,
                                      state_bytes=state)
        starts.clear()
        assert run_alone(scheduler, greedy(first, 6)) == run_alone(cold, greedy(first, 6))
        assert starts == [0, 64, 112]  # (16-token blocks: snapshot points 64, 112; then the last 8 tokens)
        starts.clear()
        assert run_alone(scheduler, greedy(other, 6)) == run_alone(cold, greedy(other, 6))
        if blocks == 1000:
            assert starts[0] == 64  # the shared 100 tokens: 6 whole blocks, the last state kept after 4
        starts.clear()
        assert run_alone(scheduler, greedy(third, 6)) == run_alone(cold, greedy(third, 6))
        if blocks == 1000:
            assert starts[0] == 112  # first's prompt up to its last whole block, with its state
        store = scheduler.store
        assert store.bytes <= store.capacity and (blocks == 1000 or store.bytes > store.capacity - store.block_bytes
                                                  - state)  # (full: what did not fit was not kept)
        assert set(scheduler.calls.kept) == {b.id for b in store.index.values()}
        assert set(scheduler.calls.states) == {b.id for b in store.index.values() if b.state}


def test_what_a_state_cannot_do_yet_is_refused_in_one_line(models):
    with pytest.raises(ValueError, match="state layers .* cannot be kept per slot yet"):
        caches.copy_slots(models["lfm2"], 0, 0, 16)


@pytest.mark.slow
def test_chat_answers_a_state_model_as_generate_does_and_refuses_a_prompt_cache(folders):
    folder = folders["qwen3_5 3 linear + 1 full"][0]
    run = lambda *a: subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", folder, *a],
                                    capture_output=True, text=True, cwd=ROOT,
                                    env={**os.environ, "PYTHONIOENCODING": "utf-8"}, check=False)
    done = run("--prompt", "the cat sat", "--complete", "--max-new-tokens", "16", "--temperature", "0")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    ids = tok.encode("the cat sat").ids
    model = load.from_pretrained(folder, dtype=torch.float32)
    want = generate.generate(model, torch.tensor([ids]), 16)[0, len(ids):].tolist()
    assert done.returncode == 0 and done.stdout == answer(tok.decode(want, skip_special_tokens=True)), done.stderr
    refused = run("--prompt", "hi", "--prompt-cache", os.path.join(folder, "cache.bin"))
    assert refused.returncode != 0 and refused.stderr.count("\n") == 1 and "--prompt-cache is not available" in \
        refused.stderr


@pytest.mark.slow
def test_the_server_answers_a_state_model_as_generate_does(folders, tmp_path):
    """Through the official openai client: concurrent greedy completions (more requests than rows: one waits for a
    row another used), and a conversation's next turn on the row that holds its start, each equal to generate()."""
    from test_serve import Server, assert_served_as_generate

    folder = folders["qwen3_5 3 linear + 1 full"][0]
    server = Server("--no-compile", "--max-batch", "3", "--slot-save-path", str(tmp_path), ckpt=folder)
    try:
        assert_served_as_generate(server, folder, load.from_pretrained(folder, dtype=torch.float32))
        status, body = server.request("POST", "/slots/0?action=save", {"filename": "x.bin"})
        assert status == 501 and "state layers" in json.dumps(body)
    finally:
        server.stop()


def test_value_heads_in_tiled_order_give_the_same_model(models):
    """llama.cpp's qwen35 files store a Gated DeltaNet layer's value heads tiled over the key heads (value head j
    reads key head j % K) where transformers groups them (j // (V / K)): the same weights reordered, with the switch,
    are the same model."""
    import copy

    grouped = copy.deepcopy(models["qwen3_5 3 linear + 1 full"]).double()
    tiled = tile_value_heads(copy.deepcopy(grouped))
    ids = prompt(70, seed=10)
    with torch.no_grad():
        assert torch.equal(tiled(ids), grouped(ids))
        layer = next(layer.mixer for layer in tiled.layers if isinstance(layer.mixer, layer_kinds.GatedDeltaNet))
        layer.tiled = False  # (the switch matters: the reordered weights read the grouped way differ)
        assert not torch.allclose(tiled(ids), grouped(ids), atol=1e-3)


@torch.no_grad()
def tile_value_heads(model: dense.DenseDecoder) -> dense.DenseDecoder:
    """The model with each Gated DeltaNet layer's value heads reordered as llama.cpp's qwen35 files store them."""
    for layer in model.layers:
        a = layer.mixer
        if not isinstance(a, layer_kinds.GatedDeltaNet):
            continue
        K, V, Dk, Dv = a.k_heads, a.v_heads, a.k_dim, a.v_dim
        heads = torch.arange(V).view(K, V // K).t().reshape(-1)  # tiled head j is grouped head heads[j]
        rows = (heads[:, None] * Dv + torch.arange(Dv)).reshape(-1)
        w, qk, vd = a.in_proj.weight, 2 * K * Dk, V * Dv
        a.in_proj.weight.copy_(torch.cat([w[:qk], w[qk:qk + vd][rows], w[qk + vd:qk + 2 * vd][rows],
                                          w[qk + 2 * vd:qk + 2 * vd + V][heads], w[qk + 2 * vd + V:][heads]]))
        a.conv_weight[qk:] = a.conv_weight[qk:][rows].clone()
        a.A_log.copy_(a.A_log[heads]), a.dt_bias.copy_(a.dt_bias[heads])
        a.out_proj.weight.copy_(a.out_proj.weight[:, rows])
        a.tiled = True
    extras = model.config.extras
    extras["gated_deltanet"] = dataclasses.replace(extras["gated_deltanet"], tiled_values=True)
    return model


def test_a_chat_template_saved_apart_is_read_and_rendered_as_transformers_does(folders, tmp_path):
    """transformers 5 saves a folder's chat template as chat_template.jinja (Qwen3.5's own folders ship it so)."""
    import json as json_module

    from dense_engine.formats.vocab import load_vocabulary

    folder = tmp_path / "jinja"
    shutil.copytree(folders["qwen3_5 3 linear + 1 full"][0], folder)
    config = json_module.loads((folder / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json_module.dumps(config))
    (folder / "chat_template.jinja").write_text(template.replace("<|im_start|>assistant", "<|im_start|>assistant\n"
                                                                 "<think>\n"))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    want = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    vocab = load_vocabulary(str(folder), None)
    assert "<think>" in want and vocab.render(messages) == want


@pytest.mark.parametrize("mode", ["int8", "int4", "nf4"])
def test_a_quantized_mamba2_model_computes_what_its_weights_say(folders, mode):
    """Quantized at load (the Mamba2 projections too): the logits of a plain float model holding each quantized
    layer's dequantized weight, up to the activations' rounding (as tests/test_quantize.py)."""
    from test_quantize import quantized_reference, rel_err

    model = load.from_pretrained(folders["granite 4.0 h"][0], dtype=torch.float32, quant=mode)
    assert not isinstance(model.layers[0].mixer.in_proj, torch.nn.Linear)
    ids = prompt(40, seed=12)
    assert rel_err(model(ids), quantized_reference(model)(ids)) < 5e-2


def test_granite_4_h_with_experts_or_across_ranks_is_refused_in_one_line(folders, tmp_path):
    from dense_engine.formats import convert
    from dense_engine.runtime import tp
    from dense_engine.system.errors import CheckpointError

    folder = folders["granite 4.0 h"][0]
    config = json.loads(Path(folder, "config.json").read_text())
    changed = tmp_path / "experts"
    shutil.copytree(folder, changed)
    (changed / "config.json").write_text(json.dumps({**config, "num_local_experts": 4}))
    # (experts are read now, tests/test_experts_hybrid.py: a config that says 4 over a folder without them is refused
    # for the tensors it lacks)
    assert convert.read_foreign(str(changed)).config.extras["experts"].count == 4
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.0\.mlp\.") as e:
        load.from_pretrained(str(changed))
    assert "\n" not in str(e.value)
    config = load.from_pretrained(folder).config  # (its heads in 2 groups split over 2 ranks; over 4, a normed group
    # would span 2 of them: not yet)
    assert [s.mamba_groups for s in tp.plan(config, 1, 2)] == [(1, 2), (1, 2), (0, 0), (1, 2)]  # (layer 2: attention)
    with pytest.raises(CheckpointError, match=r"Mamba2 heads' 2 groups of B and C \(normed by groups\) do not divide"):
        tp.plan(config, 0, 4)


def test_falcon_h1_as_its_reference_does_not_run_it_is_refused_in_one_line(folders, tmp_path):
    from dense_engine.runtime import tp
    from dense_engine.system.errors import CheckpointError

    folder = folders["falcon-h1 normed"][0]
    config = json.loads(Path(folder, "config.json").read_text())
    changed = tmp_path / "before"
    shutil.copytree(folder, changed)
    (changed / "config.json").write_text(json.dumps({**config, "mamba_norm_before_gate": True}))
    with pytest.raises(CheckpointError,
                       match=r"mamba_norm_before_gate True is not supported .*after the silu\(z\) gate") as e:
        load.from_pretrained(str(changed))
    assert "\n" not in str(e.value)
    config = load.from_pretrained(folder).config  # (one group without a norm: each rank reads it whole)
    one_group = checkpoint.replaced(config, mamba_heads=(8, 16, 1, 16), mamba_norm=False)
    assert [s.mamba_groups for s in tp.plan(one_group, 1, 2)] == [(0, 1)] * 3


@pytest.mark.parametrize("arch, kinds, widths", [
    ("granitehybrid", ["mamba", "mamba", "full_attention", "mamba"], 96),
    ("nemotron_h", ["mamba", "full_attention", "mamba", "mamba"], [96, 96, 0, 96]),
    ("falcon-h1", ["hybrid"] * 3, 96)])
def test_a_mamba2_hybrid_gguf_gives_llama_cpps_logits_and_ids(arch, kinds, widths):
    """granitehybrid (Granite 4.0 H), nemotron_h and falcon-h1 as llama.cpp's converter writes them
    (tests/fixtures/converted_gguf, tests/converted_gguf_reference.py): Mamba2 layers where head_count_kv is 0 (ssm_a =
    -exp(A_log), ssm_d and ssm_norm reshaped, squeezed conv kernels), attention with llama's turned q/k rows and no
    rope; Granite's four scales; Nemotron-H's blocks grouped into layers (its MLP blocks' norms the layers' mlp_norm);
    Falcon-H1's attention (with rope) and Mamba2 in every layer, its multipliers folded by the converter: llama.cpp's
    logits (a float32 cache) within 1e-3 of their largest, the same argmax, and its token ids; through the cache,
    the plain path's argmax loop."""
    from dense_engine.formats import gguf_import, vocab

    path = os.path.join(FIXTURES, "converted_gguf", f"{arch}.gguf")
    with open(os.path.join(FIXTURES, "converted_gguf", f"{arch}.json")) as f:
        reference = json.load(f)
    model = load.from_pretrained(path, dtype=torch.float32)
    assert model.config.layer_types == kinds and model.config.intermediate_size == widths
    assert model.config.extras["mamba2"].heads == (8, 16, 2, 16)
    assert layer_kinds.record(model.config, "rotary").nope_layers == (None if arch == "falcon-h1" else [0, 1, 2, 3])
    with torch.no_grad():
        got = model(torch.tensor([reference["ids"]]))[0]
    want = torch.tensor(reference["logits"])
    assert (got - want).abs().max() < 1e-3 * want.abs().max(), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    ids = torch.tensor([reference["ids"][:9]])
    plain = ids
    for _ in range(12):
        plain = torch.cat([plain, model(plain)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generate.generate(model, ids, 12), plain)
    tokenizer = vocab.gguf_tokenizer(gguf_import.open_gguf(path), path)
    for text, tokens in zip(reference["texts"], reference["tokens"]):
        assert tokenizer.encode(text, add_special_tokens=False).ids == tokens, text


def test_nemotron_h_blocks_become_layers_and_what_is_not_dense_is_refused(models, folders, tmp_path):
    """Each mixing block and the MLP block after it are one layer (no MLP where none follows); a moe block the
    experts of the layer before it (tests/test_experts_hybrid.py runs them: here a moe block over a folder whose block
    holds a dense MLP is refused for the experts it lacks); an MLP block after another: one line."""
    from dense_engine.formats import convert
    from dense_engine.runtime import tp
    from dense_engine.system.errors import CheckpointError

    model = models["nemotron-h"]
    assert [layer.mlp is not None for layer in model.layers] == [True, True, False, True]
    assert model.config.layer_types == ["mamba", "full_attention", "mamba", "mamba"]
    folder = folders["nemotron-h"][0]
    config = json.loads(Path(folder, "config.json").read_text())
    for blocks, words in ((["mamba", "moe", "attention", "mlp", "mamba", "mamba", "mlp"],
                           r"missing tensor 'layers\.0\.mlp\."),
                          (["mamba", "mlp", "mlp", "attention"], "an mlp or moe block after each")):
        changed = tmp_path / blocks[1]
        shutil.copytree(folder, changed)
        (changed / "config.json").write_text(json.dumps({**config, "layers_block_type": blocks}))
        with pytest.raises(CheckpointError, match=words) as e:
            load.from_pretrained(str(changed))
        assert "\n" not in str(e.value)
    # (the moe block: layer 0's MLP the experts, the others' not)
    assert convert.read_foreign(str(tmp_path / "moe")).config.extras["experts"].dense_layers == (1, 2, 3)
    # (8 heads, 2 ranks)
    assert [s.mamba_heads for s in tp.plan(model.config, 0, 2)] == [(0, 4), (0, 0), (0, 4), (0, 4)]


# ----------------------------------------------------------------------------------------------------------------
# Qwen3.5's multi-token prediction layer as a draft (--draft mtp)


class ReferenceMTP(torch.nn.Module):
    """Qwen3.5's MTP module as vLLM runs it (transformers does not), built of transformers' own Qwen3.5 layer and
    norms: fc(cat(norm(embedding of t_{i+1}), norm(h_i))), a full-attention layer, a norm; h_i the model's last
    hidden state (after its norm). Its state dict is the checkpoint's mtp.* tensors."""

    def __init__(self, config) -> None:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

        super().__init__()
        C, eps = config.hidden_size, config.rms_norm_eps
        self.fc = torch.nn.Linear(2 * C, C, bias=False)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = qwen.Qwen3_5RMSNorm(C, eps), qwen.Qwen3_5RMSNorm(C, eps)
        full = config.layer_types.index("full_attention")
        self.layers = torch.nn.ModuleList([qwen.Qwen3_5DecoderLayer(config, full)])
        self.norm = qwen.Qwen3_5RMSNorm(C, eps)

    def forward(self, model, ids: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The logits [T - 1, V] at positions 0..T-2 of ids [1, T]: each the draft for the token two ahead. hidden:
        the model's last hidden states of ids, [1, T, C], where already computed."""
        hidden = (model.model(ids).last_hidden_state if hidden is None else hidden)[:, :-1]
        embedded = model.model.embed_tokens(ids[:, 1:])
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], -1))
        T = x.shape[1]
        rope = model.model.rotary_emb(x, torch.arange(T)[None])
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        for layer in self.layers:
            x = layer(x, position_embeddings=rope, attention_mask=mask)
        return model.lm_head(self.norm(x))[0]


@pytest.fixture(scope="module")
def mtp_folder(folders, tmp_path_factory):
    """The 3 + 1 Qwen3.5 model with an MTP layer trained (on the model's own greedy continuation of one prompt) to
    predict the token two ahead, saved as Qwen3.5's checkpoints hold it (mtp.*): its drafts are often right, and only
    if the hidden states and tokens reach it at the right positions."""
    from safetensors.torch import load_file, save_file

    folder, model = folders["qwen3_5 3 linear + 1 full"]
    made = tmp_path_factory.mktemp("mtp") / "qwen3_5_mtp"
    shutil.copytree(folder, made)
    torch.manual_seed(0)
    mtp = ReferenceMTP(model.config)
    with torch.no_grad():
        text = model.generate(prompt(24, seed=21), max_new_tokens=96, do_sample=False)
        hidden = model.model(text).last_hidden_state  # (the model is not trained: its pass once, not every step)
    optimizer = torch.optim.Adam(mtp.parameters(), lr=3e-3)
    for _ in range(150):
        loss = torch.nn.functional.cross_entropy(mtp(model, text, hidden)[:-1], text[0, 2:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    weights = load_file(os.path.join(made, "model.safetensors"))
    weights.update({f"mtp.{k}": v.detach().contiguous() for k, v in mtp.state_dict().items()})
    save_file(weights, os.path.join(made, "model.safetensors"), metadata={"format": "pt"})
    return str(made), mtp.eval(), text


def test_the_mtp_draft_gives_its_reference_logits(mtp_folder, folders):
    """The engine's MTP layer (speculative.MultiTokenPredictor, through MTPDraft's own calls: the target's hidden
    states, then the predictor's cached slots) against the reference built of transformers' layer: 1e-4."""
    from dense_engine.formats import convert
    from dense_engine.runtime import speculative

    folder, reference, text = mtp_folder
    hf_model = folders["qwen3_5 3 linear + 1 full"][1]
    model = load.from_pretrained(folder, dtype=torch.float32)
    draft = speculative.mtp_draft(model, convert.read_checkpoint(folder), None)
    model.setup_cache(1, 256)
    draft.attach(generate.Runner(model, None))
    ids = text[:, :60]
    with torch.no_grad():
        want = reference(hf_model, ids)
        hidden = generate.Runner(model, None).prefill_hidden(ids, 0)[0]
        got = model.logits(draft.run(ids[0, 1:].tolist(), hidden[:-1], 0))
        halves = torch.cat([model.logits(draft.run(ids[0, 1:31].tolist(), hidden[:30], 0)),  # cached: in two calls
                            model.logits(draft.run(ids[0, 31:].tolist(), hidden[30:-1], 30))])
    assert (got - want).abs().max() <= 1e-4 and (halves - want).abs().max() <= 1e-4
    draft.reset()  # a round as generate_rounds runs it: the hidden states before the current token, then proposals
    draft.observe(hidden[:-1], 0)
    sampling = generate.Sampling.of(SamplerSettings(temperature=0.7), None)
    tokens, q = draft.propose(ids[0].tolist(), 3, sampling)
    assert len(tokens) == 3 and q.shape == (3, 512) and draft.fed == 59
    assert (q[0] - torch.softmax(want[-1] / 0.7, -1)).abs().max() <= 1e-5 and q[0, tokens[0]] > 0
    assert (want.argmax(-1)[:-1] == text[0, 2:60]).float().mean() > 0.8  # (trained: its drafts are worth checking)


def test_mtp_layers_saved_under_model_are_read_the_same(mtp_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    from dense_engine.formats import convert

    folder = mtp_folder[0]
    shutil.copytree(folder, tmp_path / "m")
    weights = load_file(os.path.join(folder, "model.safetensors"))
    save_file({("model." + k if k.startswith("mtp.") else k): v for k, v in weights.items()},
              str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    want, got = convert.read_checkpoint(folder).mtp, convert.read_checkpoint(str(tmp_path / "m")).mtp
    assert sorted(got) == sorted(want) and all(torch.equal(got[k](), want[k]()) for k in want)


@pytest.mark.parametrize("quant", [None, "int8"])
def test_speculation_with_the_mtp_draft_equals_plain_greedy(mtp_folder, quant):
    """--draft mtp: the target's exact greedy tokens, most drafts accepted (a draft from a misplaced hidden state or
    token would be refused: the layer learned these positions' next-but-one tokens); the rejected ones went into the
    target's state and were taken back. int8: the target and the predictor quantized alike (its greedy tokens leave
    the float model's after a few: the drafts, learned on those, are mostly refused; the output stays exact)."""
    from dense_engine.cpu import quantized
    from dense_engine.formats import convert
    from dense_engine.runtime import speculative

    folder, _, text = mtp_folder
    model = load.from_pretrained(folder, dtype=torch.float32, quant=quant)
    draft = speculative.mtp_draft(model, convert.read_checkpoint(folder), quant)
    ids = text[:, :24]
    plain = generate.generate(model, ids, 80)[0, 24:].tolist()
    stats = {}
    tokens = [t for step in speculative.generate_rounds(model, ids, 80, draft, speculate_k=3, stats=stats)
              for t in step]
    assert tokens == plain and stats["proposed"] > stats["accepted"]
    if quant is None:
        assert stats["accepted"] > 0.5 * stats["proposed"]
    else:
        assert isinstance(draft.predictor.layers[0].mixer.qkv_proj, quantized.QuantLinear)


def test_chat_drafts_with_the_mtp_layers_as_it_answers_without_and_refuses_a_folder_without_them(mtp_folder,
                                                                                                  folders):
    folder = mtp_folder[0]
    run = lambda ckpt, *a: subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", ckpt, *a],
                                          capture_output=True, text=True, cwd=ROOT,
                                          env={**os.environ, "PYTHONIOENCODING": "utf-8"}, check=False)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    ids = tok.encode("the cat sat").ids
    want = generate.generate(load.from_pretrained(folder, dtype=torch.float32), torch.tensor([ids]), 24)
    done = run(folder, "--draft", "mtp", "--prompt", "the cat sat", "--complete", "--max-new-tokens", "24",
               "--temperature", "0")
    assert done.returncode == 0 and done.stdout == answer(tok.decode(want[0, len(ids):].tolist(),
                                                                     skip_special_tokens=True)), done.stderr
    refused = run(folders["qwen3_5 3 linear + 1 full"][0], "--draft", "mtp", "--prompt", "hi")
    assert refused.returncode != 0 and "no multi-token prediction layers" in refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
