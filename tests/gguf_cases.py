"""Tiny random GGUF files of every architecture gguf_import reads, laid out as llama.cpp's own converter
(convert_hf_to_gguf.py) writes them, with byte-level BPE and SentencePiece vocabularies. Shared by tests/test_gguf.py,
which compares this engine with the checked-in llama.cpp references, and tests/gguf_reference.py, which made those
references once with llama.cpp (and checked each file against transformers' forward of the same weights).

Everything here is deterministic (numpy's seeded RandomState, fixed corpora), so a test writes the very file the
reference was made from; the references record each file's weights' digest to prove it.
"""

from __future__ import annotations

import hashlib
import math

import gguf
import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

Q = gguf.GGMLQuantizationType
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(12, 345))\n",
    "Crème brûlée and naïve café; déjà vu in Zürich. 日本語のテキスト。 🙂🚀",
    "Numbers: 2024, 3.14159, 1000000 and 42.   Spaces   and\n\n\nnewlines\t\ttabs. I'm sure they'll say it's DONE.",
]
TEXTS = CORPUS + ["unseen words: zygomorphic quokka 9876", "   leading spaces", "emoji 👩‍💻 🇫🇷 ∑∫", "",
                  "WE'LL see THEY'RE 12345678", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
                  "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "trailing space ", " x  y   z"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")

BASE = dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, ffn=128, context=128, eps=1e-5, theta=10000.0)
# case -> architecture, shape changes, tokenizer ("bpe", pre) or ("spm", add_space_prefix), other switches
CASES = {
    "llama3": dict(arch="llama", tokenizer=("bpe", "llama-bpe"), llama3=True, theta=500000.0),
    "llama-spm": dict(arch="llama", tokenizer=("spm", True)),
    "qwen2": dict(arch="qwen2", tokenizer=("bpe", "qwen2"), theta=1e6, eps=1e-6),
    "qwen3": dict(arch="qwen3", tokenizer=("bpe", "qwen2"), head_dim=32, eps=1e-6),
    "gemma": dict(arch="gemma", tokenizer=("spm", False), eps=1e-6),
    "gemma2": dict(arch="gemma2", tokenizer=("spm", False), eps=1e-6, window=8, attn_softcap=5.0,
                   final_softcap=3.0),
    "gemma3": dict(arch="gemma3", tokenizer=("spm", False), layers=6, eps=1e-6, window=8, theta=1e6,
                   linear_factor=8.0),
    "phi3": dict(arch="phi3", tokenizer=("spm", True), rotary=12, longrope=True, original_context=16),
}
QUANTIZED = {"qwen2-q8_0": ("qwen2", Q.Q8_0), "gemma2-q4_1": ("gemma2", Q.Q4_1)}  # the block linears in these types
IDS_LENGTH = 40
VOCAB = 512  # what the BPE trainer is asked for (it stops short on this corpus)
SPM_PIECES = 400


def spec(case: str) -> dict:
    return {**BASE, **CASES[case]}


# ----------------------------------------------------------------------------------------------------------------
# Vocabularies


def bpe_tokenizer(pre: str) -> Tokenizer:
    """A byte-level BPE trained here on CORPUS, split as llama.cpp splits for `pre` (Llama 3's or Qwen2's regex)."""
    tok = Tokenizer(models.BPE())
    split = QWEN2_SPLIT if pre == "qwen2" else (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| "
                                                r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(SPECIALS), special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 5, trainer)
    return tok


