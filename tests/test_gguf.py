"""GGUF import against expectations computed independently: small GGUF files written with the gguf package's own
writer (random weights, several quantization types, BPE and SentencePiece vocabularies); values from gguf's
dequantizer, ids from the original `tokenizers` tokenizer, logits from the model the GGUF was made from, and, for
every architecture (tests/gguf_cases.py), llama.cpp's own logits and token ids on the same files, checked in by
tests/gguf_reference.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import gguf_cases
import numpy as np
import pytest
import torch
from conftest import ROOT, answer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import dense
from dense_engine.cpu import kernels, quantized
from dense_engine.formats import checkpoint, gguf_import, load, preread, vocab
from dense_engine.runtime import caches, generate

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(12, 345))\n",
    "Crème brûlée and naïve café; déjà vu in Zürich. 日本語のテキスト。 🙂🚀",
    "Numbers: 2024, 3.14159, 1000000 and 42.   Spaces   and\n\n\nnewlines\t\ttabs.",
]
TEXTS = CORPUS + ["unseen words: zygomorphic quokka 9876", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                  "   leading spaces", "emoji 👩‍💻 🇫🇷 ∑∫", ""]


def original_tokenizer(pre: str) -> Tokenizer:
    """A small byte-level BPE trained here; with pre='smollm' its digits are split one by one, as SmolLM2's is."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = byte_level if pre == "gpt2" else pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer)
    return tok


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's convert_hf_to_gguf.py gives q/k (written out here independently of our inverse)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model: dense.DenseDecoder, tok: Tokenizer, pre: str, types: dict) -> dict:
    """Write `model` (a Llama-layout DenseDecoder) as llama.cpp would; returns {gguf name: raw array written}."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_rope_dimension_count(cfg.head_dim)
    gguf_cases.write_bpe_vocabulary(writer, tok, pre, SPECIALS)
    writer.add_chat_template(TEMPLATE)
    state = {k: v.float().numpy() for k, v in load.checkpoint_tensors(model).items()}
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    per_layer = {"mixer_norm": "attn_norm", "mlp_norm": "ffn_norm", "mixer.q_proj": "attn_q", "mixer.k_proj": "attn_k",
                 "mixer.v_proj": "attn_v", "mixer.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
                 "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        names.update({f"layers.{i}.{ours}.weight": f"blk.{i}.{theirs}.weight" for ours, theirs in per_layer.items()})
    written = {}
    for ours, theirs in names.items():
        w = state[ours]
        if theirs.endswith("attn_q.weight"):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif theirs.endswith("attn_k.weight"):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        qtype = Q.F32 if w.ndim == 1 else types.get(theirs.split(".")[-2], Q.F32)
        raw = synthetic_k_quant(w.shape, qtype) if qtype in K_BLOCKS else gguf.quants.quantize(w, qtype)
        writer.add_tensor(theirs, raw, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
        written[theirs] = (raw, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


# gguf can dequantize K-quants but not make them: write random blocks with sane f16 scales instead.
K_BLOCKS = {Q.Q4_K: (144, [0, 2]), Q.Q5_K: (176, [0, 2]), Q.Q6_K: (210, [208])}


def synthetic_k_quant(shape, qtype, rng=None, scale: float = 0.01):
    size, scale_offsets = K_BLOCKS[qtype]
    rows, cols = shape
    rng = np.random.default_rng(0) if rng is None else rng
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for off in scale_offsets:
        blocks[..., off:off + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def small_llama(tied: bool, hidden=64, ffn=96) -> dense.DenseDecoder:
    torch.manual_seed(0)
    config = dense.DenseConfig(vocab_size=400, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                               max_position_embeddings=64, rope_theta=10000.0, qk_norm="none",
                               attn_output_gate=False, tie_word_embeddings=tied, norm_eps=1e-5)
    model = dense.DenseDecoder(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3 if p.ndim == 1 else 0.08)
        if p.ndim == 1:
            p.data += 1
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer():
    return original_tokenizer("gpt2")


@pytest.mark.parametrize("tied", [True, False])
def test_float32_gguf_gives_the_source_models_logits(tmp_path, tokenizer, tied):
    model = small_llama(tied)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tokenizer, "gpt2", {})
    loaded = load.from_pretrained(str(path))
    assert loaded.config.tie_word_embeddings == tied and loaded.config.num_key_value_heads == 2
    ids = torch.randint(0, 400, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
    assert (loaded(ids) - want).abs().max() <= 1e-5 * want.abs().max()


def test_quantized_tensors_equal_ggufs_own_dequantization(tmp_path, tokenizer):
    model = small_llama(tied=False, hidden=256, ffn=256)
    types = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.F16, "attn_output": Q.BF16,
             "ffn_gate": Q.Q4_K, "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K, "output": Q.Q8_0}
    path = tmp_path / "q.gguf"
    written = write_gguf(path, model, tokenizer, "gpt2", types)
    loaded = load.from_pretrained(str(path))
    params = load.checkpoint_tensors(loaded)
    checked = set()
    for i in range(2):
        for ours, theirs, heads in [("mixer.q_proj", "attn_q", 4), ("mixer.k_proj", "attn_k", 2),
                                    ("mixer.v_proj", "attn_v", 0), ("mixer.o_proj", "attn_output", 0),
                                    ("mlp.gate_proj", "ffn_gate", 0),
                                    ("mlp.up_proj", "ffn_up", 0), ("mlp.down_proj", "ffn_down", 0)]:
            raw, qtype = written[f"blk.{i}.{theirs}.weight"]
            values = gguf.quants.dequantize(raw, qtype)
            if heads:  # undo llama.cpp's permutation: permuting our weights back must give gguf's values
                got = llama_cpp_permute(params[f"layers.{i}.{ours}.weight"].detach().numpy(), heads)
            else:
                got = params[f"layers.{i}.{ours}.weight"].detach().numpy()
            np.testing.assert_array_equal(got, values.reshape(got.shape))
            checked.add(qtype)
    np.testing.assert_array_equal(params["embed_tokens.weight"].detach().numpy(),
                                  gguf.quants.dequantize(*written["token_embd.weight"]).reshape(400, 256))
    assert {Q.Q4_0, Q.Q4_1, Q.F16, Q.BF16, Q.Q4_K, Q.Q5_K, Q.Q6_K} <= checked


@pytest.mark.parametrize("pre", ["gpt2", "smollm"])
def test_rebuilt_tokenizer_gives_the_originals_ids(tmp_path, pre):
    original = original_tokenizer(pre)
    path = tmp_path / "t.gguf"
    write_gguf(path, small_llama(tied=True), original, pre, {})
    rebuilt = vocab.gguf_tokenizer(gguf_import.open_gguf(str(path)), str(path))
    for text in TEXTS:
        assert rebuilt.encode(text).ids == original.encode(text).ids, text
        assert rebuilt.decode(rebuilt.encode(text).ids, skip_special_tokens=False) == text
    if pre == "smollm":
        assert rebuilt.encode("2024").ids == [original.token_to_id(d) for d in "2024"]


def test_tokenizer_is_kept_in_the_cache_folder_and_rebuilt_when_the_file_changes(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "t.gguf"
    write_gguf(path, small_llama(tied=True), tokenizer, "gpt2", {})
    built = vocab.gguf_side_files(str(path))
    assert built == vocab.build_gguf_side_files(str(path))
    saved = list((tmp_path / "cache" / "dense-engine" / "tokenizers").iterdir())
    assert len(saved) == 1 and json.loads(saved[0].read_text()) == built
    saved[0].write_text(json.dumps({**built, "tokenizer_config.json": "{}"}))  # what a later run reads is the cache
    assert vocab.gguf_side_files(str(path))["tokenizer_config.json"] == "{}"
    os.utime(path, ns=(0, 0))  # the file changed: built again, not the old one
    assert vocab.gguf_side_files(str(path)) == built
    assert len(list((tmp_path / "cache" / "dense-engine" / "tokenizers").iterdir())) == 2


def test_convert_writes_a_native_folder_with_tokenizer_and_template(tmp_path, tokenizer):
    model = small_llama(tied=True)
    write_gguf(tmp_path / "m.gguf", model, tokenizer, "gpt2", {"attn_q": Q.Q8_0})
    dst = tmp_path / "native"
    result = subprocess.run([sys.executable, "-m", "dense_engine.formats.convert", str(tmp_path / "m.gguf"), str(dst)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    ids = torch.randint(0, 400, (1, 16), generator=torch.Generator().manual_seed(3))
    assert torch.equal(load.from_pretrained(str(dst))(ids),
                       load.from_pretrained(str(tmp_path / "m.gguf"))(ids))
    saved = Tokenizer.from_file(str(dst / "tokenizer.json"))
    assert saved.encode(TEXTS[1]).ids == tokenizer.encode(TEXTS[1]).ids
    tok_config = json.loads((dst / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == TEMPLATE and tok_config["eos_token"] == "<|endoftext|>"
    stops = json.loads((dst / "generation_config.json").read_text())["eos_token_id"]
    vocab = tokenizer.get_vocab()
    assert set(stops) == {vocab["<|endoftext|>"], vocab["<|im_end|>"]}  # eos, and the chat's end of turn


def test_unsupported_gguf_is_a_clear_error(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    writer.add_tensor("t", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(checkpoint.CheckpointError, match="GGUF architecture 'mamba' is not supported"):
        load.from_pretrained(str(tmp_path / "x.gguf"))
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(checkpoint.CheckpointError, match="not a readable GGUF file"):
        load.from_pretrained(str(tmp_path / "bad.gguf"))


@pytest.mark.parametrize("block_type", [Q.Q4_1, Q.Q4_0])
def test_quant_auto_loads_q4_blocks_as_int4_bit_for_bit(tmp_path, tokenizer, block_type):
    from dense_engine.formats import convert

    model = small_llama(tied=True, hidden=128, ffn=192)
    linears = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    written = write_gguf(tmp_path / "m.gguf", model, tokenizer, "gpt2",
                         {"token_embd": Q.Q8_0, **{name: block_type for name in linears}})
    dst = tmp_path / "native"
    convert.convert(str(tmp_path / "m.gguf"), str(dst))
    record = json.loads((dst / "config.json").read_text())
    assert record["source_tensor_types"] == {"blocks": {block_type.name: 14}, "other": {"Q8_0": 1, "F32": 5}}
    assert record["quantization"]["int4"]["group_size"] == 32
    assert record["quantization"]["int4"]["head"] == "Q8_0"  # the tied head: the embedding's own blocks
    mode, reason = load.auto_mode(convert.read_checkpoint(str(dst)))
    assert mode == "int4" and block_type.name in reason
    loaded = load.from_pretrained(str(dst), quant="auto")
    direct = load.from_pretrained(str(tmp_path / "m.gguf"), quant="auto")
    embedding = torch.from_numpy(gguf.quants.dequantize(*written["token_embd.weight"]).copy()).reshape(400, 128)
    plain = load.from_pretrained(str(dst), quant="none")
    ids = torch.randint(0, 400, (1, 40), generator=torch.Generator().manual_seed(0))
    hidden = plain.hidden_states(ids)[0]  # [40, C]
    exact = hidden.double() @ embedding.double().T
    for head_of in (loaded, direct):
        assert isinstance(head_of.lm_head, quantized.GGUFHead) and head_of.lm_head.kinds == ["Q8_0"]
        assert torch.equal(head_of.lm_head.dequantize(torch.float32), embedding)  # the file's own blocks
        assert torch.equal(head_of.embed_tokens.weight, embedding)  # (float32 holds Q8_0's values exactly)
        logits = head_of.logits(hidden)
        assert ((logits.double() - exact).abs() <= 1e-6 * (hidden.double().abs() @ embedding.double().abs().T)).all()
        for m in (1, 12, 13) if kernels.available() else ():  # a row's logits whatever the rows beside it (a
            assert torch.equal(head_of.logits(hidden[:m]), logits[:m])  # batch, a prompt's echo; PyTorch's: no)
    for i in range(2):
        def gguf_rows(name, heads=0):
            raw, qtype = written[f"blk.{i}.{name}.weight"]  # noqa: B023 (called within its own iteration)
            values = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())
            return gguf_import.unpermute(values, heads) if heads else values

        qkv = torch.cat([gguf_rows("attn_q", 4), gguf_rows("attn_k", 2), gguf_rows("attn_v")])
        layer = loaded.layers[i].mixer.qkv_proj
        assert isinstance(layer, quantized.Int4Linear)
        assert torch.equal(layer.dequantize(torch.float32), qkv)  # bit for bit: the GGUF's own blocks
        gate_up = torch.cat([gguf_rows("ffn_gate"), gguf_rows("ffn_up")])
        assert torch.equal(loaded.layers[i].mlp.gate_up_proj.dequantize(torch.float32), gate_up)
        assert torch.equal(loaded.layers[i].mlp.down_proj.dequantize(torch.float32), gguf_rows("ffn_down"))
    # the same model from float tensors: auto keeps full precision
    write_gguf(tmp_path / "f.gguf", model, tokenizer, "gpt2", {})
    convert.convert(str(tmp_path / "f.gguf"), str(tmp_path / "float"))
    assert load.auto_mode(convert.read_checkpoint(str(tmp_path / "float")))[0] is None
    assert not (tmp_path / "float" / "model.int4.safetensors").exists()
    assert type(load.from_pretrained(str(tmp_path / "float"), quant="auto").layers[0].mixer.qkv_proj) \
        is not quantized.Int4Linear
    assert load.auto_mode(convert.read_checkpoint(fixture_dir("llama")))[0] is None  # not from a GGUF at all


def fixture_dir(name: str) -> str:
    from conftest import FIXTURES

    return os.path.join(FIXTURES, name)


# ----------------------------------------------------------------------------------------------------------------
# Every architecture against llama.cpp (references made once by tests/gguf_reference.py)

REFERENCE = os.path.join(os.path.dirname(__file__), "fixtures", "gguf")


@pytest.fixture(scope="module")
def reference():
    return read_reference("reference")


def read_reference(stem: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    with open(os.path.join(REFERENCE, f"{stem}.json")) as f:
        record = json.load(f)
    return record, load_file(os.path.join(REFERENCE, f"{stem}.safetensors"))


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """{name: (path, digest)} of every reference file, written again here (the test checks each is the same file)."""
    return write_files(tmp_path_factory.mktemp("gguf"), {c: (c, None) for c in gguf_cases.CASES} | gguf_cases.QUANTIZED)


def write_files(root, files: dict) -> dict:
    return {name: (str(root / f"{name}.gguf"), gguf_cases.write(case, str(root / f"{name}.gguf"), qtype))
            for name, (case, qtype) in files.items()}


def compare(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(largest difference relative to the largest reference logit, share of positions with the same argmax)"""
    return float((got - want).abs().max() / want.abs().max()), float((got.argmax(-1) == want.argmax(-1)).float().mean())


