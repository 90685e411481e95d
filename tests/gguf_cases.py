"""Tiny random GGUF files of every architecture gguf_import reads, laid out as llama.cpp's own converter
(convert_hf_to_gguf.py) writes them, with byte-level BPE and SentencePiece vocabularies. Shared by tests/test_gguf.py,
which compares this engine with the checked-in llama.cpp references, and tests/gguf_reference.py, which made those
references once with llama.cpp (and checked each file against transformers' forward of the same weights). The
hybrids whose other layers keep a state (qwen35, lfm2: STATE_CASES, STATE_FILES) have references of their own.

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
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")

BASE = {"hidden": 64, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 128, "context": 128, "eps": 1e-5,
        "theta": 10000.0}
# case -> architecture, shape changes, tokenizer ("bpe", pre) or ("spm", add_space_prefix), other switches
CASES = {
    "llama3": {"arch": "llama", "tokenizer": ("bpe", "llama-bpe"), "llama3": True, "theta": 500000.0},
    "llama-spm": {"arch": "llama", "tokenizer": ("spm", True)},
    "qwen2": {"arch": "qwen2", "tokenizer": ("bpe", "qwen2"), "theta": 1e6, "eps": 1e-6},
    "qwen3": {"arch": "qwen3", "tokenizer": ("bpe", "qwen2"), "head_dim": 32, "eps": 1e-6},
    "gemma": {"arch": "gemma", "tokenizer": ("spm", False), "eps": 1e-6},
    "gemma2": {"arch": "gemma2", "tokenizer": ("spm", False), "eps": 1e-6, "window": 8, "attn_softcap": 5.0,
               "final_softcap": 3.0},
    "gemma3": {"arch": "gemma3", "tokenizer": ("spm", False), "layers": 6, "eps": 1e-6, "window": 8, "theta": 1e6,
               "linear_factor": 8.0},
    "phi3": {"arch": "phi3", "tokenizer": ("spm", True), "rotary": 12, "longrope": True, "original_context": 16},
    "smollm3": {"arch": "smollm3", "tokenizer": ("bpe", "llama-bpe"), "theta": 2e6},  # (every 4th layer without rope)
    "granite": {"arch": "granite", "tokenizer": ("bpe", "refact"),
                "multipliers": {"attention": 0.3, "embedding": 3.0, "residual": 0.5, "logits": 2.0}},
    "olmo2": {"arch": "olmo2", "tokenizer": ("bpe", "gpt-2")},  # norms after the branches, q/k norms over all heads
    "olmo3": {"arch": "olmo2", "tokenizer": ("bpe", "gpt-2"), "layers": 5, "window": 8,
              "theta": 5e5},  # every 4th layer full
    "exaone4": {"arch": "exaone4", "tokenizer": ("bpe", "exaone")},  # norms after, q/k norms; llama.cpp slides only 64
    "seed_oss": {"arch": "seed_oss", "tokenizer": ("bpe", "llama-bpe"), "head_dim": 32},  # q/k/v biases
    "glm4": {"arch": "glm4", "tokenizer": ("bpe", "llama-bpe"),
             "rotary": 8},  # pairs interleaved, half rotated, 4 norms
    "cohere2": {"arch": "cohere2", "tokenizer": ("bpe", "llama-bpe"), "layers": 5, "window": 8, "logit_scale": 0.25},
    "apertus": {"arch": "apertus", "tokenizer": ("bpe", "llama-bpe")},  # xIELU (its parameters in the metadata)
    "hunyuan": {"arch": "hunyuan-dense", "tokenizer": ("bpe", "llama-bpe")},  # q/k norms after the rotary
    "stablelm": {"arch": "stablelm", "tokenizer": ("bpe", "gpt-2"), "rotary": 4},  # layer norms, per-head q/k norms
    "gptneox": {"arch": "gptneox", "tokenizer": ("bpe", "gpt-2"), "kv_heads": 4,
                "rotary": 4},  # Pythia: biases, parallel
}
PERMUTED = ("llama", "smollm3", "granite")  # the converter's LlamaModel turns their q/k rows
QUANTIZED = {"qwen2-q8_0": ("qwen2", Q.Q8_0), "gemma2-q4_1": ("gemma2", Q.Q4_1)}  # the block linears in these types
STATE_ARCHITECTURES = ("qwen35", "lfm2")
# The hybrids: qwen35 (Qwen3.5: Gated DeltaNet layers, linear = (key heads, value heads, head dim), and a
# full-attention layer every 4th, with an MTP layer after them) and lfm2 (short convs of width conv between attention
# layers). qwen35-wide: rows of 256 inputs, for K-quant blocks.
QWEN35 = {"arch": "qwen35", "tokenizer": ("bpe", "qwen35"), "head_dim": 32, "rotary": 8, "eps": 1e-6, "theta": 1e7,
          "linear": (2, 4, 16), "conv": 4, "mtp": 1, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
STATE_CASES = {
    "qwen35": QWEN35,
    "qwen35-wide": {**QWEN35, "hidden": 256, "head_dim": 64, "rotary": 16, "ffn": 256, "linear": (2, 4, 64), "mtp": 0},
    "lfm2": {"arch": "lfm2", "tokenizer": ("bpe", "lfm2"), "layers": 6, "theta": 1e6, "conv": 3,
             "layer_types": ["conv", "conv", "full_attention", "conv", "full_attention", "conv"]},
}
# file -> (case, type of its 2-D weights but the convs: None F32; Q8_0 as the converter's --outtype q8_0 makes it;
# Q4_K: K-quant blocks as llama.cpp's Q4_K_M mixes them, random (gguf cannot make K-quants), Q6_K where it uses Q6_K)
STATE_FILES = {"qwen35": ("qwen35", None), "lfm2": ("lfm2", None), "qwen35-q8_0": ("qwen35", Q.Q8_0),
               "qwen35-q4_k": ("qwen35-wide", Q.Q4_K)}
# Letters with combining marks (\p{M}): Qwen3.5's split keeps them in their word; its vocabulary is trained on them too
MARKS = "combining marks: e\u0301te\u0301 nin\u0303o Mu\u0308ller, cafe\u0301 \u0301\u0301!"
STATE_TEXTS = TEXTS + [MARKS, "ba\u0301ra\u0301 e\u0301"]
IDS_LENGTH = 40
VOCAB = 512  # what the BPE trainer is asked for (it stops short on this corpus)
SPM_PIECES = 400


def spec(case: str) -> dict:
    return {**BASE, **(CASES[case] if case in CASES else STATE_CASES[case])}


# ----------------------------------------------------------------------------------------------------------------
# Vocabularies


def bpe_tokenizer(pre: str) -> Tokenizer:
    """A byte-level BPE trained here on CORPUS (and MARKS for qwen35), split as llama.cpp splits for `pre` (Llama 3's,
    Qwen2's or Qwen3.5's regex)."""
    tok = Tokenizer(models.BPE())
    split = {"qwen2": QWEN2_SPLIT, "qwen35": QWEN35_SPLIT}.get(pre, r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?"
                                                              r"\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                                                              r"\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(SPECIALS), special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((CORPUS + ([MARKS] if pre == "qwen35" else [])) * 5, trainer)
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
    if s["arch"] in STATE_ARCHITECTURES:
        return state_hf_weights(case, seed)
    if s["arch"] == "gptneox":
        return gptneox_hf_weights(case, seed)
    V = vocab_size(case)
    rng = np.random.RandomState(seed + sum(map(ord, case)))
    C, H, K, D, F, L = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], s["ffn"], s["layers"]
    gemma = s["arch"].startswith("gemma")

    def mat(rows, cols, std=0.15):
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def gain(n):  # Gemma stores offsets from 1
        return (rng.uniform(-0.5, 0.5, n) if gemma else rng.uniform(0.5, 1.5, n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(V, C, 0.5), "model.norm.weight": gain(C)}
    if s["arch"] == "stablelm":
        w["model.norm.bias"] = (rng.standard_normal(C) * 0.1).astype(np.float32)
    olmo = s["arch"] in ("olmo2", "exaone4")  # norms after the branches only
    if s["arch"] in ("llama", "qwen2", "qwen3", "phi3", "olmo2", "exaone4", "seed_oss", "glm4", "apertus",
                     "hunyuan-dense", "stablelm"):
        w["lm_head.weight"] = mat(V, C)
    for i in range(L):
        p = f"model.layers.{i}."
        if s["arch"] == "apertus":  # (its norms' names)
            w[p + "attention_layernorm.weight"], w[p + "feedforward_layernorm.weight"] = gain(C), gain(C)
        elif not olmo:
            w[p + "input_layernorm.weight"] = gain(C)
        if s["arch"] not in ("cohere2", "apertus"):  # (Command R: one norm before both branches)
            w[p + "post_attention_layernorm.weight"] = gain(C)
        if s["arch"] in ("gemma2", "gemma3"):
            w[p + "pre_feedforward_layernorm.weight"] = gain(C)
        if s["arch"] in ("gemma2", "gemma3", "olmo2", "exaone4"):
            w[p + "post_feedforward_layernorm.weight"] = gain(C)
        if s["arch"] == "glm4":
            w[p + "post_self_attn_layernorm.weight"], w[p + "post_mlp_layernorm.weight"] = gain(C), gain(C)
        q, k, v = mat(H * D, C), mat(K * D, C), mat(K * D, C)
        if s["arch"] == "phi3":
            w[p + "self_attn.qkv_proj.weight"] = np.concatenate([q, k, v])
            w[p + "mlp.gate_up_proj.weight"] = np.concatenate([mat(F, C), mat(F, C)])
        elif s["arch"] == "apertus":  # a plain MLP through xIELU, its parameters a layer each
            w.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v, p + "mlp.up_proj.weight": mat(F, C)})
            w[p + "mlp.act_fn.alpha_p"] = rng.uniform(-0.5, 0.5, 1).astype(np.float32)
            w[p + "mlp.act_fn.alpha_n"] = rng.uniform(-0.5, 0.5, 1).astype(np.float32)
            w[p + "mlp.act_fn.beta"] = np.array(0.5, dtype=np.float32)
            w[p + "mlp.act_fn.eps"] = np.array(-1e-6, dtype=np.float32)
        elif s["arch"] == "glm4":
            w.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v,
                      p + "mlp.gate_up_proj.weight": np.concatenate([mat(F, C), mat(F, C)])})
        else:
            w.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v, p + "mlp.gate_proj.weight": mat(F, C),
                      p + "mlp.up_proj.weight": mat(F, C)})
        w[p + "self_attn.o_proj.weight"] = mat(C, H * D)
        w[p + "mlp.down_proj.weight"] = mat(C, F)
        if s["arch"] == "stablelm":  # layer norms with biases; a [D] norm per head of q and of k
            for norm in ("input_layernorm", "post_attention_layernorm"):
                w[p + f"{norm}.bias"] = (rng.standard_normal(C) * 0.1).astype(np.float32)
            for part, n in (("q", H), ("k", K)):
                for h in range(n):
                    w[p + f"self_attn.{part}_layernorm.norms.{h}.weight"] = gain(D)
        if s["arch"] in ("qwen2", "seed_oss", "glm4", "stablelm"):
            for part, n in (("q", H), ("k", K), ("v", K)):
                w[p + f"self_attn.{part}_proj.bias"] = (rng.standard_normal(n * D) * 0.1).astype(np.float32)
        if s["arch"] in ("qwen3", "gemma3", "exaone4", "apertus"):
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = gain(D), gain(D)
        if s["arch"] == "hunyuan-dense":
            w[p + "self_attn.query_layernorm.weight"], w[p + "self_attn.key_layernorm.weight"] = gain(D), gain(D)
        if s["arch"] == "olmo2":  # (over every head's channels at once)
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = gain(H * D), gain(K * D)
    return w


def gptneox_hf_weights(case: str, seed: int = 0) -> dict[str, np.ndarray]:
    """GPT-NeoX's own names and layout: q, k and v interleaved by head in query_key_value ([heads, 3, D] rows)."""
    s, V = spec(case), vocab_size(case)
    rng = np.random.RandomState(seed + sum(map(ord, case)))
    C, F = s["hidden"], s["ffn"]

    def mat(*shape, std=0.15):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = {"gpt_neox.embed_in.weight": mat(V, C, std=0.5), "lm_head.weight": mat(V, C),  # (transformers 5's name)
         "gpt_neox.final_layer_norm.weight": rng.uniform(0.5, 1.5, C).astype(np.float32),
         "gpt_neox.final_layer_norm.bias": mat(C, std=0.1)}
    for i in range(s["layers"]):
        p = f"gpt_neox.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[p + f"{norm}.weight"], w[p + f"{norm}.bias"] = (rng.uniform(0.5, 1.5, C).astype(np.float32),
                                                              mat(C, std=0.1))
        for name, rows, cols in (("attention.query_key_value", 3 * C, C), ("attention.dense", C, C),
                                 ("mlp.dense_h_to_4h", F, C), ("mlp.dense_4h_to_h", C, F)):
            w[p + f"{name}.weight"], w[p + f"{name}.bias"] = mat(rows, cols), mat(rows, std=0.1)
    return w