def spm_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary: <unk>, <s>, </s>, the chat specials, the 256 byte tokens, then pieces (with "▁"
    for spaces) whose score is minus their merge order, as SentencePiece's BPE writes them."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(vocab_size=2000, show_progress=False)
    tok.train_from_iterator(CORPUS * 5, trainer)
    heads = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>"]
    head_types = [2, 3, 3, 3, 3, 3, 3]
    tokens = heads + [f"<0x{b:02X}>" for b in range(256)]
    types = head_types + [6] * 256
    vocab = tok.get_vocab()
    merged = [a + b for a, b in (m.split(" ", 1) if isinstance(m, str) else m for m in
                                 __import__("json").loads(tok.to_str())["model"]["merges"])]
    chars = sorted(p for p in vocab if len(p) == 1)
    pieces = chars + [p for p in merged if p not in chars]
    pieces = [p for i, p in enumerate(pieces) if p not in pieces[:i]][:SPM_PIECES]
    scores = [0.0] * len(tokens) + [-1000.0 if len(p) == 1 else -float(i) for i, p in enumerate(pieces)]
    return tokens + pieces, scores, types + [1] * len(pieces)


# ----------------------------------------------------------------------------------------------------------------
# Weights, in Hugging Face's names (what convert_hf_to_gguf.py reads)


def vocab_size(case: str) -> int:
    kind, option = spec(case)["tokenizer"]
    return len(bpe_tokenizer(option).get_vocab()) if kind == "bpe" else len(spm_vocabulary()[0])


def hf_weights(case: str, seed: int = 0) -> dict[str, np.ndarray]:
    s = spec(case)
    V = vocab_size(case)
    rng = np.random.RandomState(seed + sum(map(ord, case)))
    C, H, K, D, F, L = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], s["ffn"], s["layers"]
    gemma = s["arch"].startswith("gemma")

    def mat(rows, cols, std=0.15):
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def gain(n):  # Gemma stores offsets from 1
        return (rng.uniform(-0.5, 0.5, n) if gemma else rng.uniform(0.5, 1.5, n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(V, C, 0.5), "model.norm.weight": gain(C)}
    if s["arch"] in ("llama", "qwen2", "qwen3", "phi3"):
        w["lm_head.weight"] = mat(V, C)
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = gain(C)
        w[p + "post_attention_layernorm.weight"] = gain(C)
        if s["arch"] in ("gemma2", "gemma3"):
            w[p + "pre_feedforward_layernorm.weight"] = gain(C)
            w[p + "post_feedforward_layernorm.weight"] = gain(C)
        q, k, v = mat(H * D, C), mat(K * D, C), mat(K * D, C)
        if s["arch"] == "phi3":
            w[p + "self_attn.qkv_proj.weight"] = np.concatenate([q, k, v])
            w[p + "mlp.gate_up_proj.weight"] = np.concatenate([mat(F, C), mat(F, C)])
        else:
            w.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v, p + "mlp.gate_proj.weight": mat(F, C),
                      p + "mlp.up_proj.weight": mat(F, C)})
        w[p + "self_attn.o_proj.weight"] = mat(C, H * D)
        w[p + "mlp.down_proj.weight"] = mat(C, F)
        if s["arch"] == "qwen2":
            for part, n in (("q", H), ("k", K), ("v", K)):
                w[p + f"self_attn.{part}_proj.bias"] = (rng.standard_normal(n * D) * 0.1).astype(np.float32)
        if s["arch"] in ("qwen3", "gemma3"):
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = gain(D), gain(D)
    return w


