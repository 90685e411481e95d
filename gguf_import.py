"""gguf_import.py: llama.cpp's GGUF files (architecture "llama") as native checkpoints, and their tokenizers.

Weights: read with the `gguf` package (llama.cpp's own reader, memory-mapped) and dequantized with its own
dequantizer (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, ...). llama.cpp's converter permutes the rows of
the q and k projections so that its rotary embedding can rotate adjacent pairs (2i, 2i+1); we undo that permutation
so the weights match the Hugging Face layout, rotate-half pairs (i, i + D/2). The two are the same model.

Tokenizer: `tokenizer.ggml.*` (tokens, merges, token types, bos/eos, the pre-tokenizer) rebuilt as a Hugging Face
`tokenizers` tokenizer; the chat template is kept for tokenizer_config.json.
Stands on dense.py, checkpoint.py and quantized.py (int4's stored layout); convert.py dispatches .gguf files here.
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch

import quantized
from checkpoint import Checkpoint
from dense import CheckpointError, DenseConfig

# Token texts that end a turn in common chat formats (llama.cpp recognises them the same way).
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "<|end|>", "</s>")
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def open_gguf(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({str(e).splitlines()[0]})") from None


def field(reader, key: str, default=None, path: str = ""):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise CheckpointError(f"{path}: missing GGUF metadata {key!r}")
        return default
    try:
        return f.contents()
    except Exception as e:  # damaged values: undecodable strings, arrays shorter than declared
        raise CheckpointError(f"{path}: GGUF metadata {key!r} is damaged ({type(e).__name__})") from None


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows (pair, 2) -> (2, pair), i.e. back to rotate-half halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_gguf(path: str):
    """A GGUF file of architecture llama as a convert.Checkpoint: the weights dequantized with gguf's own dequantizer,
    each tensor's GGUF type, and for Q4_0 / Q4_1 linears their blocks as int4-g32 tensors (exact_int4_tensors)."""
    import gguf

    reader = open_gguf(path)
    arch = field(reader, "general.architecture", path=path)
    if arch != "llama":
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    tensors = {t.name: t for t in reader.tensors}
    hidden = int(field(reader, "llama.embedding_length", path=path))
    heads = int(field(reader, "llama.attention.head_count", path=path))
    kv_heads = int(field(reader, "llama.attention.head_count_kv", heads, path))
    head_dim = int(field(reader, "llama.attention.key_length", hidden // max(heads, 1), path))
    rope_dim = int(field(reader, "llama.rope.dimension_count", head_dim, path))
    if rope_dim != head_dim or "rope_freqs.weight" in tensors or "llama.rope.scaling.type" in reader.fields:
        raise CheckpointError(f"{path}: rotary scaling or partial rotary in a llama GGUF is not supported")
    vocab = int(field(reader, "llama.vocab_size", 0, path) or len(field(reader, "tokenizer.ggml.tokens", path=path)))
    tied = "output.weight" not in tensors
    config = DenseConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=int(field(reader, "llama.block_count", path=path)),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=int(field(reader, "llama.feed_forward_length", path=path)),
        max_position_embeddings=int(field(reader, "llama.context_length", 2048, path)),
        rope_theta=float(field(reader, "llama.rope.freq_base", 10000.0, path)), rope_precision="float32",
        norm_eps=float(field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5, path)), qk_norm="none",
        attn_output_gate=False, tie_word_embeddings=tied)

    def shape_of(t) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first

    def read(name: str, permute_heads: int | None = None):
        def thunk() -> torch.Tensor:
            t = tensors[name]
            try:
                values = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise CheckpointError(f"{path}: tensor {name!r} has type {t.tensor_type.name}, which gguf cannot "
                                      "dequantize") from None
            except (ValueError, TypeError, IndexError) as e:
                raise CheckpointError(f"{path}: tensor {name!r} is damaged ({str(e).splitlines()[0]})") from None
            if values.size != math.prod(shape_of(t)):
                raise CheckpointError(f"{path}: tensor {name!r} holds {values.size} values, its shape "
                                      f"{list(shape_of(t))} needs {math.prod(shape_of(t))}")
            values = values.reshape(shape_of(t))
            w = torch.from_numpy(values.copy() if not values.flags.writeable else np.ascontiguousarray(values))
            return unpermute(w, permute_heads) if permute_heads else w
        return thunk

    def read_int4(name: str, permute_heads: int | None = None):
        def thunk() -> dict:
            return int4_tensors(tensors[name], shape_of(tensors[name]), permute_heads, path)
        return thunk

    names = {"token_embd.weight": ("embed_tokens.weight", None), "output_norm.weight": ("norm.weight", None),
             "output.weight": ("lm_head.weight", None)}
    per_layer = {"attn_norm": ("attn_norm", None), "ffn_norm": ("mlp_norm", None), "attn_q": ("attn.q_proj", heads),
                 "attn_k": ("attn.k_proj", kv_heads), "attn_v": ("attn.v_proj", None),
                 "attn_output": ("attn.o_proj", None), "ffn_gate": ("mlp.gate_proj", None),
                 "ffn_up": ("mlp.up_proj", None), "ffn_down": ("mlp.down_proj", None)}
    for i in range(config.num_hidden_layers):
        for theirs, (ours, permute) in per_layer.items():
            names[f"blk.{i}.{theirs}.weight"] = (f"layers.{i}.{ours}.weight", permute)
    table, types, exact = {}, {}, {}
    for name in tensors:
        if name not in names:
            raise CheckpointError(f"{path}: unexpected tensor {name!r}")
        native, permute = names[name]
        table[native] = read(name, permute)
        types[native] = tensors[name].tensor_type.name
        if types[native] in ("Q4_0", "Q4_1") and native.startswith("layers."):
            exact[native.removesuffix(".weight")] = read_int4(name, permute)
    return Checkpoint(path, config, table, source_types=types, exact_int4=exact)