@pytest.mark.parametrize("name", ["llama3", "llama-spm", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3",
                                  "smollm3", "granite", "olmo2", "olmo3", "exaone4", "seed_oss",
                                  "glm4", "cohere2", "apertus", "hunyuan", "stablelm", "gptneox"])
def test_every_architecture_gives_llama_cpps_logits(reference, gguf_files, name):
    assert_llama_cpps_logits(reference, gguf_files, name)


def assert_llama_cpps_logits(reference, files, name: str) -> None:
    """The file's logits, a plain pass and a prefill of 24 tokens then decode steps through the cache, within 2e-3 of
    llama.cpp's (relative to its largest), the argmax the same at 95% of the positions."""
    record, logits = reference
    path, digest = files[name]
    assert digest == record["cases"][name]["digest"]  # the very file the reference was made from
    ids = torch.tensor([record["cases"][name]["ids"]])
    model = load.from_pretrained(path)
    err, same = compare(model(ids)[0], logits[name])
    assert err <= 2e-3 and same >= 0.95, (err, same)
    caches.setup_cache(model, 1, 128)  # llama.cpp's context: 128 (Phi-3: past the original 16, the long factors)
    steps = [model(ids[:, :24], input_pos=torch.arange(24))]
    steps += [model(ids[:, t:t + 1], input_pos=torch.tensor([t])) for t in range(24, ids.shape[1])]
    err, same = compare(torch.cat(steps, dim=1)[0], logits[name])
    assert err <= 2e-3 and same >= 0.95, (err, same)