def gptneox_gguf_tensors(case: str) -> dict[str, np.ndarray]:
    """As the converter writes them: query_key_value's rows regrouped q | k | v."""
    s, w = spec(case), gptneox_hf_weights(case)
    H, C = s["heads"], s["hidden"]
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "attention.query_key_value": "attn_qkv", "attention.dense": "attn_output",
             "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}
    out = {"token_embd.weight": w["gpt_neox.embed_in.weight"], "output.weight": w["lm_head.weight"],
           "output_norm.weight": w["gpt_neox.final_layer_norm.weight"],
           "output_norm.bias": w["gpt_neox.final_layer_norm.bias"]}
    for name, t in w.items():
        if not name.startswith("gpt_neox.layers."):
            continue
        i, rest = name.split(".")[2], name.split(".", 3)[3]
        ours, _, kind = rest.rpartition(".")
        if ours == "attention.query_key_value":
            t = t.reshape(H, 3, C // H, *t.shape[1:]).swapaxes(0, 1).reshape(t.shape)
        out[f"blk.{i}.{names[ours]}.{kind}"] = t
    return out


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


# A layer's tensors: Hugging Face names (after "model.layers.N.") -> the converter's (after "blk.N."), those every
# architecture with Llama's names has
LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
               "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
               "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The q/k row order llama.cpp's converter gives the llama architecture (its rotary turns adjacent pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(case: str) -> dict[str, np.ndarray]:
    """The file's tensors, named and changed as convert_hf_to_gguf.py does for the case's architecture."""
    if spec(case)["arch"] in STATE_ARCHITECTURES:
        return state_gguf_tensors(case)
    if spec(case)["arch"] == "gptneox":
        return gptneox_gguf_tensors(case)
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
        elif name == "model.norm.bias":
            out["output_norm.bias"] = t
        elif "_layernorm.norms." in name:  # (StableLM) the converter stacks a layer's per-head norms: [heads, D]
            i, part = name.split(".")[2], name.split(".")[4][0]
            if name.endswith(".norms.0.weight"):
                heads = s["heads"] if part == "q" else s["kv_heads"]
                out[f"blk.{i}.attn_{part}_norm.weight"] = np.stack([w[f"model.layers.{i}.self_attn.{part}_layernorm"
                                                                       f".norms.{h}.weight"] for h in range(heads)])
        elif name == "lm_head.weight":
            out["output.weight"] = t
        elif ".act_fn." in name:  # (the converter's metadata: write() puts them there)
            continue
        else:
            i, rest = name.split(".", 3)[2], name.split(".", 3)[3]
            post = "post_attention_norm" if arch in ("gemma2", "gemma3", "olmo2", "exaone4", "seed_oss") else "ffn_norm"
            theirs = {**LAYER_NAMES, "post_attention_layernorm.weight": f"{post}.weight",
                      "post_self_attn_layernorm.weight": "post_attention_norm.weight",
                      "attention_layernorm.weight": "attn_norm.weight",
                      "feedforward_layernorm.weight": "ffn_norm.weight",
                      "input_layernorm.bias": "attn_norm.bias", "post_attention_layernorm.bias": "ffn_norm.bias",
                      "self_attn.query_layernorm.weight": "attn_q_norm.weight",
                      "self_attn.key_layernorm.weight": "attn_k_norm.weight",
                      "post_mlp_layernorm.weight": "post_ffw_norm.weight",
                      "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                      "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
                      "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                      "self_attn.v_proj.bias": "attn_v.bias", "self_attn.qkv_proj.weight": "attn_qkv.weight",
                      "mlp.gate_up_proj.weight": "ffn_up.weight"}[rest]
            if arch in PERMUTED and theirs in ("attn_q.weight", "attn_k.weight"):
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
    if arch in STATE_ARCHITECTURES:
        return write_state(writer, case, qtype)
    write_shape(writer, s, s["layers"], s["kv_heads"])
    if s["head_dim"] != s["hidden"] // s["heads"]:
        writer.add_key_length(s["head_dim"])
        writer.add_value_length(s["head_dim"])
    writer.add_rope_dimension_count(s.get("rotary", s["head_dim"]))
    if s.get("window"):
        writer.add_sliding_window(s["window"])
    if arch == "apertus":  # xIELU's parameters as the converter writes them: a value a layer, as stored
        w = hf_weights(case)
        for key, add in (("alpha_n", writer.add_xielu_alpha_n), ("alpha_p", writer.add_xielu_alpha_p),
                         ("beta", writer.add_xielu_beta), ("eps", writer.add_xielu_eps)):
            add([float(w[f"model.layers.{i}.mlp.act_fn.{key}"].reshape(())) for i in range(s["layers"])])
    if s.get("logit_scale"):
        writer.add_logit_scale(s["logit_scale"])
    if arch == "gptneox":
        writer.add_parallel_residual(True)
    if arch in ("cohere2", "stablelm", "gptneox"):  # layer norms: their eps under its own key
        writer.add_layer_norm_eps(s["eps"])
    if s.get("window") and arch == "olmo2":  # (the converter's pattern for OLMo 3: every 4th layer full)
        writer.add_sliding_window_pattern([(i + 1) % 4 != 0 for i in range(s["layers"])])
    if s.get("attn_softcap"):
        writer.add_attn_logit_softcapping(s["attn_softcap"])
        writer.add_final_logit_softcapping(s["final_softcap"])
    if s.get("linear_factor"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(s["linear_factor"])
    if s.get("multipliers"):  # Granite's, as the converter names them
        m = s["multipliers"]
        writer.add_attention_scale(m["attention"])
        writer.add_embedding_scale(m["embedding"])
        writer.add_residual_scale(m["residual"])
        writer.add_logit_scale(m["logits"])
    if s.get("longrope"):  # Phi-3-mini-128k style: the context 8x the original, attention factor as the converter
        writer.add_rope_scaling_orig_ctx_len(s["original_context"])
        scale = s["context"] / s["original_context"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(s["original_context"])))
    write_vocabulary(writer, s["tokenizer"])

    def stored(name: str, t: np.ndarray):
        kind = name.split(".")[-2]
        block = qtype is not None and t.ndim == 2 and kind.startswith(("attn_", "ffn_")) and "norm" not in kind
        return (gguf.quants.quantize(t, qtype), qtype) if block else (t, None)

    return write_tensors(writer, gguf_tensors(case), stored)


def write_shape(writer, s: dict, layers: int, kv_heads) -> None:
    """The metadata every architecture has (layers: the block count; kv_heads: a count, or one a layer)."""
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(s["eps"])
    writer.add_rope_freq_base(s["theta"])


def write_tensors(writer, tensors: dict[str, np.ndarray], stored) -> str:
    """Write the tensors, each as stored(name, t) gives it: (raw array, GGUF type or None for its numpy type), and
    the file. Returns the digest of the names and raw arrays."""
    digest = hashlib.sha256()
    for name, t in tensors.items():
        raw, kind = stored(name, t)
        writer.add_tensor(name, raw, raw_dtype=kind)
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


# ----------------------------------------------------------------------------------------------------------------
# The hybrids whose other layers keep a state: Qwen3.5 (qwen35) and LFM2 (lfm2)


def state_hf_weights(case: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Qwen3_5ForCausalLM's tensors (and its checkpoint's mtp.* layer), or Lfm2ForCausalLM's (a tied head), in their
    Hugging Face names."""
    s = spec(case)
    rng = np.random.RandomState(seed + sum(map(ord, case)))
    C, H, K, D, F, W = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], s["ffn"], s["conv"]
    qwen = s["arch"] == "qwen35"

    def mat(rows, cols, std=0.15):
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def gain(n):  # Qwen3.5's norms store offsets from 1 (all but the Gated DeltaNet's own)
        return (rng.uniform(-0.5, 0.5, n) if qwen else rng.uniform(0.5, 1.5, n)).astype(np.float32)

    def attention(p: str) -> dict:  # Qwen3.5's q_proj: per head, D query rows then D output-gate rows
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm") if qwen else (
            "q_proj", "k_proj", "v_proj", "out_proj", "q_layernorm", "k_layernorm")
        shapes = [((2 if qwen else 1) * H * D, C), (K * D, C), (K * D, C), (C, H * D)]
        out = {f"{p}self_attn.{n}.weight": mat(*shape) for n, shape in zip(names, shapes)}
        out.update({f"{p}self_attn.{n}.weight": gain(D) for n in names[4:]})
        return out

    def layer(p: str, kind: str) -> dict:
        out = {p + ("input_layernorm" if qwen else "operator_norm") + ".weight": gain(C),
               p + ("post_attention_layernorm" if qwen else "ffn_norm") + ".weight": gain(C)}
        gate, up, down = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj") if qwen else (
            "feed_forward.w1", "feed_forward.w3", "feed_forward.w2")
        out.update({f"{p}{gate}.weight": mat(F, C), f"{p}{up}.weight": mat(F, C), f"{p}{down}.weight": mat(C, F)})
        if kind == "full_attention":
            return {**out, **attention(p)}
        if kind == "conv":
            return {**out, p + "conv.in_proj.weight": mat(3 * C, C), p + "conv.out_proj.weight": mat(C, C),
                    p + "conv.conv.weight": (rng.standard_normal((C, 1, W)) * 0.3).astype(np.float32)}
        k_heads, v_heads, dim = s["linear"]
        channels, a = 2 * k_heads * dim + v_heads * dim, p + "linear_attn."
        return {**out, a + "in_proj_qkv.weight": mat(channels, C), a + "in_proj_z.weight": mat(v_heads * dim, C),
                a + "in_proj_b.weight": mat(v_heads, C), a + "in_proj_a.weight": mat(v_heads, C),
                a + "conv1d.weight": (rng.standard_normal((channels, 1, W)) * 0.6).astype(np.float32),
                a + "dt_bias": rng.uniform(-1, 1, v_heads).astype(np.float32),
                a + "A_log": np.log(rng.uniform(0.02, 0.5, v_heads)).astype(np.float32),
                a + "norm.weight": rng.uniform(0.5, 1.5, dim).astype(np.float32),
                a + "out_proj.weight": mat(C, v_heads * dim)}

    w = {"model.embed_tokens.weight": mat(vocab_size(case), C, 0.5),
         "model.norm.weight" if qwen else "model.embedding_norm.weight": gain(C)}
    if qwen:
        w["lm_head.weight"] = mat(vocab_size(case), C)
    for i, kind in enumerate(s["layer_types"]):
        w.update(layer(f"model.layers.{i}.", kind))
    if s.get("mtp"):  # Qwen3.5's multi-token prediction: fc of the normed embedding | hidden state, attention layers
        w.update({"mtp.fc.weight": mat(C, 2 * C), "mtp.pre_fc_norm_embedding.weight": gain(C),
                  "mtp.pre_fc_norm_hidden.weight": gain(C), "mtp.norm.weight": gain(C)})
    for j in range(s.get("mtp", 0)):
        w.update(layer(f"mtp.layers.{j}.", "full_attention"))
    return w


QWEN35_NAMES = {**LAYER_NAMES, "post_attention_layernorm.weight": "post_attention_norm.weight",
                "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
                "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
                "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
                "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
                "linear_attn.out_proj.weight": "ssm_out.weight"}
LFM2_NAMES = {"operator_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.out_proj.weight": "attn_output.weight",
              "self_attn.q_layernorm.weight": "attn_q_norm.weight",
              "self_attn.k_layernorm.weight": "attn_k_norm.weight",
              "conv.conv.weight": "shortconv.conv.weight", "conv.in_proj.weight": "shortconv.in_proj.weight",
              "conv.out_proj.weight": "shortconv.out_proj.weight", "feed_forward.w1.weight": "ffn_gate.weight",
              "feed_forward.w3.weight": "ffn_up.weight", "feed_forward.w2.weight": "ffn_down.weight"}
STATE_MODEL_NAMES = {"lm_head.weight": "output.weight", "model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight", "model.embedding_norm.weight": "token_embd_norm.weight"}


def tiled(t: np.ndarray, axis: int, key_heads: int, value_heads: int, dim: int) -> np.ndarray:
    """The converter's V-head reorder (_LinearAttentionVReorderBase): heads along `axis`, grouped by key head
    [G0 v0, G0 v1, G1 v0, ...], become tiled [G0 v0, G1 v0, G0 v1, ...]."""
    t = np.moveaxis(t, axis, 0)
    t = t.reshape(key_heads, value_heads // key_heads, dim, *t.shape[1:]).swapaxes(0, 1).reshape(t.shape)
    return np.ascontiguousarray(np.moveaxis(t, 0, axis))


def state_gguf_tensors(case: str) -> dict[str, np.ndarray]:
    """qwen35 / lfm2 tensors named and changed as convert_hf_to_gguf.py does, in its order (the checkpoint's sorted
    names): conv kernels squeezed to [channels, W]; qwen35: norms + 1 but the Gated DeltaNet's, ssm_a = -exp(A_log),
    dt_bias as ssm_dt.bias, value heads tiled, the MTP layer as blk.L.* with nextn.* tensors."""
    import torch

    s, w = spec(case), hf_weights(case)
    L, qwen = len(s["layer_types"]), s["arch"] == "qwen35"
    mtp = {"mtp.fc.weight": f"blk.{L}.nextn.eh_proj.weight",
           "mtp.pre_fc_norm_embedding.weight": f"blk.{L}.nextn.enorm.weight",
           "mtp.pre_fc_norm_hidden.weight": f"blk.{L}.nextn.hnorm.weight",
           "mtp.norm.weight": f"blk.{L}.nextn.shared_head_norm.weight"}
    out = {}
    for name in sorted(w):
        t = w[name]
        parts = name.split(".", 3)
        if name in STATE_MODEL_NAMES or name in mtp:
            theirs = STATE_MODEL_NAMES.get(name) or mtp[name]
        else:
            layer = int(parts[2]) + (L if parts[0] == "mtp" else 0)
            theirs = f"blk.{layer}." + (QWEN35_NAMES if qwen else LFM2_NAMES)[parts[3]]
        if "conv" in theirs.split(".")[-2]:
            t = t.squeeze(1)
        if qwen and ".linear_attn." in name and s["linear"][0] != s["linear"][1]:
            k_heads, v_heads, dim = s["linear"]
            keys = 2 * k_heads * dim
            if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
                t = np.concatenate([t[:keys], tiled(t[keys:], 0, k_heads, v_heads, dim)])
            elif name.endswith(("in_proj_z.weight", "out_proj.weight")):
                t = tiled(t, 0 if "in_proj_z" in name else 1, k_heads, v_heads, dim)
            elif not name.endswith("norm.weight"):  # b, a, dt_bias, A_log: one row or value per head
                t = tiled(t, 0, k_heads, v_heads, 1)
        if qwen and name.endswith("A_log"):
            t = (-torch.exp(torch.from_numpy(t))).numpy()  # (as the converter computes it: torch, float32)
        if qwen and theirs.endswith("norm.weight") and not theirs.endswith("ssm_norm.weight"):
            t = t + np.float32(1)
        out[theirs] = t
    return out


def kquant_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Random K-quant blocks [rows, bytes] (gguf cannot make K-quants) whose values spread about 0 by about 0.05:
    Q4_K's w = d * scale * q - dmin * min (scale, min in 0..63, q in 0..15: dmin = 7.5 d centres it), Q6_K's
    w = d * scale * (q - 32) (signed scales)."""
    size, halves = {Q.Q4_K: (144, {0: 2e-4, 2: 1.5e-3}), Q.Q6_K: (210, {208: 4e-5})}[qtype]
    raw = rng.randint(0, 256, size=(rows, cols // 256, size)).astype(np.uint8)
    for at, value in halves.items():
        raw[..., at:at + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


def write_state(writer, case: str, qtype=None) -> str:
    """A qwen35 or lfm2 file: the metadata convert_hf_to_gguf.py writes, the vocabulary, the tensors (with qtype,
    every 2-D one but the conv kernels in that type, as the converter's --outtype q8_0; Q4_K: random blocks, Q6_K
    for the head, attn_v and ffn_down as llama.cpp's Q4_K_M picks). Returns the weights' digest."""
    s = spec(case)
    arch, types, mtp = s["arch"], s["layer_types"], s.get("mtp", 0)
    # lfm2: key/value heads per layer, 0 marking a conv layer; qwen35: the MTP layer counted among the blocks
    kv_heads = [0 if kind == "conv" else s["kv_heads"] for kind in types] if arch == "lfm2" else s["kv_heads"]
    write_shape(writer, s, len(types) + mtp, kv_heads)
    if arch == "lfm2":
        writer.add_vocab_size(vocab_size(case))
        writer.add_shortconv_l_cache(s["conv"])
    else:
        k_heads, v_heads, dim = s["linear"]
        writer.add_key_length(s["head_dim"])
        writer.add_value_length(s["head_dim"])
        if mtp:
            writer.add_nextn_predict_layers(mtp)
        writer.add_ssm_conv_kernel(s["conv"])
        writer.add_ssm_state_size(dim)
        writer.add_ssm_group_count(k_heads)
        writer.add_ssm_time_step_rank(v_heads)
        writer.add_ssm_inner_size(v_heads * dim)
        recurrent = [kind == "linear_attention" for kind in types] + [False] * mtp  # (the MTP layer: attention)
        writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
        writer.add_full_attention_interval(4)
        writer.add_rope_dimension_count(s["rotary"])
        writer.add_rope_dimension_sections([11, 11, 10, 0])  # (the converter's default mrope sections)
    write_vocabulary(writer, s["tokenizer"])
    rng = np.random.RandomState(sum(map(ord, case)))

    def stored(name: str, t: np.ndarray):
        if qtype is None or t.ndim != 2 or "conv" in name.split(".")[-2]:
            return t, None
        if qtype != Q.Q4_K:
            return gguf.quants.quantize(t, qtype), qtype
        kind = Q.Q6_K if name == "output.weight" or name.split(".")[-2] in ("attn_v", "ffn_down") else Q.Q4_K
        return kquant_blocks(kind, *t.shape, rng), kind

    return write_tensors(writer, gguf_tensors(case), stored)


def state_hf_config(case: str):
    """transformers' config of the case's model (Qwen3_5TextConfig or Lfm2Config): what its Hugging Face folder
    says."""
    import transformers

    s = spec(case)
    values = {"vocab_size": vocab_size(case), "hidden_size": s["hidden"], "intermediate_size": s["ffn"],
              "num_hidden_layers": len(s["layer_types"]), "num_attention_heads": s["heads"],
              "num_key_value_heads": s["kv_heads"], "max_position_embeddings": s["context"],
              "layer_types": s["layer_types"], "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if s["arch"] == "lfm2":  # (its FFN width as LFM2's configs give it: 2/3 of intermediate_size, rounded up)
        values["intermediate_size"] = s["ffn"] * 3 // 2
        return transformers.Lfm2Config(**values, norm_eps=s["eps"], conv_L_cache=s["conv"],
                                       block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
                                       block_multiple_of=64, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": s["theta"]})
    k_heads, v_heads, dim = s["linear"]
    return transformers.Qwen3_5TextConfig(
        **values, head_dim=s["head_dim"], rms_norm_eps=s["eps"], linear_conv_kernel_dim=s["conv"],
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=dim,
        linear_value_head_dim=dim, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": s["theta"],
                         "partial_rotary_factor": s["rotary"] / s["head_dim"]})