def int4_tensors(t, shape: tuple[int, ...], permute_heads: int | None, path: str) -> dict:
    """A Q4_0 / Q4_1 tensor's blocks as int4-g32's stored tensors, exactly: Q4_1 blocks are {d, m, 16 bytes} with
    w = d * q + m, Q4_0 blocks are {d, 16 bytes} with w = d * (q - 8) = d * q + (-8 d); byte j of a block holds q[j]
    in its low nibble and q[j + 16] in its high one."""
    rows, cols = shape
    header = 4 if t.tensor_type.name == "Q4_1" else 2
    blocks = np.asarray(t.data, dtype=np.uint8).reshape(-1, header + 16)
    if blocks.shape[0] != rows * cols // 32:
        raise CheckpointError(f"{path}: tensor {t.name!r} holds {blocks.shape[0]} blocks, expected {rows * cols // 32}")
    d = torch.from_numpy(blocks[:, 0:2].copy().view(np.float16)).reshape(rows, cols // 32)
    m = torch.from_numpy(blocks[:, 2:4].copy().view(np.float16)).reshape(rows, cols // 32) if header == 4 else -8 * d
    packed = torch.from_numpy(blocks[:, header:].copy())  # [blocks, 16]
    codes = torch.cat((packed & 15, packed >> 4), dim=1).reshape(rows, cols)
    if permute_heads:
        codes, d, m = (unpermute(x, permute_heads) for x in (codes, d, m))
    return quantized.int4_pack(codes, d, m)


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer


def pre_tokenizer(pre: str, path: str):
    """The pre-tokenizer llama.cpp uses for tokenizer.ggml.pre, in `tokenizers` terms."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2", "gpt-2", "olmo", "starcoder", "refact", "jina-es", "jina-de"):
        return byte_level
    if pre == "smollm":  # every digit alone, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe"):
        llama3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(llama3), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise CheckpointError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported")


def build_tokenizer(reader, path: str):
    """A `tokenizers.Tokenizer` equal to the model's own, from the GGUF metadata (BPE, "gpt2" models)."""
    try:
        return _build_tokenizer(reader, path)
    except CheckpointError:
        raise
    except Exception as e:  # tokens or merges the tokenizers library refuses
        raise CheckpointError(f"{path}: the GGUF's tokenizer cannot be built ({type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0][:200]})") from None


def _build_tokenizer(reader, path: str):
    from tokenizers import AddedToken, Tokenizer, decoders, models

    model = field(reader, "tokenizer.ggml.model", path=path)
    if model != "gpt2":
        raise CheckpointError(f"{path}: tokenizer.ggml.model {model!r} is not supported (only BPE 'gpt2')")
    tokens = field(reader, "tokenizer.ggml.tokens", path=path)
    types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens), path)
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", path=path)]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizer(field(reader, "tokenizer.ggml.pre", "default", path), path)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(t, special=ty == CONTROL, normalized=False)
                          for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)])
    return tokenizer


def side_files(path: str) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and generation_config.json texts for a GGUF's native folder."""
    reader = open_gguf(path)
    tokens = field(reader, "tokenizer.ggml.tokens", path=path)
    types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens), path)
    bos = int(field(reader, "tokenizer.ggml.bos_token_id", -1, path))
    eos = int(field(reader, "tokenizer.ggml.eos_token_id", -1, path))
    for name, value in (("bos", bos), ("eos", eos)):
        if value >= len(tokens):
            raise CheckpointError(f"{path}: tokenizer.ggml.{name}_token_id {value} is not among the {len(tokens)} tokens")
    stops = [eos] if eos >= 0 else []
    stops += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in END_OF_TURN and i not in stops]
    tokenizer_config = {"bos_token": tokens[bos] if bos >= 0 else None, "eos_token": tokens[eos] if eos >= 0 else None,
                        "add_bos_token": False, "model_max_length": int(field(reader, "llama.context_length", 2048, path))}
    template = field(reader, "tokenizer.chat_template", "", path)
    if template:
        tokenizer_config["chat_template"] = template
    generation = {"bos_token_id": bos if bos >= 0 else None, "eos_token_id": stops}
    return {"tokenizer.json": build_tokenizer(reader, path).to_str(),
            "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n",
            "generation_config.json": json.dumps(generation, indent=2) + "\n"}