@pytest.mark.parametrize("name", ["llama3", "llama-spm", "qwen2", "gemma", "granite", "exaone4"])
def test_tokenizers_give_llama_cpps_ids(reference, gguf_files, name):
    """Byte-level BPE with Llama 3's and Qwen2's pre-tokenizers, SentencePiece with and without the space prefix:
    the ids of llama.cpp's tokenize for ordinary text, whitespace runs, digits, emoji and text around special
    tokens, without and with BOS."""
    assert_llama_cpps_ids(reference, gguf_files[name][0], name)


def assert_llama_cpps_ids(reference, path: str, name: str) -> None:
    record, _ = reference
    tokenizer = vocab.gguf_tokenizer(gguf_import.open_gguf(path), path)
    for text, (plain, with_bos) in record["cases"][name]["tokens"].items():
        assert tokenizer.encode(text, add_special_tokens=False).ids == plain, text
        assert tokenizer.encode(text, add_special_tokens=True).ids == with_bos, text
        if "<" not in text:  # (special tokens are dropped when decoding)
            assert tokenizer.decode(plain, skip_special_tokens=True) == text, text


@pytest.mark.parametrize("name", ["qwen2-q8_0", "gemma2-q4_1"])
def test_quantized_files_of_other_architectures(reference, gguf_files, name):
    """Q8_0 and Q4_1 block linears of non-llama files read as gguf dequantizes them (Q4_1: --quant auto keeps the
    blocks exactly as int4-g32). The logits stay near llama.cpp's, not within 2e-3: llama.cpp also rounds each
    activation to 8 bits before a quantized matmul, which this engine does not."""

    record, logits = reference
    path, _ = gguf_files[name]
    _, qtype = gguf_cases.QUANTIZED[name]
    model = load.from_pretrained(path, quant="auto")
    reader = gguf_import.open_gguf(path)
    raw = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(
        gguf_import.shape_of(t)) for t in reader.tensors}
    qkv = torch.cat([raw[f"blk.1.attn_{p}.weight"] for p in "qkv"])
    layer = model.layers[1].mixer.qkv_proj
    got = layer.dequantize(torch.float32) if isinstance(layer, quantized.QuantLinear) else layer.weight
    assert torch.equal(got, qkv)
    assert isinstance(layer, quantized.Int4Linear) == (qtype == Q.Q4_1)
    err, same = compare(model(torch.tensor([record["cases"][name]["ids"]]))[0], logits[name])
    assert err <= 0.1 and same >= 0.85, (err, same)


