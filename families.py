"""families.py: each supported checkpoint family's config and tensor names, mapped to dense.py's native ones.

Each family is a small function: read the family's config into a DenseConfig and return a table
{native name: thunk} whose thunks read, slice or merge the family's tensors on demand (checkpoint.py). Stands on
dense.py and checkpoint.py; convert.py dispatches to these by what a path holds.

| family            | what is on disk                                                   |
| ----------------- | ----------------------------------------------------------------- |
| ShellElastic      | native: config.json + model.safetensors (seed 000; convert.py)    |
| Sprout            | ckpt.pt {"model", "config": {vocab_size, dim, n_layers, ...}}     |
| GermanGPT         | checkpoint.pt {"config": {d_model, n_kv_heads, ...}, "model"}      |
| OpenELM           | Hugging Face folder, model_type "openelm"                         |
| GPT-NeoX          | Hugging Face folder, model_type "gpt_neox"                        |
| GPT-NeoX original | global_step*/layer_NN-model_0R-model_states.pt + configs/*.yml    |
| Llama             | Hugging Face folder, model_type "llama"                           |
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re

import numpy as np
import torch

from checkpoint import Checkpoint, eager, load_pickle, open_safetensors, read_json
from dense import CheckpointError, DenseConfig

# Non-parameter buffers that older exports carry; recognised and skipped.
SKIPPED_BUFFERS = re.compile(r".*\.(rotary_emb\.inv_freq|attention\.bias|attention\.masked_bias|attn\.bias|"
                             r"attn\.masked_bias)$")


def hf_weights(folder: str) -> dict:
    """{name: thunk} over a Hugging Face folder: model.safetensors, a sharded safetensors index, or
    pytorch_model.bin (and its index) when there are no safetensors."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = os.path.join(folder, index_name)
        if os.path.isfile(index):
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map'")
            table = {}
            for shard in dict.fromkeys(weight_map.values()):
                shard_path = os.path.join(folder, shard)
                if not os.path.isfile(shard_path):
                    raise CheckpointError(f"{index}: shard {shard!r} is named in the index but absent")
                shard_table = open_safetensors(shard_path) if shard.endswith(".safetensors") else \
                    eager(load_pickle(shard_path))
                table.update({n: f for n, f in shard_table.items() if weight_map.get(n) == shard})
            return table
        if os.path.isfile(os.path.join(folder, single)):
            path = os.path.join(folder, single)
            return open_safetensors(path) if single.endswith(".safetensors") else eager(load_pickle(path))
    raise CheckpointError(f"{folder}: no model.safetensors, safetensors index or pytorch_model.bin")


def rename(source: dict, rules: list[tuple[str, str]], origin: str) -> dict:
    """Map foreign names to native ones with regex rules (first match wins); skipped buffers are dropped and any
    other name that no rule matches is an error."""
    table = {}
    for name, thunk in source.items():
        if SKIPPED_BUFFERS.match(name):
            continue
        for pattern, target in rules:
            if re.fullmatch(pattern, name):
                if target:
                    table[re.sub(pattern, target, name)] = thunk
                break
        else:
            raise CheckpointError(f"{origin}: unexpected tensor {name!r}")
    return table


def split_rows(table: dict, name: str, parts: dict, *, view: tuple[int, ...] | None = None) -> None:
    """Replace the fused tensor table[name] by slices. parts maps native name -> (first row, end row); or, with
    view, rows are reshaped to view (e.g. [heads, 3, head_dim]) and parts maps native name -> index in dim 1."""
    fused = table.pop(name)

    def piece(where):
        def read() -> torch.Tensor:
            t = fused()
            if view is None:
                return t[where[0]:where[1]]
            return t.reshape(view + tuple(t.shape[1:]))[:, where].flatten(0, 1)
        return read

    for target, where in parts.items():
        table[target] = piece(where)


def need(raw: dict, key: str, source: str):
    if key not in raw:
        raise CheckpointError(f"{source}: missing config field {key!r}")
    return raw[key]


# ----------------------------------------------------------------------------------------------------------------
# Families


