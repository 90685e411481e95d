"""gpt_neox.py: GPT-NeoX (Pythia, GPT-NeoX-20B): LayerNorm with bias, per-head fused qkv, partial rotary, parallel
residual, exact GELU. Read from a Hugging Face folder (model_type "gpt_neox"), from the original two-way
tensor-parallel release (global_step*/layer_NN-model_0R-model_states.pt + configs/*.yml: neox_original) and from a
GGUF file (gptneox: q|k|v fused in attn_qkv, as the Llama-layout rows' files fuse Phi-3's).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os

import torch

from dense import DenseConfig
from dense_engine.formats.checkpoint import load_pickle, make_config
from dense_engine.formats.families.common import head_rule, hf_weights, need, rename, split_rows
from dense_engine.formats.families.llama import Family, gguf_layer
from dense_engine.formats.gguf_import import Architecture, Metadata
from dense_engine.system.errors import CheckpointError, first_line


def neox_config(source: str, hidden: int, heads: int, layers: int, vocab: int, ffn: int, rotary_pct: float,
                base: float, context: int, eps: float, parallel: bool, tied: bool) -> DenseConfig:
    head_dim = hidden // heads
    return make_config(
        source, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        head_dim=head_dim, intermediate_size=ffn, max_position_embeddings=context, rope_theta=base,
        rotary_dim=int(head_dim * rotary_pct), norm="layernorm", norm_eps=eps, mlp="gelu", bias=True,
        parallel_residual=parallel, tie_word_embeddings=tied)


def split_neox_qkv(table: dict, config: DenseConfig) -> None:
    """query_key_value rows are [head, (q, k, v), head_dim]: split them per head."""
    H, D = config.num_attention_heads, config.head_dim
    for i in range(config.num_hidden_layers):
        a = f"layers.{i}.mixer."
        for kind in ("weight", "bias"):
            split_rows(table, a + f"qkv.{kind}", {a + f"{p}_proj.{kind}": j for j, p in enumerate("qkv")},
                       view=(H, 3, D))


NEOX_RULES = [
    (r"(?:gpt_neox\.)?embed_in\.weight", "embed_tokens.weight"),
    (r"(?:gpt_neox\.)?final_layer_norm\.(weight|bias)", r"norm.\1"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.input_layernorm\.(weight|bias)", r"layers.\1.mixer_norm.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.post_attention_layernorm\.(weight|bias)", r"layers.\1.mlp_norm.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.attention\.query_key_value\.(weight|bias)", r"layers.\1.mixer.qkv.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.attention\.dense\.(weight|bias)", r"layers.\1.mixer.o_proj.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.mlp\.dense_h_to_4h\.(weight|bias)", r"layers.\1.mlp.up_proj.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.mlp\.dense_4h_to_h\.(weight|bias)", r"layers.\1.mlp.down_proj.\2")]


def read_hf(folder: str, raw: dict, source: str):
    """GPT-NeoX, Hugging Face layout."""
    if raw.get("hidden_act", "gelu") != "gelu":
        raise CheckpointError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only exact 'gelu')")
    rope = raw.get("rope_parameters") or {}
    rotary_pct = rope.get("partial_rotary_factor", raw.get("rotary_pct", raw.get("partial_rotary_factor", 0.25)))
    base = rope.get("rope_theta", raw.get("rotary_emb_base", raw.get("rope_theta", 10000)))
    tied = bool(raw.get("tie_word_embeddings", False))
    hidden = int(need(raw, "hidden_size", source))
    config = neox_config(source, hidden, int(need(raw, "num_attention_heads", source)),
                         int(need(raw, "num_hidden_layers", source)), int(need(raw, "vocab_size", source)),
                         int(raw.get("intermediate_size", 4 * hidden)), float(rotary_pct), float(base),
                         int(raw.get("max_position_embeddings", 2048)), float(raw.get("layer_norm_eps", 1e-5)),
                         bool(raw.get("use_parallel_residual", True)), tied)
    table = rename(hf_weights(folder), [*NEOX_RULES, head_rule(tied, r"embed_out\.weight")], source)
    split_neox_qkv(table, config)
    return config, table


# -- The original two-way tensor-parallel release ---------------------------------------------------------------

NEOX_20B = {"num_layers": 44, "hidden_size": 6144, "num_attention_heads": 64, "rotary_pct": 0.25,
            "rotary_emb_base": 10000, "max_position_embeddings": 2048, "layernorm_epsilon": 1e-5,
            "gpt_j_residual": True, "no_weight_tying": True}


def neox_yaml(folder: str) -> dict:
    """The NeoX YAML config (configs/*.yml) with '-' in keys read as '_'; GPT-NeoX-20B's sizes when absent."""
    files = sorted(glob.glob(os.path.join(folder, "configs", "*.yml")) + glob.glob(os.path.join(folder, "*.yml")))
    values = dict(NEOX_20B)
    for path in files:
        import yaml

        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise CheckpointError(f"{path}: not valid YAML ({first_line(e)})") from None
        values.update({k.replace("-", "_"): v for k, v in data.items()})
    return values


def neox_original(folder: str, rank: int | None = None):
    """GPT-NeoX-20B's original release, merged as its reference merge script does: column-parallel weights/biases, the
    embedding and the readout concatenated on dim 0, row-parallel weights on dim 1, row-parallel biases summed, norms
    checked equal across the shards. Files are read a layer (two shards) at a time. rank 0 or 1 (two-way tensor
    parallel, tp.py): the blocks' tensors are that shard's own, unmerged (its row-parallel bias too: the ranks'
    all-reduce sums them as the merge would)."""
    steps = sorted(glob.glob(os.path.join(folder, "global_step*")))
    latest = os.path.join(folder, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            steps = [os.path.join(folder, f.read().strip())]
    step = steps[-1]
    raw = neox_yaml(folder)
    layers = int(raw["num_layers"])

    @functools.lru_cache(maxsize=2)  # at most two layers' shards (memory-mapped) at a time
    def shards(layer: int):
        files = [os.path.join(step, f"layer_{layer:02d}-model_0{r}-model_states.pt") for r in (0, 1)]
        for f in files:
            if not os.path.isfile(f):
                raise CheckpointError(f"{step}: missing shard {os.path.basename(f)}")
        return load_pickle(files[0]), load_pickle(files[1])

    @functools.lru_cache(maxsize=1)
    def own(layer: int):  # this rank's shard of a layer
        return load_pickle(os.path.join(step, f"layer_{layer:02d}-model_0{rank}-model_states.pt"))

    def merged(layer: int, name: str, how: str):
        def read():
            if rank is not None and 2 <= layer < layers + 2:  # a block's tensor: this shard's own
                return own(layer)[name]
            p1, p2 = shards(layer)
            if name not in p1 or name not in p2:
                raise CheckpointError(f"{step}: layer {layer:02d} shards lack tensor {name!r}")
            a, b = p1[name], p2[name]
            if how == "same":
                if not torch.equal(a, b):
                    raise CheckpointError(f"{step}: {name!r} of layer {layer:02d} differs between the two shards")
                return a
            return a + b if how == "sum" else torch.cat((a, b), dim=0 if how == "dim0" else 1)
        return read

    def shape(layer: int, name: str):
        return shards(layer)[0][name].shape

    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    vocab = 2 * shape(0, "word_embeddings.weight")[0]
    ffn = 2 * shape(2, "mlp.dense_h_to_4h.weight")[0]
    tied = not raw.get("no_weight_tying", True)
    config = neox_config(step, hidden, heads, layers, vocab, ffn, float(raw["rotary_pct"]),
                         float(raw["rotary_emb_base"]),
                         int(raw.get("max_position_embeddings") or raw.get("seq_length") or 2048),
                         float(raw["layernorm_epsilon"]), bool(raw["gpt_j_residual"]), tied)
    table = {"embed_tokens.weight": merged(0, "word_embeddings.weight", "dim0")}
    parts = {"mixer_norm": ("input_layernorm", "same", "same"),
             "mlp_norm": ("post_attention_layernorm", "same", "same"),
             "mixer.qkv": ("attention.query_key_value", "dim0", "dim0"),
             "mixer.o_proj": ("attention.dense", "dim1", "sum"),
             "mlp.up_proj": ("mlp.dense_h_to_4h", "dim0", "dim0"),
             "mlp.down_proj": ("mlp.dense_4h_to_h", "dim1", "sum")}
    for i in range(layers):
        for native, (theirs, weight_how, bias_how) in parts.items():
            table[f"layers.{i}.{native}.weight"] = merged(i + 2, f"{theirs}.weight", weight_how)
            table[f"layers.{i}.{native}.bias"] = merged(i + 2, f"{theirs}.bias", bias_how)
    table["norm.weight"] = merged(layers + 3, "norm.weight", "same")
    table["norm.bias"] = merged(layers + 3, "norm.bias", "same")
    if not tied:
        table["lm_head.weight"] = merged(layers + 4, "final_linear.weight", "dim0")
    split_neox_qkv(table, config if rank is None else dataclasses.replace(config, num_attention_heads=heads // 2))
    return config, table


# -- GGUF files ---------------------------------------------------------------------------------------------------


def gguf_config(meta: Metadata) -> DenseConfig:
    """GPT-NeoX (Pythia): layer norms and biases everywhere, q|k|v fused, a plain GELU MLP, a part of each head
    rotated, the two branches in parallel unless the file says otherwise."""
    key = meta.key
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    rope_dim = int(key("rope.dimension_count", hidden // heads))
    return make_config(
        meta.path, vocab_size=meta.vocab_size(), hidden_size=hidden,
        num_hidden_layers=int(key("block_count")), num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=int(key("feed_forward_length")), max_position_embeddings=int(key("context_length", 2048)),
        rope_theta=float(key("rope.freq_base", 10000.0)), rotary_dim=rope_dim if rope_dim != hidden // heads else None,
        norm="layernorm", norm_eps=float(key("attention.layer_norm_epsilon")), mlp="gelu", bias=True,
        parallel_residual=bool(key("use_parallel_residual", True)), tie_word_embeddings=meta.tied)


GGUF = Architecture(gguf_config, functools.partial(gguf_layer, Family()))  # (its tensors named as a plain row's)