def test_a_file_read_while_torch_is_imported_is_the_model_read_after(gguf_files, monkeypatch):
    """chat.py starts reading a quantized GGUF into huge pages on a thread before `import torch` (preread), for a run
    that decodes long: the blocks load takes from that read are the file's bytes where they lie in it, the logits
    equal a load whose blocks are views of the file's own pages (a one-shot's), and the share of bytes it reads early
    is the tensor table's. A float file, and one whose layers are Q4_0/Q4_1 blocks (loaded as int4), are not read
    early; neither is a one-shot (--prompt), a run on another device or quantization, nor --bench (its load reads
    it: start_for); a read nobody took is stopped and dropped."""
    if not sys.platform.startswith("linux"):
        pytest.skip("early reads are Linux's (anonymous huge-page mappings)")
    path, _ = gguf_files["qwen2-q8_0"]
    reader = gguf_import.open_gguf(path)
    sizes = {t.tensor_type.name: 0 for t in reader.tensors}
    for t in reader.tensors:
        sizes[t.tensor_type.name] += t.n_bytes
    assert preread.kernel_share(path) == pytest.approx(sizes["Q8_0"] / sum(sizes.values()), abs=0.01)
    assert preread.kernel_share(gguf_files["qwen2"][0]) == 0 == preread.kernel_share(gguf_files["gemma2-q4_1"][0])
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    plain = load.from_pretrained(path, quant="auto")
    mapped = next(t for t in plain.layers[0].mixer.qkv_proj.buffers() if t.dtype == torch.uint8 and t.numel() > 1000)
    assert mapped.untyped_storage().nbytes() == os.path.getsize(path)  # (no early read: a view of the file's pages)
    monkeypatch.setattr(preread, "kernel_share", lambda path: 1.0)  # (this small file is a tenth norms)
    preread.start(path)
    early = preread._reads[os.path.realpath(path)]
    assert preread.held(path) == os.path.getsize(path)  # (memory the weights take, not memory to find: check_fits)
    model = load.from_pretrained(path, quant="auto")
    assert not preread._reads
    if not early.complete:
        pytest.skip("no transparent huge pages here (madvise refused): the load read the file itself")
    buffer = next(t for t in model.layers[0].mixer.qkv_proj.buffers() if t.dtype == torch.uint8 and t.numel() > 1000)
    offset = buffer.data_ptr() - (preread._address(early.mapping) + early.start)
    assert 0 < offset < early.size
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read(buffer.numel()) == buffer.numpy().tobytes()
    assert torch.equal(model(ids), plain(ids))
    for argv in (["--ckpt", path, "--device", "cuda"], ["--ckpt", path, "--quant", "int4"], ["--bench", "--ckpt", path],
                 ["--ckpt", path, "--qu", "int8", "--dev", "cpu"], ["--ckpt", path, "--device", "cpu", "--device=cuda"],
                 ["--prompt", "hi", f"--ckpt={path}"], [f"--ckpt={path}", "--prompt=hi"]):
        preread.start_from_argv(argv)
        assert not preread._reads, argv
    preread.start_from_argv(["--max-new-tokens", "9", f"--ckpt={path}", "--device", "cpu"])
    assert preread.taken(path) is not None
    record, _ = load.plan(path, device="cpu")  # --bench and dense_engine.load: read when the load is planned
    preread.start_for(record)
    assert preread.taken(path) is not None
    preread.start_from_argv(["--ckpt", path, "--dev", "cpu"])
    dropped = preread._reads[os.path.realpath(path)]
    preread.discard()
    dropped.thread.join()
    assert not preread._reads and dropped.stopped


