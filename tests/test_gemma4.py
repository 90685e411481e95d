"""Gemma 4 (dense.py's per-layer embeddings, keys and values read from an earlier layer, full layers of their own
head size with proportional rope, values normed or made from the keys, a learned scalar per layer, 26B-A4B's experts
beside the MLP) against transformers' own model: tiny random checkpoints, float32 logits without a cache within
1e-4, greedy tokens through the cache equal; the cache holds only the layers that write it."""

import copy
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import FIXTURES
from test_state_layers import save_random

from dense_engine.formats import load
from dense_engine.runtime import caches, generate

TEXT = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "sliding_window": 6,
        "max_position_embeddings": 256, "eos_token_id": 2}
SIX = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
       "full_attention"]
CASES = {  # name: (transformers class, config)
    # per-layer embeddings, the last two layers reading layers 2 and 3's keys and values (twice as wide MLPs)
    "per-layer embeddings, shared keys and values": ("Gemma4ForCausalLM", transformers.Gemma4TextConfig(
        **TEXT, num_hidden_layers=6, layer_types=SIX, hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
        num_kv_shared_layers=2, use_double_wide_mlp=True)),
    # the full layers' values are their keys' projection, one key/value head there; a final soft-cap
    "k = v, final soft-cap": ("Gemma4ForCausalLM", transformers.Gemma4TextConfig(
        **TEXT, num_hidden_layers=6, layer_types=SIX, hidden_size_per_layer_input=0, attention_k_eq_v=True,
        num_global_key_value_heads=1, final_logit_softcapping=5.0)),
    # the Hub's layout: the text model under model.language_model, a vision tower beside it
    "wrapper": ("Gemma4ForConditionalGeneration", transformers.Gemma4Config(
        text_config=dict(**TEXT, num_hidden_layers=4, layer_types=SIX[1:3] * 2, hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=512),
        vision_config={"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "num_key_value_heads": 2, "head_dim": 16}, audio_config=None)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{case: (folder, the transformers model)}: weights drawn with std 0.05 (norms as made, layer scalars about 1),
    the fixture llama's tokenizer beside them."""
    made = {}
    for i, (name, (cls, config)) in enumerate(CASES.items()):
        folder = tmp_path_factory.mktemp("gemma4") / f"case{i}"
        model = save_random(cls, config, i, folder)
        with torch.no_grad():  # (saved again with them)
            for key, b in model.named_buffers():
                if key.endswith("layer_scalar"):
                    b.uniform_(0.5, 1.5)
        model.save_pretrained(folder)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(FIXTURES, "llama", f), folder)
        made[name] = (str(folder), model.eval())
    return made


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_equal_transformers(folders, case):
    folder, reference = folders[case]
    model = load.from_pretrained(folder, dtype=torch.float32)
    prompt = ids(20)  # (past the window of 6: the sliding layers see only their window)
    with torch.no_grad():
        want = reference(prompt).logits
    got = model(prompt)
    assert (got - want).abs().max() < 1e-4 * want.abs().max(), (got - want).abs().max()
    with torch.no_grad():
        greedy = reference.generate(prompt, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert torch.equal(generate.generate(model, prompt, 16), greedy)


def test_a_bfloat16_per_layer_table_stays_bfloat16_and_reads_the_same(folders, tmp_path):
    """The per-layer table is only looked up: a float32 load keeps it as stored (half the memory), its rows widened as
    they are read: logits as transformers' float32 model of the same bfloat16 folder."""
    _, reference = folders["per-layer embeddings, shared keys and values"]
    copy.deepcopy(reference).to(torch.bfloat16).save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(FIXTURES, "llama", f), tmp_path)
    model = load.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert model.embed_per_layer.weight.dtype == torch.bfloat16 and model.embed_tokens.weight.dtype == torch.float32
    widened = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    prompt = ids(20)
    with torch.no_grad():
        want = widened(prompt).logits
    got = model(prompt)
    assert (got - want).abs().max() < 1e-4 * want.abs().max(), (got - want).abs().max()


def test_the_cache_holds_only_the_layers_that_write_it(folders):
    folder, _ = folders["per-layer embeddings, shared keys and values"]
    model = load.from_pretrained(folder, dtype=torch.float32)
    caches.setup_cache(model, 2, 64)
    readers = [i for i, layer in enumerate(model.layers) if layer.mixer.reads is not None]
    assert readers == [4, 5] and [model.layers[i].mixer.reads for i in readers] == [3, 2]
    assert all(model.layers[i].mixer.memory is model.layers[model.layers[i].mixer.reads].mixer.memory for i in readers)
    assert len(caches.memories(model)) == 4
    writers = [layer.mixer for layer in model.layers[:4]]  # (the full layers' heads are twice as wide)
    held = sum(caches.KVCache.bytes_for(2, a.n_kv_heads, 64, a.head_dim, torch.float32) for a in writers)
    assert caches.cache_bytes(model, 2, 64, torch.float32, caches.KVCache) == held


@pytest.mark.slow
def test_the_compiled_decode_step_equals_eager(folders):
    folder, _ = folders["per-layer embeddings, shared keys and values"]
    model = load.from_pretrained(folder, dtype=torch.float32)
    prompt = ids(9, 3)
    assert torch.equal(generate.generate(model, prompt, 20, compile=True), generate.generate(model, prompt, 20))


@pytest.mark.parametrize("mode", ["int8", "int4", "nf4"])
def test_quantized_layers_compute_what_their_weights_say(folders, mode):
    """Quantized at load (the per-layer embeddings' gates and projections too): the logits of a plain float model
    holding each quantized layer's dequantized weight, up to the activations' rounding (as tests/test_quantize.py)."""
    from test_quantize import quantized_reference, rel_err

    folder, _ = folders["per-layer embeddings, shared keys and values"]
    model = load.from_pretrained(folder, dtype=torch.float32, quant=mode)
    prompt = ids(12, 5)
    assert rel_err(model(prompt), quantized_reference(model)(prompt)) < 5e-2


# Gemma 4 26B-A4B's mixture (enable_moe_block): beside each layer's MLP, experts chosen by a router with its own
# norm, scale and per-expert scales; each branch post-normed, their sum post-normed again
MOE = transformers.Gemma4TextConfig(**{**TEXT, "vocab_size": 256}, num_hidden_layers=4, layer_types=SIX[1:3] * 2,
                                    hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=8,
                                    top_k_experts=2, moe_intermediate_size=32)


def test_experts_beside_the_mlp_give_transformers_logits_and_greedy_tokens(tmp_path):
    """A tiny random 26B-A4B (8 experts, top 2; the router's scales, the per-expert scales and every norm drawn about
    1, so that a misplaced one shows): float32 logits of a 40-token prompt within 1e-4 of transformers' largest, and
    its greedy tokens through the cache."""
    reference = save_random("Gemma4ForCausalLM", MOE, 7, tmp_path)
    with torch.no_grad():
        for key, p in reference.named_parameters():
            if "norm" in key or key.endswith(("router.scale", "per_expert_scale")):
                p.uniform_(0.5, 1.5)
        for key, b in reference.named_buffers():
            if key.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    reference.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(FIXTURES, "llama", f), tmp_path)
    model = load.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert model.config.extras["experts"].beside_mlp and model.layers[0].experts.experts_gate_up.shape == (8, 64, 64)
    prompt = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    reference.eval()
    with torch.no_grad():
        want = reference(prompt).logits
        greedy = reference.generate(prompt, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    got = model(prompt)
    assert (got - want).abs().max() < 1e-4 * want.abs().max(), (got - want).abs().max()
    tokens = generate.generate(model, prompt, 16)
    assert torch.equal(tokens, greedy) and len(set(tokens[0, 40:].tolist())) > 3, (tokens, greedy)


def test_what_is_not_done_is_refused_in_one_line(folders, tmp_path):
    """A per-layer table of another size: one line naming the key."""
    import json

    from dense_engine.system.errors import CheckpointError

    folder, _ = folders["per-layer embeddings, shared keys and values"]
    config = json.loads(Path(folder, "config.json").read_text())
    for key, value, words in (("vocab_size_per_layer_input", 256, "per-layer table"),):
        changed = tmp_path / key
        shutil.copytree(folder, changed)
        (changed / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(CheckpointError, match=f"{key} .*{words}") as e:
            load.from_pretrained(str(changed))
        assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------------------------
# GGUF files of Gemma 4 as llama.cpp's converter writes them (tests/fixtures/converted_gguf, made by
# tests/converted_gguf_reference.py), against llama.cpp's logits and token ids on the same file

GGUF = os.path.join(FIXTURES, "converted_gguf", "gemma4.gguf")


@pytest.fixture(scope="module")
def gguf_reference():
    import json

    with open(os.path.join(FIXTURES, "converted_gguf", "gemma4.json")) as f:
        return json.load(f)


def test_a_gguf_gives_llama_cpps_logits(gguf_reference):
    """Sliding layers of head size 16 and full ones of 32 (one key/value head, keys as values, partial rotation by
    rope_freqs), per-layer embeddings, two layers reading earlier ones' keys and values with MLPs twice as wide, layer
    scalars, a final soft-cap: llama.cpp's logits (a float32 cache) within 1e-3 of their largest, the same argmax."""
    model = load.from_pretrained(GGUF, dtype=torch.float32)
    config = model.config
    attention, layer, head = (config.extras[name] for name in ("attention", "layer", "head"))
    assert config.layer_types[3] == "full_attention" and attention.full_head_dim == 32 and attention.keys_are_values
    assert attention.shared_layers == 2 and layer.per_layer_input == 8 and head.softcap == pytest.approx(0.05)
    with torch.no_grad():
        got = model(torch.tensor([gguf_reference["ids"]]))[0]
    want = torch.tensor(gguf_reference["logits"])
    assert (got - want).abs().max() < 1e-3 * want.abs().max(), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    prompt = torch.tensor([gguf_reference["ids"][:9]])  # through the cache: the plain path's argmax loop
    plain = prompt
    for _ in range(12):
        plain = torch.cat([plain, model(plain)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generate.generate(model, prompt, 12), plain)


def test_a_quantized_gguf_keeps_its_per_layer_table_as_stored_blocks():
    """--outtype q8_0 (per-layer embeddings of 16 a layer: whole Q8_0 blocks a row): the per-layer table stays the
    file's blocks, a row dequantized as it is looked up (at Gemma 4 E2B's shape the table is 2.3B numbers, 9.4 GB in
    float32); the same logits as that table in float32 beside the same blocks, and llama.cpp's within 3e-2 of their
    largest, 95% of their argmax (both engines round activations to 8 bits for Q8_0 matmuls, each its own way:
    llama.cpp's logits are 1.8e-2 from the file's float32 values here, ours 2.3e-2; the final soft-cap of 0.05 leaves
    logits of 0.04)."""
    import json

    from dense_engine.cpu import quantized
    from dense_engine.formats import families, gguf_import

    path = os.path.join(FIXTURES, "converted_gguf", "gemma4-q8_0.gguf")
    with open(path.replace(".gguf", ".json")) as f:
        reference = json.load(f)
    model = load.from_pretrained(path, dtype=torch.float32, quant="auto")  # (the programs' default)
    assert isinstance(model.embed_per_layer, quantized.GGUFEmbedding) and model.embed_per_layer.kind == "Q8_0"
    ckpt = gguf_import.read_gguf(path, families.GGUF_FAMILIES)
    table = ckpt.tensors["embed_per_layer.weight"]()  # [512, 96] float32, gguf's values
    ids = torch.tensor([reference["ids"]])
    with torch.no_grad():
        assert torch.equal(model.embed_per_layer(ids[0]), table[ids[0]])
        got = model(ids)[0]
        floats = copy.copy(model)
        floats.embed_per_layer = torch.nn.Embedding.from_pretrained(table)
        assert torch.equal(floats(ids)[0], got)
    want = torch.tensor(reference["logits"])
    assert (got - want).abs().max() < 3e-2 * want.abs().max(), (got - want).abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).sum() >= 0.95 * len(want)


def test_a_gguf_tokenizes_as_llama_cpp(gguf_reference):
    from dense_engine.formats import gguf_import, vocab

    tokenizer = vocab.gguf_tokenizer(gguf_import.open_gguf(GGUF), GGUF)
    for text, want in zip(gguf_reference["texts"], gguf_reference["tokens"]):
        assert tokenizer.encode(text, add_special_tokens=False).ids == want, text


def test_a_gguf_whose_shared_layers_llama_cpp_reads_elsewhere_is_refused(tmp_path):
    """llama.cpp's code has the shared layers read layer first - 2 (sliding) or first - 1 (full): a file where that is
    not the last earlier layer of the kind (transformers' rule) is refused in one line, not run either way."""
    import gguf
    from test_gguf import rewrite

    from dense_engine.system.errors import CheckpointError

    key = "gemma4.attention.sliding_window_pattern"
    path = rewrite(GGUF, str(tmp_path / "x.gguf"), drop=(key,))
    writer_value = [True, True, False, True, True, False]
    path = rewrite(path, str(tmp_path / "y.gguf"), add={key: (writer_value, gguf.GGUFValueType.ARRAY)})
    with pytest.raises(CheckpointError, match="shared_kv_layers 2: llama.cpp has layer 4 read layer 2's") as e:
        load.from_pretrained(path)
    assert "y.gguf" in str(e.value) and "\n" not in str(e.value)