def sprout(raw: dict, state: dict, source: str):
    """Seed 001: fused qkv, nn.RMSNorm eps 1e-5, rotate-half RoPE in float32, untied head."""
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    dim, heads = int(need(raw, "dim", source)), int(need(raw, "n_heads", source))
    if "blocks.0.mlp.w_gate.weight" not in state:
        raise CheckpointError(f"{source}: missing tensor 'blocks.0.mlp.w_gate.weight'")
    config = DenseConfig(
        vocab_size=int(need(raw, "vocab_size", source)), hidden_size=dim, num_hidden_layers=int(need(raw, "n_layers", source)),
        num_attention_heads=heads, head_dim=dim // heads, intermediate_size=int(state["blocks.0.mlp.w_gate.weight"].shape[0]),
        max_position_embeddings=int(raw.get("block_size", 1024)), rope_precision="float32", norm_eps=1e-5,
        norm_gain_in_float32=True,
        qk_norm="none", attn_output_gate=False)
    table = rename(eager(state), [
        (r"tok_emb\.weight", "embed_tokens.weight"), (r"norm_f\.weight", "norm.weight"), (r"head\.weight", "lm_head.weight"),
        (r"blocks\.(\d+)\.n1\.weight", r"layers.\1.attn_norm.weight"), (r"blocks\.(\d+)\.n2\.weight", r"layers.\1.mlp_norm.weight"),
        (r"blocks\.(\d+)\.attn\.qkv\.weight", r"layers.\1.attn.qkv.weight"),
        (r"blocks\.(\d+)\.attn\.proj\.weight", r"layers.\1.attn.o_proj.weight"),
        (r"blocks\.(\d+)\.mlp\.w_(gate|up|down)\.weight", r"layers.\1.mlp.\2_proj.weight")], source)
    for i in range(config.num_hidden_layers):
        split_rows(table, f"layers.{i}.attn.qkv.weight", {f"layers.{i}.attn.{p}_proj.weight": (j * dim, (j + 1) * dim)
                                                          for j, p in enumerate("qkv")})
    return config, table


def germangpt(raw: dict, state: dict, source: str):
    """Seed 002: RMSNorm eps 1e-6, RoPE on interleaved pairs, GQA, tied embeddings when tie_embeddings."""
    if raw.get("norm", "rmsnorm") != "rmsnorm" or raw.get("mlp", "swiglu") != "swiglu":
        raise CheckpointError(f"{source}: only norm 'rmsnorm' and mlp 'swiglu' exist in GermanGPT")
    d_model, heads = int(need(raw, "d_model", source)), int(raw.get("n_heads", 16))
    tied = bool(raw.get("tie_embeddings", True))
    config = DenseConfig(
        vocab_size=int(need(raw, "vocab_size", source)), hidden_size=d_model, num_hidden_layers=int(raw.get("n_layers", 24)),
        num_attention_heads=heads, num_key_value_heads=int(raw.get("n_kv_heads", heads)), head_dim=d_model // heads,
        intermediate_size=int(raw.get("d_ff", 2816)), max_position_embeddings=int(raw.get("context_len", 2048)),
        rope_theta=float(raw.get("rope_theta", 10000.0)), rope_precision="float32", rope_layout="interleaved",
        norm_eps=1e-6, qk_norm="none", attn_output_gate=False, tie_word_embeddings=tied)
    table = rename(eager(state), [
        (r"token_embedding\.weight", "embed_tokens.weight"), (r"norm\.weight", "norm.weight"),
        (r"lm_head\.weight", None if tied else "lm_head.weight"),
        (r"blocks\.(\d+)\.(attn_norm)\.weight", r"layers.\1.\2.weight"), (r"blocks\.(\d+)\.ffn_norm\.weight", r"layers.\1.mlp_norm.weight"),
        (r"blocks\.(\d+)\.attn\.([qkvo]_proj)\.weight", r"layers.\1.attn.\2.weight"),
        (r"blocks\.(\d+)\.ffn\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight")], source)
    return config, table