def test_chat_and_convert_take_a_gguf_of_another_architecture(gguf_files, tmp_path):
    """chat.py --ckpt FILE.gguf (a SentencePiece Phi-3 with a chat template) prints what generate gives for the
    rendered prompt; convert.py FILE.gguf DIR writes a folder that loads to the same model."""
    from jinja2 import Template


    path, _ = gguf_files["phi3"]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", path, "--prompt", "hello",
                             "--temperature", "0", "--max-new-tokens", "10", "--no-compile"], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stderr
    tokenizer = vocab.gguf_tokenizer(gguf_import.open_gguf(path), path)
    text = Template(gguf_cases.TEMPLATE).render(messages=[{"role": "user", "content": "hello"}],
                                                add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    model = load.from_pretrained(path)
    out = generate.generate(model, torch.tensor([ids]), 10)[0, len(ids):].tolist()
    stops = {2, tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<end_of_turn>")}  # eos, ends of turn
    out = out[:next((i for i, t in enumerate(out) if t in stops), len(out))]
    assert result.stdout == answer(tokenizer.decode(out, skip_special_tokens=True))
    dst = tmp_path / "native"
    assert subprocess.run([sys.executable, "-m", "dense_engine.formats.convert", gguf_files["gemma3"][0], str(dst)],
                          capture_output=True, check=False).returncode == 0
    ids = torch.tensor([ids])
    assert torch.equal(load.from_pretrained(str(dst))(ids), load.from_pretrained(gguf_files["gemma3"][0])(ids))


def rewrite(source: str, target: str, drop=(), add=None, tensors=None, replace=None, alignment=None) -> str:
    """A copy of a float32 GGUF file with metadata keys dropped or added (and extra tensors, or tensors replaced: an
    array, or (raw bytes, shape, type)), its data aligned to `alignment` (general.alignment) if given."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, arch)
    if alignment:
        writer.add_custom_alignment(alignment)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop:
            continue
        value = f.contents()
        kind = f.types[0]
        sub = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)
    for key, (value, kind) in (add or {}).items():
        writer.add_key_value(key, value, kind)
    for t in reader.tensors:  # (float32 sources: their data are the tensors as they are)
        value = (replace or {}).get(t.name, np.asarray(t.data))
        if isinstance(value, tuple):
            writer.add_tensor(t.name, value[0], raw_shape=value[1], raw_dtype=value[2])
        else:
            writer.add_tensor(t.name, value)
    for name, value in (tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


S = gguf.GGUFValueType.STRING
U32 = gguf.GGUFValueType.UINT32


@pytest.mark.parametrize("value, kind", [(0, U32), (3, U32), ("64", S), (64, gguf.GGUFValueType.UINT64)])
def test_an_alignment_llama_cpp_refuses_is_one_line(tmp_path, tokenizer, value, kind):
    """llama.cpp reads general.alignment only as a power of two stored as u32 (with 3 this engine read the weights
    from the wrong offsets and answered nothing)."""
    source = str(tmp_path / "m.gguf")
    write_gguf(source, small_llama(tied=True), tokenizer, "gpt2", {})
    path = rewrite(source, str(tmp_path / "x.gguf"), add={"general.alignment": (value, kind)})
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"x\.gguf: .*general\.alignment is .*; expected a power of two stored as u32"):
        load.from_pretrained(path)
    aligned = rewrite(source, str(tmp_path / "a64.gguf"), alignment=64)  # a valid alignment other than 32 reads right
    ids = torch.arange(3, 30).reshape(1, -1)
    with torch.no_grad():
        assert torch.equal(load.from_pretrained(aligned)(ids), load.from_pretrained(source)(ids))


def test_a_block_tensor_whose_rows_are_not_whole_blocks_is_one_line(tmp_path, tokenizer):
    source = str(tmp_path / "m.gguf")
    write_gguf(source, small_llama(tied=True), tokenizer, "gpt2", {})
    raw = gguf.quants.quantize(np.zeros((96, 64), dtype=np.float32), Q.Q4_1)
    path = rewrite(source, str(tmp_path / "x.gguf"), replace={"blk.0.ffn_up.weight": (raw, None, Q.Q4_1)})
    data = bytearray(Path(path).read_bytes())  # its dims [64, 96] -> [48, 128]: as many values, 192 whole blocks
    name = b"blk.0.ffn_up.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name) + 4  # (after the name and n_dims)
    data[at:at + 16] = (48).to_bytes(8, "little") + (128).to_bytes(8, "little")
    Path(path).write_bytes(data)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"x\.gguf: .*tensor 'blk\.0\.ffn_up\.weight': its rows of 48 values are not whole "
                             r"Q4_1 blocks of 32"):
        load.from_pretrained(path)


@pytest.mark.parametrize("source, change, message", [
    ("qwen2", {"add": {"qwen2.rope.scaling.type": ("yarn", S), "qwen2.rope.scaling.factor": (
        4.0, gguf.GGUFValueType.FLOAT32), "qwen2.rope.scaling.yarn_ext_factor": (0.5, gguf.GGUFValueType.FLOAT32)}},
     "qwen2.rope.scaling.yarn_ext_factor 0.5: only 1 (yarn's whole ramp) is supported"),
    ("qwen2", {"add": {"qwen2.expert_count": (8, gguf.GGUFValueType.UINT32)}}, "qwen2.expert_count"),
    ("qwen2", {"drop": ("tokenizer.ggml.pre",), "add": {"tokenizer.ggml.pre": ("chatglm-bpe", S)}},
     "tokenizer.ggml.pre 'chatglm-bpe' is not supported"),
    ("gemma", {"drop": ("tokenizer.ggml.model",), "add": {"tokenizer.ggml.model": ("rwkv", S)}},
     "tokenizer.ggml.model 'rwkv' is not supported"),
    ("qwen2", {"tensors": {"blk.0.attn_output.bias": np.zeros(64, dtype=np.float32)}},
     "unexpected tensor 'blk.0.attn_output.bias' for architecture 'qwen2'"),
])
@pytest.mark.slow
def test_what_llama_cpp_would_not_read_is_one_line(gguf_files, tmp_path, source, change, message):
    path = rewrite(gguf_files[source][0], str(tmp_path / "x.gguf"), **change)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", path, "--prompt", "hi"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and "x.gguf" in result.stderr


# ----------------------------------------------------------------------------------------------------------------
# The hybrids whose other layers keep a state, qwen35 (Gated DeltaNet) and lfm2 (short convs), against llama.cpp
# (references made once by tests/gguf_reference.py --state) and against their Hugging Face folders


@pytest.fixture(scope="module")
def state_reference():
    return read_reference("state_reference")


@pytest.fixture(scope="module")
def state_files(tmp_path_factory):
    return write_files(tmp_path_factory.mktemp("state"), gguf_cases.STATE_FILES)


@pytest.mark.parametrize("name", ["qwen35", "lfm2"])
def test_hybrids_give_llama_cpps_logits_and_ids(state_reference, state_files, name):
    """qwen35: three Gated DeltaNet layers (2 key heads, 4 value heads in the converter's tiled order) and a
    full-attention layer (output gate, 8 of 32 channels rotated), norms with 1 + w baked in, an MTP layer; lfm2: short
    convs between two attention layers, a tied head. A prompt (the chunked rule), then decode steps (the recurrent
    one), and the tokenizers (qwen35's split keeps combining marks in words)."""
    assert_llama_cpps_logits(state_reference, state_files, name)
    assert_llama_cpps_ids(state_reference, state_files[name][0], name)


def test_a_hybrid_gguf_is_the_model_its_hugging_face_folder_is(state_files, tmp_path):
    """The same weights as a Hugging Face folder (what the converter read) and as the GGUF file: the same logits, in
    float32 (the file's layout undone: A_log from -exp(A_log), norms' 1 + w, value heads tiled, q|gate split)."""
    from safetensors.numpy import save_file

    for case in ("qwen35", "lfm2"):
        folder = tmp_path / case
        gguf_cases.state_hf_config(case).save_pretrained(folder)
        save_file(gguf_cases.hf_weights(case), str(folder / "model.safetensors"))
        ids = torch.tensor([gguf_cases.input_ids(case)])
        with torch.no_grad():
            want = load.from_pretrained(str(folder), dtype=torch.float32)(ids)
            got = load.from_pretrained(state_files[case][0])(ids)
        assert (got - want).abs().max() <= 1e-4, case


def test_the_mtp_layer_is_the_draft_its_hugging_face_folder_holds(state_files, tmp_path):
    """blk.4 (nextn.* and a full-attention layer after the model's 4) is the folder's mtp.*: the same draft
    (--draft mtp), its norms' 1 + w baked in the file and added by the folder's model."""
    from safetensors.numpy import save_file

    from dense_engine.formats import convert
    from dense_engine.runtime import generate, speculative

    checkpoint = convert.read_checkpoint(state_files["qwen35"][0])
    assert checkpoint.config.num_hidden_layers == 4 and not any(n.startswith("layers.4.") for n in checkpoint.tensors)
    assert "fc.weight" in checkpoint.mtp and "layers.0.mixer.gate_proj.weight" in checkpoint.mtp
    folder = tmp_path / "qwen35"
    gguf_cases.state_hf_config("qwen35").save_pretrained(folder)
    save_file(gguf_cases.hf_weights("qwen35"), str(folder / "model.safetensors"))
    ids = gguf_cases.input_ids("qwen35")
    drafts = []
    for source in (str(folder), state_files["qwen35"][0]):
        model = load.from_pretrained(source, dtype=torch.float32)
        draft = speculative.mtp_draft(model, convert.read_checkpoint(source), None)
        model.setup_cache(1, 64)
        draft.attach(generate.Runner(model, None))
        with torch.no_grad():
            hidden = generate.Runner(model, None).prefill_hidden(torch.tensor([ids]), 0)[0]
            drafts.append(model.logits(draft.run(ids[1:], hidden[:-1], 0)))
    assert (drafts[0] - drafts[1]).abs().max() <= 1e-4
    assert checkpoint.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert checkpoint.config.extras["gated_deltanet"].tiled_values and checkpoint.config.rotary_dim == 8


@pytest.mark.parametrize("name", ["qwen35-q8_0", "qwen35-q4_k"])
def test_quantized_hybrids_keep_their_blocks_in_the_models_order(state_reference, state_files, name):
    """Q8_0 (every 2-D weight but the convs, as the converter's --outtype q8_0) and K-quants (Q4_K and Q6_K as
    llama.cpp's Q4_K_M mixes them): --quant auto keeps each linear in the file's blocks, the Gated DeltaNet's
    projection from four tensors, the attention's from q|gate rows alternating per head: each the file's own values
    in the model's order. Its kernels round x to bytes: the logits are as near the float path (the same values,
    float64 products) as llama.cpp's, and with K-quants, whose rounding is llama.cpp's, nearer llama.cpp's than
    either is to it. (Not within 2e-3: where rounding x to bytes meets a float difference of 1e-7 at a half-step,
    the two round apart, a step of 1/127 that the layers after it carry on.)"""
    record, logits = state_reference
    path, digest = state_files[name]
    assert digest == record["cases"][name]["digest"]
    model = load.from_pretrained(path, quant="auto")
    raw = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(
        gguf_import.shape_of(t)) for t in gguf_import.open_gguf(path).tensors}
    delta, attention = model.layers[0].mixer, model.layers[3].mixer
    assert isinstance(delta.in_proj, quantized.GGUFLinear) and isinstance(attention.qkv_proj, quantized.GGUFLinear)
    parts = [raw[f"blk.0.{p}.weight"] for p in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")]
    assert torch.equal(delta.in_proj.dequantize(torch.float32), torch.cat(parts))
    H, D = model.config.num_attention_heads, model.config.head_dim
    q, gate = raw["blk.3.attn_q.weight"].view(H, 2, D, -1).unbind(1)  # [heads, D, C] each
    parts = [q.flatten(0, 1), raw["blk.3.attn_k.weight"], raw["blk.3.attn_v.weight"], gate.flatten(0, 1)]
    assert torch.equal(attention.qkv_proj.dequantize(torch.float32), torch.cat(parts))
    assert torch.equal(delta.out_proj.dequantize(torch.float32), raw["blk.0.ssm_out.weight"])
    ids = torch.tensor([record["cases"][name]["ids"]])
    with torch.no_grad():
        want = load.from_pretrained(path, quant="none").double()(ids)[0].float()
        got = model(ids)[0]
    theirs = logits[name]

    def rms(a, b):  # the typical difference, relative to b's logits
        return float((a - b).square().mean().sqrt() / b.square().mean().sqrt())

    if not kernels.available():  # PyTorch's products of the dequantized weights: the float path
        assert rms(got, want) <= 1e-2 * rms(theirs, want)
        return
    assert rms(got, want) <= 1.1 * rms(theirs, want) and compare(got, want)[0] <= 1.5 * compare(theirs, want)[0]
    if name == "qwen35-q4_k":
        assert rms(got, theirs) <= 0.25 * rms(theirs, want), (rms(got, theirs), rms(theirs, want))


@pytest.mark.parametrize("source, change, message", [
    ("qwen35", {"replace": {"blk.1.ssm_a": np.ones(4, dtype=np.float32)}}, "tensor 'blk.1.ssm_a' holds values >= 0"),
    ("qwen35", {"drop": ("qwen35.ssm.inner_size",)}, "missing GGUF metadata 'qwen35.ssm.inner_size'"),
    ("qwen35", {"drop": ("qwen35.ssm.inner_size",), "add": {"qwen35.ssm.inner_size": (66, gguf.GGUFValueType.UINT32)}},
     "qwen35.ssm.inner_size 66 is not a whole number of qwen35.ssm.time_step_rank 4 value heads"),
    ("lfm2", {"add": {"lfm2.attention.sliding_window": (8, gguf.GGUFValueType.UINT32)}},
     "lfm2.attention.sliding_window: sliding-window attention is not supported for lfm2"),
    ("lfm2", {"tensors": {"blk.0.ssm_a": -np.ones(4, dtype=np.float32)}},
     "unexpected tensor 'blk.0.ssm_a' for architecture 'lfm2'"),
])
def test_what_a_hybrid_gguf_cannot_be_is_one_line(state_files, tmp_path, source, change, message):
    path = rewrite(state_files[source][0], str(tmp_path / "x.gguf"), **change)
    with pytest.raises(checkpoint.CheckpointError) as error:
        load.from_pretrained(path)
    assert message in str(error.value) and "x.gguf" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("arch, context, scaling, layout, within", [
    ("mistral3", 64, "yarn", "half", 1e-3),
    # (llama.cpp's f16 matmuls round their inputs to f16: 1.6e-3 here from transformers' logits on the same weights,
    # which this engine's are within 1e-6 of)
    ("command-r", 256, None, "interleaved", 2e-3),
    # (llama.cpp's f16 rounding again: 1.8e-3 from transformers' logits on the same weights)
    ("granite_swa", 256, None, "half", 2e-3)])
def test_a_converted_gguf_gives_llama_cpps_logits_and_ids(arch, context, scaling, layout, within):
    """Files as llama.cpp's converter writes them (tests/fixtures/converted_gguf, made by
    tests/converted_gguf_reference.py). mistral3 (Ministral 3): llama's turned q/k rows, yarn from the file's keys
    (factor 16 over 64 tokens, cos and sin scaled by mscale over mscale_all_dim), the context cut at the original 64
    where llama.cpp starts scaling the queries. command-r (Command R v1): layer norms without bias before the parallel
    branches, interleaved rope, the logit scale, the head read from the embedding. granite_swa (Granite SWA): its
    sliding layers as the file's pattern says (a window of 8 in 20 tokens), a layer without rope (rope_pattern),
    learned sinks, Granite's four scales. llama.cpp's logits (a float32 cache) within `within` of their largest, the
    same argmax, its token ids."""
    from conftest import FIXTURES

    from dense_engine.formats.vocab import load_vocabulary

    path = os.path.join(FIXTURES, "converted_gguf", f"{arch}.gguf")
    with open(os.path.join(FIXTURES, "converted_gguf", f"{arch}.json")) as f:
        reference = json.load(f)
    model = load.from_pretrained(path, dtype=torch.float32)
    assert model.config.max_position_embeddings == context and model.config.rope_layout == layout
    assert (model.config.rope_scaling or {}).get("rope_type") == scaling
    if arch == "granite_swa":
        extras = model.config.extras
        assert extras["rotary"].nope_layers == [1] and extras["attention"].sinks and model.config.layer_types == [
            "full_attention"] + ["sliding_attention"] * 3
    with torch.no_grad():
        got = model(torch.tensor([reference["ids"]]))[0]
    want = torch.tensor(reference["logits"])
    assert (got - want).abs().max() < within * want.abs().max(), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    vocab = load_vocabulary(path, None)
    assert [vocab.encode(t, special=False) for t in reference["texts"]] == reference["tokens"]