def llama3_factors(s: dict) -> np.ndarray:
    """rope_freqs: the divisor of each frequency Llama 3.1's scaling applies (factor 8, original context 32)."""
    dim = s["head_dim"]
    inv = 1.0 / (s["theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high, old = 8.0, 1.0, 4.0, 32
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def longrope_factors(s: dict) -> tuple[np.ndarray, np.ndarray]:
    n = s["rotary"] // 2
    return (np.array([1.0 + 0.1 * i for i in range(n)], dtype=np.float32),
            np.array([2.0 + 0.5 * i for i in range(n)], dtype=np.float32))


# ----------------------------------------------------------------------------------------------------------------
# Writing the GGUF file


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The q/k row order llama.cpp's converter gives the llama architecture (its rotary turns adjacent pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(case: str) -> dict[str, np.ndarray]:
    """The file's tensors, named and changed as convert_hf_to_gguf.py does for the case's architecture."""
    s, w = spec(case), hf_weights(case)
    arch = s["arch"]
    gemma = arch.startswith("gemma")
    out = {}
    for name, t in w.items():
        if gemma and name.endswith("norm.weight"):
            t = t + 1  # Gemma's (1 + w), baked in
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = t
        elif name == "model.norm.weight":
            out["output_norm.weight"] = t
        elif name == "lm_head.weight":
            out["output.weight"] = t
        else:
            i, rest = name.split(".", 3)[2], name.split(".", 3)[3]
            post = "post_attention_norm" if arch in ("gemma2", "gemma3") else "ffn_norm"
            theirs = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": f"{post}.weight",
                      "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                      "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
                      "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                      "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
                      "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
                      "self_attn.o_proj.weight": "attn_output.weight", "self_attn.qkv_proj.weight": "attn_qkv.weight",
                      "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
                      "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                      "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}[rest]
            if arch == "llama" and theirs in ("attn_q.weight", "attn_k.weight"):
                t = llama_cpp_permute(t, s["heads"] if theirs == "attn_q.weight" else s["kv_heads"])
            out[f"blk.{i}.{theirs}"] = t
    if s.get("llama3"):
        out["rope_freqs.weight"] = llama3_factors(s)
    if s.get("longrope"):
        short, long = longrope_factors(s)
        out["rope_factors_long.weight"], out["rope_factors_short.weight"] = long, short
    return out


def write(case: str, path: str, qtype=None) -> str:
    """Write the case's GGUF file (F32; with qtype, its block linears in that type). Returns the weights' digest."""
    s = spec(case)
    arch = s["arch"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_layer_norm_rms_eps(s["eps"])
    writer.add_rope_freq_base(s["theta"])
    if s["head_dim"] != s["hidden"] // s["heads"]:
        writer.add_key_length(s["head_dim"])
        writer.add_value_length(s["head_dim"])
    writer.add_rope_dimension_count(s.get("rotary", s["head_dim"]))
    if s.get("window"):
        writer.add_sliding_window(s["window"])
    if s.get("attn_softcap"):
        writer.add_attn_logit_softcapping(s["attn_softcap"])
        writer.add_final_logit_softcapping(s["final_softcap"])
    if s.get("linear_factor"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(s["linear_factor"])
    if s.get("longrope"):  # Phi-3-mini-128k style: the context 8x the original, attention factor as the converter
        writer.add_rope_scaling_orig_ctx_len(s["original_context"])
        scale = s["context"] / s["original_context"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(s["original_context"])))
    write_vocabulary(writer, s["tokenizer"])
    digest = hashlib.sha256()
    for name, t in gguf_tensors(case).items():
        kind = name.split(".")[-2]
        block = qtype is not None and t.ndim == 2 and kind.startswith(("attn_", "ffn_")) and "norm" not in kind
        raw = gguf.quants.quantize(t, qtype) if block else t
        writer.add_tensor(name, raw, raw_dtype=qtype if block else None)
        digest.update(name.encode() + np.ascontiguousarray(raw).tobytes())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return digest.hexdigest()[:16]


def write_bpe_vocabulary(writer, tok, pre: str, specials: list[str]) -> None:
    """A byte-level BPE tokenizer (tokenizers' Tokenizer) as llama.cpp's "gpt2" vocabulary: tokens in id order, the
    special ones typed 3 (control), merges, <|im_start|> as BOS and <|endoftext|> as EOS."""
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    merges = __import__("json").loads(tok.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|endoftext|>"])


def write_vocabulary(writer, tokenizer: tuple) -> None:
    kind, option = tokenizer
    if kind == "bpe":
        write_bpe_vocabulary(writer, bpe_tokenizer(option), option, SPECIALS)
        writer.add_add_bos_token(False)
    else:
        tokens, scores, types = spm_vocabulary()
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(option)
    writer.add_chat_template(TEMPLATE)


def input_ids(case: str) -> list[int]:
    rng = np.random.RandomState(7)
    return rng.randint(3, vocab_size(case), IDS_LENGTH).tolist()