def make_divisible(v: float, divisor: int, min_value: int | None = None) -> int:
    """OpenELM's rounding of a width to a multiple of divisor (never more than 10% below v)."""
    min_value = divisor if min_value is None else min_value
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def openelm_widths(raw: dict, source: str) -> tuple[list[int], list[int], list[int]]:
    """Per-layer query heads, key/value heads and FFN widths, derived exactly as seed 003's config does."""
    layers, model_dim = int(need(raw, "num_transformer_layers", source)), int(need(raw, "model_dim", source))
    head_dim, groups = int(need(raw, "head_dim", source)), int(raw.get("num_gqa_groups", 1))

    def multipliers(value, name):
        if isinstance(value, (int, float)):
            return [value] * layers
        if len(value) == 2:  # layer-wise scaling: linspace from first to last layer, rounded to 2 decimals
            return [round(float(v), 2) for v in np.linspace(value[0], value[1], num=layers, dtype=float)]
        if name == "ffn_multipliers" and len(value) == layers:
            return list(value)
        raise CheckpointError(f"{source}: {name} needs 1, 2 or (ffn only) {layers} entries, got {len(value)}")

    q_dims = [int(make_divisible(model_dim * m, head_dim * groups))
              for m in multipliers(raw.get("qkv_multipliers", 1.0), "qkv_multipliers")]
    q_heads = [q // head_dim for q in q_dims]
    kv_heads = [h // groups for h in q_heads]
    ffn = [int(make_divisible(m * model_dim, int(raw.get("ffn_dim_divisor", 256))))
           for m in multipliers(raw.get("ffn_multipliers", 4.0), "ffn_multipliers")]
    return q_heads, kv_heads, ffn


def openelm(folder: str, raw: dict, source: str):
    """Seed 003: per-layer widths, fused qkv [q heads, k heads, v heads], q/k RMSNorm with one shared [D] gain,
    proj_1 = [gate, up], eps 1e-6, shared input/output embedding."""
    if not raw.get("ffn_with_glu", True) or raw.get("activation_fn_name", "swish") not in ("swish", "silu"):
        raise CheckpointError(f"{source}: only the GLU feed-forward with swish activation is supported")
    if raw.get("normalization_layer_name", "rms_norm") != "rms_norm":
        raise CheckpointError(f"{source}: only normalization_layer_name 'rms_norm' is supported")
    q_heads, kv_heads, ffn = openelm_widths(raw, source)
    D, tied = int(raw["head_dim"]), bool(raw.get("share_input_output_layers", False))
    config = DenseConfig(
        vocab_size=int(need(raw, "vocab_size", source)), hidden_size=int(raw["model_dim"]),
        num_hidden_layers=len(q_heads), num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=D,
        intermediate_size=ffn, max_position_embeddings=int(raw.get("max_context_length", 2048)),
        rope_theta=float(raw.get("rope_freq_constant", 10000)), rope_precision="float32", norm_eps=1e-6,
        qk_norm="shared" if raw.get("normalize_qk_projections", False) else "none", attn_output_gate=False,
        tie_word_embeddings=tied)
    table = rename(hf_weights(folder), [
        (r"transformer\.token_embeddings\.weight", "embed_tokens.weight"), (r"transformer\.norm\.weight", "norm.weight"),
        (r"lm_head\.weight", None if tied else "lm_head.weight"),
        (r"transformer\.layers\.(\d+)\.(attn_norm)\.weight", r"layers.\1.\2.weight"),
        (r"transformer\.layers\.(\d+)\.ffn_norm\.weight", r"layers.\1.mlp_norm.weight"),
        (r"transformer\.layers\.(\d+)\.attn\.(q_norm|k_norm)\.weight", r"layers.\1.attn.\2.weight"),
        (r"transformer\.layers\.(\d+)\.attn\.qkv_proj\.weight", r"layers.\1.attn.qkv.weight"),
        (r"transformer\.layers\.(\d+)\.attn\.out_proj\.weight", r"layers.\1.attn.o_proj.weight"),
        (r"transformer\.layers\.(\d+)\.ffn\.proj_1\.weight", r"layers.\1.mlp.proj_1.weight"),
        (r"transformer\.layers\.(\d+)\.ffn\.proj_2\.weight", r"layers.\1.mlp.down_proj.weight")], source)
    for i, (h, kv, w) in enumerate(zip(q_heads, kv_heads, ffn)):
        a = f"layers.{i}.attn."
        split_rows(table, a + "qkv.weight", {a + "q_proj.weight": (0, h * D), a + "k_proj.weight": (h * D, (h + kv) * D),
                                             a + "v_proj.weight": ((h + kv) * D, (h + 2 * kv) * D)})
        m = f"layers.{i}.mlp."
        split_rows(table, m + "proj_1.weight", {m + "gate_proj.weight": (0, w), m + "up_proj.weight": (w, 2 * w)})
    return config, table


def neox_config(hidden: int, heads: int, layers: int, vocab: int, ffn: int, rotary_pct: float, base: float,
                context: int, eps: float, parallel: bool, tied: bool) -> DenseConfig:
    head_dim = hidden // heads
    return DenseConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, head_dim=head_dim,
        intermediate_size=ffn, max_position_embeddings=context, rope_theta=base, rope_precision="float32",
        rotary_dim=int(head_dim * rotary_pct), norm="layernorm", norm_eps=eps, qk_norm="none", attn_output_gate=False,
        mlp="gelu", bias=True, parallel_residual=parallel, tie_word_embeddings=tied)


def split_neox_qkv(table: dict, config: DenseConfig) -> None:
    """query_key_value rows are [head, (q, k, v), head_dim]: split them per head."""
    H, D = config.num_attention_heads, config.head_dim
    for i in range(config.num_hidden_layers):
        a = f"layers.{i}.attn."
        for kind in ("weight", "bias"):
            split_rows(table, a + f"qkv.{kind}", {a + f"{p}_proj.{kind}": j for j, p in enumerate("qkv")}, view=(H, 3, D))


NEOX_RULES = [
    (r"(?:gpt_neox\.)?embed_in\.weight", "embed_tokens.weight"), (r"embed_out\.weight", "lm_head.weight"),
    (r"(?:gpt_neox\.)?final_layer_norm\.(weight|bias)", r"norm.\1"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.input_layernorm\.(weight|bias)", r"layers.\1.attn_norm.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.post_attention_layernorm\.(weight|bias)", r"layers.\1.mlp_norm.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.attention\.query_key_value\.(weight|bias)", r"layers.\1.attn.qkv.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.attention\.dense\.(weight|bias)", r"layers.\1.attn.o_proj.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.mlp\.dense_h_to_4h\.(weight|bias)", r"layers.\1.mlp.up_proj.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.mlp\.dense_4h_to_h\.(weight|bias)", r"layers.\1.mlp.down_proj.\2")]


def gpt_neox(folder: str, raw: dict, source: str):
    """Seed 004, Hugging Face layout: LayerNorm with bias, per-head fused qkv, partial rotary, parallel residual,
    exact GELU."""
    if raw.get("hidden_act", "gelu") != "gelu":
        raise CheckpointError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only exact 'gelu')")
    rope = raw.get("rope_parameters") or {}
    rotary_pct = rope.get("partial_rotary_factor", raw.get("rotary_pct", raw.get("partial_rotary_factor", 0.25)))
    base = rope.get("rope_theta", raw.get("rotary_emb_base", raw.get("rope_theta", 10000)))
    tied = bool(raw.get("tie_word_embeddings", False))
    hidden = int(need(raw, "hidden_size", source))
    config = neox_config(hidden, int(need(raw, "num_attention_heads", source)),
                         int(need(raw, "num_hidden_layers", source)), int(need(raw, "vocab_size", source)),
                         int(raw.get("intermediate_size", 4 * hidden)), float(rotary_pct), float(base),
                         int(raw.get("max_position_embeddings", 2048)), float(raw.get("layer_norm_eps", 1e-5)),
                         bool(raw.get("use_parallel_residual", True)), tied)
    rules = [(p, None if tied and t == "lm_head.weight" else t) for p, t in NEOX_RULES]
    table = rename(hf_weights(folder), rules, source)
    split_neox_qkv(table, config)
    return config, table


def llama(folder: str, raw: dict, source: str):
    """Hugging Face Llama (SmolLM2, TinyLlama, Llama 2/3 layout): GQA, RMSNorm, rotate-half RoPE, rope_theta."""
    if raw.get("rope_scaling"):
        raise CheckpointError(f"{source}: rope_scaling {raw['rope_scaling']!r} is not supported")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise CheckpointError(f"{source}: attention_bias / mlp_bias are not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    hidden, heads = int(need(raw, "hidden_size", source)), int(need(raw, "num_attention_heads", source))
    tied = bool(raw.get("tie_word_embeddings", False))
    rope = raw.get("rope_parameters") or {}
    config = DenseConfig(
        vocab_size=int(need(raw, "vocab_size", source)), hidden_size=hidden,
        num_hidden_layers=int(need(raw, "num_hidden_layers", source)), num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads), head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(need(raw, "intermediate_size", source)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))), rope_precision="float32",
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)), qk_norm="none", attn_output_gate=False, tie_word_embeddings=tied)
    table = rename(hf_weights(folder), [
        (r"model\.embed_tokens\.weight", "embed_tokens.weight"), (r"model\.norm\.weight", "norm.weight"),
        (r"lm_head\.weight", None if tied else "lm_head.weight"),
        (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attn_norm.weight"),
        (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
        (r"model\.layers\.(\d+)\.self_attn\.([qkvo]_proj)\.weight", r"layers.\1.attn.\2.weight"),
        (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight")], source)
    return config, table


# -- GPT-NeoX original two-way tensor-parallel release ------------------------------------------------------------

NEOX_20B = dict(num_layers=44, hidden_size=6144, num_attention_heads=64, rotary_pct=0.25, rotary_emb_base=10000,
                max_position_embeddings=2048, layernorm_epsilon=1e-5, gpt_j_residual=True, no_weight_tying=True)


def neox_yaml(folder: str) -> dict:
    """The NeoX YAML config (configs/*.yml) with '-' in keys read as '_'; seed 004's 20B sizes when absent."""
    files = sorted(glob.glob(os.path.join(folder, "configs", "*.yml")) + glob.glob(os.path.join(folder, "*.yml")))
    values = dict(NEOX_20B)
    for path in files:
        import yaml

        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise CheckpointError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        values.update({k.replace("-", "_"): v for k, v in data.items()})
    return values


def neox_original(folder: str, rank: int | None = None):
    """Seed 004's merge: column-parallel weights/biases, the embedding and the readout concatenated on dim 0,
    row-parallel weights on dim 1, row-parallel biases summed, norms checked equal across the shards. Files are read
    a layer (two shards) at a time. rank 0 or 1 (two-way tensor parallel, tp.py): the blocks' tensors are that
    shard's own, unmerged (its row-parallel bias too: the ranks' all-reduce sums them as the merge would)."""
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
    config = neox_config(hidden, heads, layers, vocab, ffn, float(raw["rotary_pct"]), float(raw["rotary_emb_base"]),
                         int(raw.get("max_position_embeddings") or raw.get("seq_length") or 2048),
                         float(raw["layernorm_epsilon"]), bool(raw["gpt_j_residual"]), tied)
    table = {"embed_tokens.weight": merged(0, "word_embeddings.weight", "dim0")}
    parts = {"attn_norm": ("input_layernorm", "same", "same"), "mlp_norm": ("post_attention_layernorm", "same", "same"),
             "attn.qkv": ("attention.query_key_value", "dim0", "dim0"), "attn.o_proj": ("attention.dense", "dim1", "sum"),
             "mlp.up_proj": ("mlp.dense_h_to_4h", "dim0", "dim0"), "mlp.down_proj": ("mlp.dense_4h_to_h", "dim1", "sum")}
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


def read_torch_file(path: str, raw: dict | None) -> Checkpoint:
    """Sprout's ckpt.pt, GermanGPT's checkpoint.pt, or a plain state dict (.pt/.safetensors) with its config."""
    if path.endswith(".safetensors"):
        state = {n: f() for n, f in open_safetensors(path).items()}
    else:
        state = load_pickle(path)
    if raw is None:
        if not isinstance(state, dict) or not isinstance(state.get("config"), dict) or "model" not in state:
            raise CheckpointError(f"{path}: expected a dict with 'model' (state dict) and 'config'")
        raw, state = state["config"], state["model"]
    elif isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if "d_model" in raw:
        config, table = germangpt(raw, state, path)
    elif "dim" in raw:
        config, table = sprout(raw, state, path)
    else:
        raise CheckpointError(f"{path}: config has neither 'dim' (Sprout) nor 'd_model' (GermanGPT)")
    return Checkpoint(path, config, table)


# Hugging Face folders by config.json's model_type: (folder, raw config, config path) -> (DenseConfig, table)
HF_FAMILIES = {"openelm": openelm, "gpt_neox": gpt_neox, "llama": llama}
