"""dense.py: one config-driven dense decoder-only transformer, with a static memory for fast decoding: a KV cache, and
for the layers that keep one, a fixed-size state.

Read it top to bottom: config -> norms -> rotary -> attention and its cache (and the one place where a step's masks
and rotary rows are decided) -> the layers whose memory is a state -> MLP -> layer -> model. A prefill writes the
prompt's keys and values into the cache, then each decode step feeds one token at a fixed shape over a fixed number of
cache slots (`attend`): torch.compile makes it one graph, replayed for every token (runtime/generate.py; the sampler
is runtime/sampling.py).

Shapes: B batch, T tokens in this call, S cache length, A slots attended, H query heads, K key/value heads,
D head_dim, C hidden size, R rotary channels, V vocabulary. This file imports only torch: the package dense_engine
reads checkpoints into these names (formats/), quantizes the linears (cpu/quantized.py) and runs it (runtime/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DenseConfig", "DenseDecoder"]


# ----------------------------------------------------------------------------------------------------------------
# 1. Config. The defaults are a plain Llama-2-7B; each switch names the families that turn it.


@dataclass
class DenseConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int | list[int] = 11008  # FFN width; a list gives one width per layer (OpenELM)
    num_hidden_layers: int = 32
    num_attention_heads: int | list[int] = 32  # a list gives one count per layer (OpenELM)
    num_key_value_heads: int | list[int] | None = None  # grouped-query attention; None: as many as query heads
    head_dim: int = 128  # independent of hidden_size / heads (Gemma, Qwen3)
    max_position_embeddings: int = 4096
    # rotary position embeddings
    rope_theta: float = 10000.0
    rope_precision: str = "float32"  # "bfloat16": every step of the tables rounded (the native ShellElastic model)
    rope_layout: str = "half"  # "half": rotate pairs (i, i + D/2) | "interleaved": pairs (2i, 2i + 1) (GermanGPT)
    rotary_dim: int | None = None  # rotate only the first rotary_dim channels of each head (GPT-NeoX, Phi-3)
    rope_scaling: dict | None = None  # {"rope_type": ..., its keys}: longer contexts (Llama 3, Phi-3, yarn)
    rope_local_theta: float | None = None  # sliding-window layers rotate with this base, unscaled (Gemma 3)
    nope_layers: list[int] | None = None  # layers with no rotary embedding at all (SmolLM3)
    # attention
    attn_scale: float | None = None  # scores = q.k * attn_scale; None: 1/sqrt(head_dim) (Gemma 2/3, Granite)
    attn_softcap: float | None = None  # scores = cap * tanh(scores / cap) before the softmax (Gemma 2)
    sliding_window: int | None = None  # a token sees itself and the window - 1 tokens before it (Mistral, Gemma 2/3)
    layer_types: list[str] | None = None  # per layer "full_attention" | "sliding_attention"; None: every layer
    #                                       slides if a window is set (Mistral)
    qkv_bias: bool = False  # biases on the q, k and v projections only (Qwen2, StableLM)
    qk_norm: str = "none"  # "per_channel": per head, a gain per (head, channel) (ShellElastic, StableLM) |
    #                        "shared": per head, one [D] gain (OpenELM, Qwen3, Gemma 3) | "whole": all heads (OLMo 2)
    qk_norm_after_rope: bool = False  # the q/k norms after the rotary instead of before (Hunyuan)
    attn_output_gate: bool = False  # attention output *= sigmoid(x W_gate^T), x the attention input (ShellElastic,
    #                                 Qwen3.5)
    attn_head_gate: bool = False  # the same with one gate per head (LFM3)
    attn_sinks: bool = False  # a learned logit per head beside the keys' in each softmax: attention may go nowhere
    #                           (Granite SWA)
    global_head_dim: int | None = None  # the full-attention layers' head size, rotated whole (Gemma 4)
    value_norm: bool = False  # values RMS-normed per head, no gain (Gemma 4)
    keys_are_values: bool = False  # full-attention layers' values are their keys' projection, before its norm
    #                                (Gemma 4's attention_k_eq_v)
    kv_shared_layers: int = 0  # the last this many layers attend over the keys and values of the last earlier layer
    #                            of their kind, computing none (Gemma 4)
    # layers whose memory is a fixed-size state: layer_types "linear_attention" (Qwen3.5's Gated DeltaNet) | "conv"
    # (LFM2's short conv) | "mamba" (Mamba2: Granite 4.0 H) | "hybrid" (attention and Mamba2 side by side: Falcon-H1)
    linear_heads: tuple[int, int] = (16, 32)  # a Gated DeltaNet layer's (key, value) heads
    linear_head_dims: tuple[int, int] = (128, 128)  # its (key, value) channels per head
    linear_tiled_values: bool = False  # value head j reads key head j % key_heads (llama.cpp's qwen35 files);
    #                                    False: j // (value_heads / key_heads) (transformers)
    linear_beta_scale: float = 1.0  # beta = scale * sigmoid(b); 2 lets the delta rule's eigenvalues go negative
    #                                 (OLMo hybrid)
    linear_norm_eps: float | None = None  # its output norm's eps (None: norm_eps; OLMo hybrid: 1e-5)
    conv_kernel: int = 4  # the causal depthwise conv's width (Qwen3.5's linear_conv_kernel_dim, LFM2's conv_L_cache)
    mamba_heads: tuple[int, int, int, int] = (0, 64, 1, 128)  # a Mamba2 layer's (heads, channels per head, groups
    #                                                            of B and C, state size N)
    mamba_biases: tuple[bool, bool] = (False, True)  # biases on its projections, on its conv
    mamba_norm: bool = True  # its gated RMSNorm before out_proj; False: y * silu(z) goes straight in (Falcon-H1)
    time_step_limit: tuple[float, float] = (0.0, math.inf)  # its dt clamped to this range (prompts' chunked form)
    # the block
    norm: str = "rmsnorm"  # "layernorm" (with bias: GPT-NeoX, StableLM)
    norm_eps: float = 1e-5
    norm_gain_in_float32: bool = False  # RMSNorm's gain applied in float32, then cast (Sprout, OLMo 2); False: cast
    #                                     to the compute dtype first, then the gain (Llama)
    norm_unit_offset: bool = False  # RMSNorm's gain is 1 + weight (Gemma stores offsets from 1)
    mlp: str = "swiglu"  # down(silu(gate(x)) * up(x)) | "geglu": tanh-GELU instead of silu (Gemma) |
    #                      "gelu": down(gelu(up(x))), exact GELU (GPT-NeoX) | "xielu", "relu2": down(act(up(x))) with
    #                      Apertus' xIELU or Nemotron-H's squared ReLU
    bias: bool = False  # biases on every linear of the blocks (GPT-NeoX)
    parallel_residual: bool = False  # x + attn(n1(x)) + mlp(n2(x)) (GPT-NeoX, StableLM 2)
    pre_norms: bool | list[bool] = True  # norm each branch's input (every family but OLMo 2); a list: per layer
    post_norms: bool | list[bool] = False  # norm each branch's output before the residual add (Gemma 2/3, OLMo 2;
    #                                        OLMo hybrid: its attention layers only)
    residual_scale: float = 1.0  # each branch's output times this before the residual add (Granite)
    # embeddings and head
    tie_word_embeddings: bool = False
    embed_scale: float | None = None  # embeddings times this, rounded to the model's dtype (Gemma: sqrt(C), Granite)
    logits_divisor: float = 1.0  # logits / this (Granite)
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)
    output_vocab_size: int | None = None  # a head of the first ids only (Apertus 1.5): the others never come out
    per_layer_input: int = 0  # each layer adds a gated input of this width, from its own embedding table and the
    #                           token's embedding (Gemma 4's per-layer embeddings); 0: none
    layer_scalars: bool = False  # each layer's output times a learned scalar (Gemma 4)

    def per_layer(self, value) -> list[int]:
        return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * self.num_hidden_layers

    def heads(self, layer: int) -> int:
        return self.per_layer(self.num_attention_heads)[layer]

    def kv_heads(self, layer: int) -> int:
        kv = self.num_key_value_heads if self.num_key_value_heads is not None else self.num_attention_heads
        return self.per_layer(kv)[layer]

    def ffn_width(self, layer: int) -> int:
        return self.per_layer(self.intermediate_size)[layer]

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer's attention, or None (it sees every earlier token)."""
        sliding = self.layer_types is None or self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def mixer(self, layer: int) -> str:
        """What mixes a layer's tokens: "attention", "delta" (Gated DeltaNet), "conv" (LFM2's short conv), "mamba" or
        "hybrid" (attention and Mamba2, summed)."""
        kind = self.layer_types[layer] if self.layer_types else None
        kinds = {"linear_attention": "delta", "conv": "conv", "mamba": "mamba", "hybrid": "hybrid"}
        return kinds.get(kind, "attention")

    def attention_kind(self, layer: int) -> str:
        return "full" if self.window(layer) is None else "sliding"

    def head_size(self, layer: int) -> int:
        return self.global_head_dim if self.global_head_dim and self.window(layer) is None else self.head_dim

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values this one reads instead of its own (kv_shared_layers), or None."""
        first = self.num_hidden_layers - self.kv_shared_layers
        if layer < first:
            return None
        return max(i for i in range(first) if self.attention_kind(i) == self.attention_kind(layer))

    def rope_kind(self, layer: int) -> str | None:
        """Which rotary tables a layer uses: "base", "local" (sliding layers with their own base), or None."""
        if self.nope_layers and layer in self.nope_layers:
            return None
        return "local" if self.rope_local_theta is not None and self.window(layer) else "base"

    def rope_dim(self, local: bool = False) -> int:
        """The rotated channels of a head: the local (sliding) kind's, or the base kind's."""
        if self.global_head_dim and not local:
            return self.global_head_dim
        return self.head_dim if self.rotary_dim is None else self.rotary_dim


# ----------------------------------------------------------------------------------------------------------------
# 2. Norms and rotary embeddings


class RMSNorm(nn.Module):
    """x / rms(x) * gain, statistics in float32 over the last `dims` dims (2: all heads at once), cast back to x's dtype
    before the gain (Llama) or after it (gain_in_float32: torch.nn.RMSNorm). unit_offset: the gain is 1 + weight, in
    float32 (Gemma). gain_shape lets a flat gain [H * D] act on per-head input [..., H, D]."""

    def __init__(self, dim: int, eps: float, gain_shape: tuple[int, ...] | None = None,
                 gain_in_float32: bool = False, unit_offset: bool = False, dims: int = 1, gain: bool = True) -> None:
        super().__init__()
        self.eps, self.gain_in_float32, self.unit_offset = eps, gain_in_float32 or unit_offset, unit_offset
        self.gain_shape, self.dims = gain_shape or (dim,), tuple(range(-dims, 0))
        self.weight = nn.Parameter(torch.ones(dim)) if gain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(self.dims, keepdim=True) + self.eps)
        if self.weight is None:  # (Gemma 4's values: normed, no gain)
            return h.to(x.dtype)
        gain = self.weight.view(self.gain_shape)
        if self.unit_offset:
            gain = 1.0 + gain.float()
        return (h * gain).to(x.dtype) if self.gain_in_float32 else h.to(x.dtype) * gain


class LayerNorm(nn.Module):
    """(x - mean) / std * gain + bias over the last dim (or `dims` dims); gain_shape as in RMSNorm (StableLM's
    per-head q/k norms: a gain per head, no bias)."""

    def __init__(self, dim: int, eps: float, gain_shape: tuple[int, ...] | None = None, bias: bool = True,
                 dims: int = 1) -> None:
        super().__init__()
        self.eps, self.gain_shape, self.dims = eps, gain_shape or (dim,), dims
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gain_shape == (x.shape[-1],):  # one fused kernel, as nn.LayerNorm
            return F.layer_norm(x, self.gain_shape, self.weight, self.bias, self.eps)
        return F.layer_norm(x, x.shape[-self.dims:], eps=self.eps) * self.weight.view(self.gain_shape)


def make_norm(config: DenseConfig, dim: int, gain_shape: tuple[int, ...] | None = None, bias: bool = True,
              dims: int = 1) -> nn.Module:
    if config.norm == "layernorm":
        return LayerNorm(dim, config.norm_eps, gain_shape, bias, dims)
    return RMSNorm(dim, config.norm_eps, gain_shape, config.norm_gain_in_float32, config.norm_unit_offset, dims)


def qk_norm(config: DenseConfig, heads: int, D: int) -> nn.Module:
    """The norm of queries or keys [B, T, heads, D] before rotary (Identity when the family has none)."""
    if config.qk_norm == "per_channel":  # within each head, a gain per (head, channel)
        return make_norm(config, heads * D, (heads, D), bias=False)
    if config.qk_norm == "shared":  # within each head, one [D] gain for all heads
        return make_norm(config, D, bias=False)
    if config.qk_norm == "whole":  # over all heads' channels together (OLMo 2)
        return make_norm(config, heads * D, (heads, D), bias=False, dims=2)
    return nn.Identity()


# The families' rope scalings (llama3, longrope, yarn, a GGUF's factors), computed as transformers computes them:
# (config, rope_scaling, powers [R/2] = base^(2i/R), the original context, seq_len) -> (frequencies [R/2], the factor
# that scales cos and sin). dense_engine/formats/rope_scalings.py adds them to this table when a checkpoint is read.
ROPE_SCALINGS: dict = {}


def rope_frequencies(config: DenseConfig, seq_len: int, local: bool = False) -> tuple[torch.Tensor, float]:
    """The rotary frequencies [R/2] (float32) of a sequence of up to seq_len tokens, and the factor that scales
    cos and sin (1 unless yarn or longrope says otherwise). local: the sliding-window layers' tables (their own base,
    unscaled)."""
    base, R = config.rope_local_theta if local else config.rope_theta, config.rope_dim(local)
    powers = base ** (torch.arange(0, R, 2, dtype=torch.int64).float() / R)  # [R/2]
    scaling = (None if local else config.rope_scaling) or {"rope_type": "plain"}
    kind, original = scaling["rope_type"], scaling.get("original_max_position_embeddings")
    # (dynamic: NTK-aware scaling raises the base only past the model's context, which no cache reaches)
    if kind in ("plain", "dynamic", "linear"):
        return 1.0 / powers / (scaling["factor"] if kind == "linear" else 1.0), 1.0
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling {kind!r}: import dense_engine.formats.rope_scalings first")
    return ROPE_SCALINGS[kind](config, scaling, powers, original or config.max_position_embeddings, seq_len)


def rope_tables(config: DenseConfig, positions: torch.Tensor, seq_len: int | None = None,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [P, R] float32 for float positions [P], laid out to match config.rope_layout, for a sequence (or
    cache) of seq_len slots (default P). Each row depends only on its position, so a table for positions 0..P-1
    equals these rows computed one at a time."""
    inv_freq, attention_factor = rope_frequencies(config, len(positions) if seq_len is None else seq_len, local)
    inv_freq = inv_freq.to(positions.device)
    # bfloat16: every step rounded (a product of two bfloat16 numbers is exact in float32: rounding it once gives the
    # bfloat16 product)
    rounded = (lambda t: t.to(torch.bfloat16).float()) if config.rope_precision == "bfloat16" else (lambda t: t)
    angles = rounded(torch.outer(rounded(positions), rounded(inv_freq)))  # [P, R/2]
    # cos and sin of each angle once (attention_factor != 1: yarn, longrope), then laid out as the channels pair up
    tables = [rounded(angles.cos() * attention_factor), rounded(angles.sin() * attention_factor)]
    if config.rope_layout == "half":  # channel i and i + R/2 share an angle
        return tuple(torch.cat((t, t), dim=-1) for t in tables)
    return tuple(t.repeat_interleave(2, dim=-1) for t in tables)  # channels 2i and 2i + 1 share an angle


class Rotary(nn.Module):
    """The rotary tables of one kind ("base", or Gemma 3's "local"), for every slot of the cache: [S + 1, R] float32
    cos and sin; a step looks up its positions' rows."""

    def __init__(self, config: DenseConfig, slots: torch.Tensor, seq_len: int, local: bool) -> None:
        super().__init__()
        cos, sin = rope_tables(config, slots.float(), seq_len, local)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """x: [B, T, heads, D]; cos, sin: [T, R] (or [B, T, R]: a position per row) in x's dtype, R <= D. Rotates the
    first R channels of each head."""
    rot, keep = x[..., : cos.shape[-1]], x[..., cos.shape[-1]:]
    if layout == "half":  # (a, b) -> (-b, a) over the two halves
        a, b = rot.chunk(2, dim=-1)
        turned = torch.cat((-b, a), dim=-1)
    else:  # (even, odd) -> (-odd, even) within each pair
        turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    rot = rot * cos + turned * sin
    return torch.cat((rot, keep), dim=-1) if keep.shape[-1] else rot


# ----------------------------------------------------------------------------------------------------------------
# 3. Attention and the KV cache


@dataclass
class View:
    """What the layers of one attention kind ("full" or "sliding") see in a step. own_keys: only the step's own keys
    and values (a plain pass, a prefill from slot 0), causal (mask None: SDPA's causal kernel) or through mask [T, T].
    Else the cache: slots 0..attend-1 through mask [T, A] or [B, 1, T, A], or only the W slots `slots` [B or 1, W] (a
    sliding layer's decode step) through mask [B or 1, 1, 1, W]. A mask is added to the scores (0: seen, -inf: not),
    made once a step for every layer (a bool mask would be turned into one in each layer's attention call)."""
    own_keys: bool
    mask: torch.Tensor | None
    attend: int
    window: int | None = None
    slots: torch.Tensor | None = None


@dataclass
class Step:
    """What a forward call tells its layers, decided once (make_step): the slots its keys and values go to (input_pos
    [T] or [B, T]; None: a plain pass), its cache rows (rows [B]; None: 0..B-1), where left-padded rows begin
    (row_start [B]), a View per attention kind and the (cos, sin) rows [T, R] or [B, T, R] per rotary kind."""
    input_pos: torch.Tensor | None
    rows: torch.Tensor | None
    row_start: torch.Tensor | None
    views: dict[str, View]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
    per_layer: torch.Tensor | None = None  # [B, T, L, P]: each layer's input (per_layer_input)
    shared: dict = field(default_factory=dict)  # attention kind -> this call's (k, v) of the layer others read


def make_step(model: DenseDecoder, T: int, input_pos: torch.Tensor | None = None, attend: int | None = None,
              row_start: torch.Tensor | None = None, rows: torch.Tensor | None = None, causal: bool = False) -> Step:
    """What every layer of a call of T tokens sees, decided once. Without input_pos: a plain causal pass over its own
    keys (no cache written). With input_pos [T] (or [B, T]): a cached step that writes at those slots and attends over
    slots 0..attend-1, each token up to its own slot (row_start [B]: left-padded rows, whose earlier slots are never
    seen). causal: input_pos is 0..T-1 of every row and the cache holds nothing else: the call's own keys, causal."""
    config, device = model.config, model.device
    window, sliding, own_keys = config.sliding_window, "sliding" in model.attention_kinds, input_pos is None or causal
    own = torch.arange(T, device=device) if own_keys else None  # positions 0..T-1 of the call's own tokens
    if input_pos is None:  # plain pass: rotary rows for positions 0..T-1 of a T-token sequence
        rope = {kind: rope_tables(config, own.float(), T, kind == "local") for kind in model.rope_kinds}
    else:  # cached: the rows of the cache's tables at each token's position
        positions = input_pos if row_start is None else (input_pos[None, :] - row_start[:, None]).clamp(min=0)
        rope = {kind: (model.rotary[kind].cos[positions], model.rotary[kind].sin[positions])
                for kind in model.rope_kinds}
    if own_keys:  # the call's own keys, causal (a sliding layer: itself and the window - 1 tokens before it)
        views = {"full": View(own_keys=True, mask=None, attend=T)}
        if sliding:
            in_window = (own <= own[:, None]) & (own > own[:, None] - window)  # [T, T]
            views["sliding"] = View(own_keys=True, mask=additive(in_window, model.dtype), attend=T, window=window)
        return Step(input_pos, rows, row_start, views, rope)
    slots = model.kv_slots[:attend]
    pos = input_pos[..., None] if input_pos.ndim == 1 else input_pos[:, None, :, None]  # [T, 1] or [B, 1, T, 1]
    mask = slots <= pos  # [T, A] or [B, 1, T, A]: a token at slot p sees the keys at slots 0..p
    if row_start is not None:  # [B, 1, T, A]: padding is never seen, but a padding token sees itself (no empty row)
        mask = (mask & (slots >= row_start[:, None, None, None])) | (slots == pos)
    views = {"full": View(own_keys=False, mask=additive(mask, model.dtype), attend=attend)}
    if sliding and T == 1 and window < attend:  # decode: a sliding layer reads only its window's W slots
        first = input_pos.reshape(-1, 1) - (window - 1)  # [B or 1, 1]
        wanted = first + torch.arange(window, device=device)  # [B or 1, W], < 0 before the first token
        seen = wanted >= (0 if row_start is None else row_start[:, None])
        views["sliding"] = View(own_keys=False, mask=additive(seen[:, None, None, :], model.dtype), attend=attend,
                                window=window, slots=wanted.clamp(min=0))
    elif sliding:
        views["sliding"] = View(own_keys=False, mask=additive(mask & (slots > pos - window), model.dtype),
                                attend=attend, window=window)
    return Step(input_pos, rows, row_start, views, rope)


def additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: seen) as what is added to the scores: 0 where seen, -inf where not."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, -math.inf)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for q [B, H, T, D] over k, v [B, K, A, D]; mask [T, A] or [B, 1, T, A] (0:
    seen, -inf: not), None: causal with A == T. Grouped-query heads share K/V without copies. sinks [H]: one more logit
    per head in the softmax, with no value (what the sink takes goes nowhere)."""
    B, H, T, D = q.shape
    K, A = k.shape[1], k.shape[2]
    if mask is None and softcap is None and sinks is None:  # a causal pass: SDPA's flash kernels take grouped heads
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=K != H)
    if mask is None:
        mask = additive(torch.ones(T, A, dtype=torch.bool, device=q.device).tril(), q.dtype)
    # With a mask, SDPA's grouped-query support falls back to a path that copies K/V per head. Instead, the G query
    # heads of each K/V head become G * T query rows of that head (head h reads K/V head h // G): equal head counts,
    # the mask repeated per group, [B, K, G*T, D] against [B, K, A, D].
    G = H // K
    q = q.reshape(B, K, G * T, D)
    mask = mask.unsqueeze(-3).expand(*mask.shape[:-2], G, T, A).reshape(*mask.shape[:-2], G * T, A)
    if softcap is None and sinks is None:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:  # SDPA cannot soft-cap its scores (Gemma 2) or take a sink: written out, softmax in float32
        scores = (q @ k.transpose(-1, -2)) * scale
        scores = scores if softcap is None else torch.tanh(scores / softcap) * softcap
        scores = scores + mask
        if sinks is not None:  # query head k * G + g's sink beside its row's scores, dropped after the softmax
            sink = sinks.float().view(K, G, 1, 1).expand(K, G, T, 1).reshape(K, G * T, 1).to(scores.dtype)
            scores = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
        probs = scores.softmax(dim=-1, dtype=torch.float32)
        y = (probs if sinks is None else probs[..., :-1]).to(q.dtype) @ v
    return y.reshape(B, H, T, D)


def row_slots(step: Step, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache row, slot) of every token of a step, [B, T] each."""
    rows = step.rows if step.rows is not None else torch.arange(B, device=step.input_pos.device)
    return rows[:, None].expand(B, T), step.input_pos.expand(B, T)


def cache_rows(cache: torch.Tensor, step: Step, B: int) -> torch.Tensor:
    """The step's B rows of cache [max batch, ...]: rows 0..B-1, or step.rows [B]."""
    return cache[:B] if step.rows is None else cache.index_select(0, step.rows)


class NoCache(nn.Module):
    """A layer's memory before setup_cache: a plain pass attends over its own keys and values (a state layer starts
    from an empty state) and keeps nothing."""

    def attend(self, q, k, v, step: Step, view: View, scale: float, softcap: float | None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return attention(q, k, v, view.mask, scale, softcap, sinks)


class KVCache(NoCache):
    """Static cache: keys and values of every position so far, preallocated once: [B, K, S + 1, D] each. The last slot
    is scratch: tokens that are only padding (a chunk's tail, an idle row of a server's batch) write there, and nothing
    reads it. (runtime/caches.py holds its variants: int8, and a CPU layout whose kernel reads only the slots used.)"""

    def __init__(self, batch: int, kv_heads: int, seq_len: int, head_dim: int, dtype, device) -> None:
        super().__init__()
        shape = (batch, kv_heads, seq_len + 1, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def attend(self, q, k, v, step: Step, view: View, scale: float, softcap: float | None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write this step's k, v [B, K, T, D] (a plain pass writes nothing); attend q [B, H, T, D] over what the view
        shows -> [B, H, T, D]."""
        if step.input_pos is not None:
            self.write(step, k, v)
        if view.own_keys:
            return attention(q, k, v, view.mask, scale, softcap, sinks)
        keys, values = self.read(step, view, q.shape[0])
        return attention(q, keys.to(q.dtype), values.to(q.dtype), view.mask, scale, softcap, sinks)

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, K, T, D] into the step's slots, in place."""
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        if step.input_pos.ndim == 1 and step.rows is None:  # every row writes the same slots
            self.k[: k.shape[0]].index_copy_(2, step.input_pos, k)
            self.v[: v.shape[0]].index_copy_(2, step.input_pos, v)
            return
        rows, pos = row_slots(step, k.shape[0], k.shape[2])  # [B, T] each
        self.k[rows, :, pos] = k.transpose(1, 2)  # [B, T, K, D] by (row, slot)
        self.v[rows, :, pos] = v.transpose(1, 2)

    def read(self, step: Step, view: View, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the view shows the step's B rows: slots 0..attend-1, [B, K, A, D] each; a sliding
        layer's decode step only the W slots of its window, view.slots [B or 1, W] -> [B, K, W, D] each."""
        if view.slots is not None:
            index = view.slots[:, None, :, None].expand(B, self.k.shape[1], -1, self.k.shape[3])  # [B, K, W, D]
            return cache_rows(self.k, step, B).gather(2, index), cache_rows(self.v, step, B).gather(2, index)
        keys, values = self.k[:, :, :view.attend], self.v[:, :, :view.attend]  # [max batch, K, A, D]
        return cache_rows(keys, step, B), cache_rows(values, step, B)  # [B, K, A, D]


class Attention(nn.Module):
    """Queries, keys, values (and the output gate) come from one fused projection: their weights are stacked by rows,
    so a step reads the input once and makes one matmul (checkpoints store the parts; loading stacks them)."""

    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.heads(layer), config.kv_heads(layer), \
            config.head_size(layer)
        self.kind, self.rope_kind, self.rope_layout = config.attention_kind(layer), config.rope_kind(layer), \
            config.rope_layout
        self.scale, self.softcap = config.attn_scale or self.head_dim**-0.5, config.attn_softcap
        q_width, kv_width, C = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, config.hidden_size
        # reads: another layer's keys and values (kv_shared_layers); keys_are_values: v is k's projection
        self.reads, self.keys_are_values = config.kv_source(layer), config.keys_are_values and self.kind == "full"
        self.shares = config.kv_shared_layers > 0 and self.reads is None  # (its k, v may be read by a later layer)
        self.parts = {"q_proj": q_width}  # checkpoint name: rows
        if self.reads is None:
            self.parts.update({"k_proj": kv_width} if self.keys_are_values else
                              {"k_proj": kv_width, "v_proj": kv_width})
        if config.attn_output_gate or config.attn_head_gate:  # a gate per channel, or one per head (LFM3)
            self.parts["gate_proj"] = q_width if config.attn_output_gate else self.n_heads
        self.qkv_proj = nn.Linear(C, sum(self.parts.values()), bias=config.bias or config.qkv_bias)
        self.o_proj = nn.Linear(q_width, C, bias=config.bias)
        D, own_keys = self.head_dim, self.reads is None
        self.q_norm = qk_norm(config, self.n_heads, D)
        self.k_norm = qk_norm(config, self.n_kv_heads, D) if own_keys else nn.Identity()
        self.v_norm = RMSNorm(D, config.norm_eps, gain=False) if config.value_norm and own_keys else nn.Identity()
        self.norm_after_rope = config.qk_norm_after_rope
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if config.attn_sinks else None
        self.memory: nn.Module = NoCache()

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        B, T, _ = x.shape
        parts = dict(zip(self.parts, self.qkv_proj(x).split(list(self.parts.values()), dim=-1)))
        q = self.placed(self.q_norm, parts["q_proj"].view(B, T, self.n_heads, self.head_dim), step).transpose(1, 2)
        if self.reads is None:  # [B, heads, T, D] each
            k = parts["k_proj"].view(B, T, self.n_kv_heads, self.head_dim)
            v = self.v_norm(k if self.keys_are_values else parts["v_proj"].view(B, T, self.n_kv_heads, self.head_dim))
            k, v = self.placed(self.k_norm, k, step).transpose(1, 2), v.transpose(1, 2)
            if self.shares:
                step.shared[self.kind] = (k, v)
        else:  # the keys and values of the layer it reads (its memory is that layer's: written again, the same)
            k, v = step.shared[self.kind]
        y = self.memory.attend(q, k, v, step, step.views[self.kind], self.scale, self.softcap, self.sinks)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        if "gate_proj" in parts:  # (ShellElastic's and Qwen3.5's output gate; LFM3's, a head each)
            gate = torch.sigmoid(parts["gate_proj"])  # [B, T, H * D] or [B, T, H]
            y = y * gate if gate.shape[-1] == y.shape[-1] else (y.view(B, T, self.n_heads, -1) * gate[..., None]).view(
                B, T, -1)
        return self.o_proj(y)

    def placed(self, norm: nn.Module, x: torch.Tensor, step: Step) -> torch.Tensor:
        """Queries or keys [B, T, heads, D] normed, then rotated to their positions (Hunyuan: the other way round)."""
        x = x if self.norm_after_rope else norm(x)
        if self.rope_kind is not None:
            cos, sin = step.rope[self.rope_kind]
            x = apply_rotary(x, cos, sin, self.rope_layout)
        return norm(x) if self.norm_after_rope else x


# ----------------------------------------------------------------------------------------------------------------
# 4. Layers whose memory is a state: Gated DeltaNet (Qwen3.5), the short conv (LFM2) and Mamba2 (Granite 4.0 H). An
# attention layer's memory grows by a key and a value a token; these keep a fixed-size state instead: the last W - 1
# inputs of a causal depthwise conv and (Gated DeltaNet, Mamba2) a matrix per head that every token rewrites. A
# decode step reads and writes the same shapes at every position: one fixed-shape graph, however long the conversation.


class State(nn.Module):
    """A state layer's memory per cache row: window [B, channels, W - 1] (the conv's last inputs, in the model's
    dtype) and recurrent [B, heads, Dk, Dv] float32 (Gated DeltaNet's matrices; None for a short conv). A row whose step
    starts at position 0 starts empty; padding (at the scratch slot S: a chunk's tail, an idle row; or before a
    left-padded row's start) changes nothing."""

    def __init__(self, batch: int, seq_len: int, channels: int, width: int, heads_shape: tuple | None, dtype,
                 device) -> None:
        super().__init__()
        self.scratch = seq_len
        self.register_buffer("window", torch.zeros(batch, channels, width - 1, dtype=dtype, device=device),
                             persistent=False)
        recurrent = torch.zeros(batch, *heads_shape, device=device) if heads_shape else None
        self.register_buffer("recurrent", recurrent, persistent=False)

    def read(self, step: Step, B: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The step's B rows of (window, recurrent), and keep [B, T] (False: padding)."""
        # a row whose step starts at position 0 begins a new sequence: its state is zeroed (a multiply, not a branch:
        # the same graph for every step)
        continuing = (step.input_pos[..., :1] != 0).reshape(-1, 1, 1)  # [B or 1, 1, 1]
        window = cache_rows(self.window, step, B) * continuing
        recurrent = None if self.recurrent is None else cache_rows(self.recurrent, step, B) * continuing[..., None]
        keep = (step.input_pos != self.scratch).expand(B, -1)
        if step.row_start is not None:
            keep = keep & (step.input_pos >= step.row_start[:, None])
        return window, recurrent, keep

    def write(self, step: Step, window: torch.Tensor, recurrent: torch.Tensor | None) -> None:
        for buffer, new in ((self.window, window), (self.recurrent, recurrent)):
            if new is not None and step.rows is None:
                buffer[: new.shape[0]].copy_(new)
            elif new is not None:
                buffer.index_copy_(0, step.rows, new.to(buffer.dtype))


def causal_conv(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None,
                keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of x [B, T, Ch] with weight [Ch, 1, W], continuing after window [B, Ch, W - 1] (the
    earlier inputs; None: zeros) -> (out [B, T, Ch], the new window: the last W - 1 inputs up to the last kept
    token). Padding (keep [B, T] False) lies at a step's end or before a left-padded row's start, never between its
    tokens; it enters as zeros, so a left-padded row starts as a new sequence does."""
    B, T, Ch = x.shape
    width = weight.shape[-1] - 1
    window = x.new_zeros(B, Ch, width) if window is None else window.to(x.dtype)
    if keep is not None:
        x = x * keep[..., None]
    inputs = torch.cat((window, x.transpose(1, 2)), dim=-1)  # [B, Ch, W - 1 + T]
    weight = weight.to(x.dtype)
    # tap j of every channel times the inputs j steps later (a depthwise conv1d, written out: a one-token step is a
    # few multiply-adds a channel, which a convolution library's setup would outweigh)
    out = sum(inputs[..., j:j + T] * weight[:, :, j] for j in range(width + 1)).transpose(1, 2)
    if keep is None:
        return out, inputs[..., T:]
    ends = (keep * torch.arange(1, T + 1, device=x.device)).amax(-1)  # [B]: 1 + the last kept token (0: none)
    last = ends[:, None, None] + torch.arange(width, device=x.device)  # [B, 1, W - 1]
    return out, inputs.gather(2, last.expand(B, Ch, width))


def delta_step(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule for one token, as it is defined: q, k [B, H, 1, Dk], v [B, H, 1, Dv], g (log decay <= 0)
    and beta [B, H, 1], state [B, H, Dk, Dv] float32. The state decays, then its read-out for k moves toward v by
    beta (the delta rule: only the error is written), then q reads it: -> (out [B, H, 1, Dv], new state)."""
    state = state * g.exp()[..., None]  # [B, H, Dk, Dv] * [B, H, 1, 1]
    error = v[:, :, 0] - (k[:, :, 0, :, None] * state).sum(-2)  # [B, H, Dv]: v minus what the state recalls for k
    state = state + k[:, :, 0, :, None] * (beta * error)[:, :, None, :]  # beta [B, H, 1]
    return (q[:, :, 0, :, None] * state).sum(-2)[:, :, None], state


def delta_chunks(q, k, v, g, beta, state, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule over T tokens, a chunk of `size` at a time (shapes as delta_step's with T tokens). Why it equals
    T delta_steps: within a chunk, with d_i = exp(g_1 + ... + g_i), the writes u_i = beta_i (v_i - k_i^T S_{i-1})
    solve the unit lower-triangular system u_i + beta_i sum_{j<i} (d_i / d_j) (k_i . k_j) u_j = beta_i (v_i - d_i k_i^T
    S_0); then o_i = d_i q_i^T S_0 + sum_{j<=i} (d_i / d_j) (q_i . k_j) u_j and S_C = d_C S_0 + sum_j (d_C / d_j) k_j
    u_j^T: the same sums, grouped into matmuls (they differ only in rounding)."""
    _, _, T, _ = k.shape  # [B, H, T, Dk]
    pad = -T % size  # padded tokens: g 0 (no decay), beta 0 (no write): the state passes through
    q, k, v = (F.pad(t, (0, 0, 0, pad)).unflatten(2, (-1, size)) for t in (q, k, v))  # [B, H, N, size, D]
    g, beta = (F.pad(t, (0, pad)).unflatten(2, (-1, size)) for t in (g, beta))  # [B, H, N, size]
    logd = g.cumsum(-1)  # log d_i within each chunk
    later = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    ratio = (logd[..., :, None] - logd[..., None, :]).masked_fill(later, -math.inf).exp()  # d_i / d_j, j <= i
    system = beta[..., None] * (k @ k.transpose(-1, -2)) * ratio  # (its diagonal is read as 1)
    scores = (q @ k.transpose(-1, -2)) * ratio
    outs = []
    for c in range(q.shape[2]):
        d = logd[:, :, c, :, None].exp()  # [B, H, size, 1]
        target = beta[:, :, c, :, None] * (v[:, :, c] - d * (k[:, :, c] @ state))
        u = torch.linalg.solve_triangular(system[:, :, c], target, upper=False, unitriangular=True)
        outs.append(d * (q[:, :, c] @ state) + scores[:, :, c] @ u)
        to_end = (logd[:, :, c, -1:] - logd[:, :, c]).exp()[..., None]  # d_C / d_j  [B, H, size, 1]
        state = d[:, :, -1:] * state + (k[:, :, c] * to_end).transpose(-1, -2) @ u
    return torch.cat(outs, dim=2)[:, :, :T], state


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention. One fused projection gives q, k, v (then a causal conv and silu), z (the output
    gate), and per value head b and a: a write strength beta = sigmoid(b) and a decay g = -exp(A_log) *
    softplus(a + dt_bias). q and k are L2-normalized; the delta rule runs on a [Dk, Dv] matrix per value head (a key
    head serves value_heads / key_heads of them); the output goes through an RMSNorm per head gated by silu(z)."""

    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        (self.k_heads, self.v_heads), (self.k_dim, self.v_dim) = config.linear_heads, config.linear_head_dims
        self.tiled = config.linear_tiled_values
        keys, values = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.parts = {"in_proj_qkv": 2 * keys + values, "in_proj_z": values, "in_proj_b": self.v_heads,
                      "in_proj_a": self.v_heads}
        self.in_proj = nn.Linear(config.hidden_size, sum(self.parts.values()), bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(2 * keys + values, 1, config.conv_kernel))
        self.dt_bias, self.A_log = nn.Parameter(torch.ones(self.v_heads)), nn.Parameter(torch.zeros(self.v_heads))
        self.norm = RMSNorm(self.v_dim, config.linear_norm_eps or config.norm_eps)
        self.beta_scale = config.linear_beta_scale
        self.out_proj = nn.Linear(values, config.hidden_size, bias=False)
        self.memory: nn.Module = NoCache()

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        B, T, _ = x.shape
        qkv, z, b, a = self.in_proj(x).split(list(self.parts.values()), dim=-1)
        window, state, keep = self.memory.read(step, B) if step.input_pos is not None else (None, None, None)
        qkv, window = causal_conv(qkv, self.conv_weight, window, keep)
        q, k, v = F.silu(qkv).float().split([self.k_heads * self.k_dim] * 2 + [self.v_heads * self.v_dim], dim=-1)
        beta = torch.sigmoid(b).float()  # [B, T, Hv]
        beta = beta if self.beta_scale == 1.0 else beta * self.beta_scale
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if keep is not None:
            beta, g = beta * keep[..., None], g * keep[..., None]

        def heads(t: torch.Tensor, count: int) -> torch.Tensor:  # [B, T, count * D] -> [B, Hv, T, D]
            t = t.view(B, T, count, -1).transpose(1, 2)
            share = self.v_heads // count  # value heads per key head
            if share == 1:
                return t
            return t.repeat(1, share, 1, 1) if self.tiled else t.repeat_interleave(share, dim=1)

        def unit(t: torch.Tensor) -> torch.Tensor:  # L2-normalized over the channels
            return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)

        q, k, v = unit(heads(q, self.k_heads)) * self.k_dim**-0.5, unit(heads(k, self.k_heads)), heads(v, self.v_heads)
        state = state if state is not None else q.new_zeros(B, self.v_heads, self.k_dim, self.v_dim)
        rule = delta_step if T == 1 else delta_chunks
        y, state = rule(q, k, v, g.transpose(1, 2), beta.transpose(1, 2), state)  # y [B, Hv, T, Dv]
        if keep is not None:
            self.memory.write(step, window, state)
        y = self.norm(y.transpose(1, 2).to(x.dtype)) * F.silu(z.view(B, T, self.v_heads, self.v_dim).float())
        return self.out_proj(y.to(x.dtype).reshape(B, T, -1))


class ShortConv(nn.Module):
    """LFM2's gated short conv: b, c, h = in_proj(x); out_proj(c * conv(b * h)), the conv causal and depthwise over
    the last W inputs."""

    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        C = config.hidden_size
        self.in_proj, self.out_proj = nn.Linear(C, 3 * C, bias=False), nn.Linear(C, C, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(C, 1, config.conv_kernel))
        self.memory: nn.Module = NoCache()

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        window, _, keep = self.memory.read(step, x.shape[0]) if step.input_pos is not None else (None, None, None)
        y, window = causal_conv(b * h, self.conv_weight, window, keep)
        if keep is not None:
            self.memory.write(step, window, None)
        return self.out_proj(c * y)


def ssd_step(x, dt, A, B, C, state) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's recurrence for one token, as it is defined: x [Bt, H, 1, P], dt [Bt, H, 1], A [H] (< 0), B and C
    [Bt, H, 1, N], state [Bt, H, P, N] float32. The state decays by e^(dt A), takes dt x B^T, and C reads it."""
    state = state * (dt * A[:, None]).exp()[..., None] + (dt[..., None] * x)[..., 0, :, None] * B
    return (state @ C[:, :, 0, :, None]).transpose(-1, -2), state


def ssd_chunks(x, dt, A, B, C, state, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence over T tokens, a chunk of `size` at a time (shapes as ssd_step's with T tokens). Why it
    equals T ssd_steps: within a chunk, with s_i = dt_1 A + ... + dt_i A, the state after token i is e^(s_i) S_0 +
    sum_{j<=i} e^(s_i - s_j) dt_j x_j B_j^T, so y_i = e^(s_i) S_0 C_i + sum_{j<=i} e^(s_i - s_j) (C_i . B_j) dt_j
    x_j: attention whose scores decay with distance, plus what the state brought in (the same sums, regrouped)."""
    T = x.shape[2]
    pad = -T % size  # padded tokens: dt 0, no decay and no write: the state passes through
    x, B, C = (F.pad(t, (0, 0, 0, pad)).unflatten(2, (-1, size)) for t in (x, B, C))  # [Bt, H, N, size, D]
    dt = F.pad(dt, (0, pad)).unflatten(2, (-1, size))  # [Bt, H, N, size]
    s = (dt * A[:, None, None]).cumsum(-1)
    later = torch.ones(size, size, dtype=torch.bool, device=x.device).triu(1)
    decay = (s[..., :, None] - s[..., None, :]).masked_fill(later, -math.inf).exp()  # e^(s_i - s_j), j <= i
    scores, written = (C @ B.transpose(-1, -2)) * decay, x * dt[..., None]  # dt_j x_j
    outs = []
    for c in range(x.shape[2]):
        outs.append(scores[:, :, c] @ written[:, :, c] + s[:, :, c, :, None].exp() * (C[:, :, c] @ state.mT))
        to_end = (s[:, :, c, -1:] - s[:, :, c]).exp()[..., None]  # e^(s_C - s_j)  [Bt, H, size, 1]
        state = s[:, :, c, -1, None, None].exp() * state + (written[:, :, c] * to_end).mT @ B[:, :, c]
    return torch.cat(outs, dim=2)[:, :, :T], state


class Mamba2(nn.Module):
    """Mamba2's selective state space layer (state space duality). One projection gives z (the output gate), x with
    B and C (through a causal conv and silu) and a time step per head, dt = softplus(dt + dt_bias); each head keeps
    a [P, N] state that decays by e^(dt A), A = -exp(A_log), and takes dt x B^T; C reads it, D x is added, then an
    RMSNorm by groups of silu(z)-gated channels and out_proj. A group's B and C serve heads / groups heads."""

    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        (self.heads, self.head_dim, self.groups, self.state_size), (bias, conv_bias) = config.mamba_heads, \
            config.mamba_biases
        inner, self.limit = self.heads * self.head_dim, config.time_step_limit
        self.sizes = [inner, inner + 2 * self.groups * self.state_size, self.heads]  # z, x|B|C, dt
        self.in_proj = nn.Linear(config.hidden_size, sum(self.sizes), bias=bias)
        self.conv_weight = nn.Parameter(torch.zeros(self.sizes[1], 1, config.conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(self.sizes[1])) if conv_bias else None
        self.dt_bias, self.A_log, self.D = (nn.Parameter(torch.ones(self.heads)) for _ in range(3))
        self.norm = RMSNorm(inner, config.norm_eps, gain_shape=(self.groups, inner // self.groups)) \
            if config.mamba_norm else nn.Identity()
        self.out_proj = nn.Linear(inner, config.hidden_size, bias=bias)
        self.memory: nn.Module = NoCache()

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        Bt, T, _ = x.shape
        z, xbc, dt = self.in_proj(x).split(self.sizes, dim=-1)
        window, state, keep = self.memory.read(step, Bt) if step.input_pos is not None else (None, None, None)
        xbc, window = causal_conv(xbc, self.conv_weight, window, keep)
        xbc = F.silu(xbc if self.conv_bias is None else xbc + self.conv_bias)
        xs, B, C = xbc.float().split([self.heads * self.head_dim] + [self.groups * self.state_size] * 2, dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())  # [Bt, T, H]
        dt = dt.clamp(*self.limit) if T > 1 else dt  # (transformers clamps a prompt's, not a decode step's)
        if keep is not None:
            dt = dt * keep[..., None]

        def groups(t: torch.Tensor) -> torch.Tensor:  # [Bt, T, G * N] -> [Bt, H, T, N]
            return t.view(Bt, T, self.groups, -1).transpose(1, 2).repeat_interleave(self.heads // self.groups, 1)

        xs = xs.view(Bt, T, self.heads, self.head_dim).transpose(1, 2)  # [Bt, H, T, P]
        state = state if state is not None else xs.new_zeros(Bt, self.heads, self.head_dim, self.state_size)
        rule = ssd_step if T == 1 else ssd_chunks
        y, state = rule(xs, dt.transpose(1, 2), -self.A_log.float().exp(), groups(B), groups(C), state)
        if keep is not None:
            self.memory.write(step, window, state)
        y = (y + self.D.float()[:, None, None] * xs).transpose(1, 2).reshape(Bt, T, -1) * F.silu(z.float())
        return self.out_proj(self.norm(y.view(Bt, T, self.groups, -1)).view(Bt, T, -1).to(x.dtype))


class Hybrid(nn.Module):
    """Falcon-H1's mixer: attention and Mamba2 read the same input, their outputs summed. Two memories in one layer:
    a KV cache (self.attention's) and a state (self.mamba's). (Falcon-H1's multipliers are folded into the weights
    when a checkpoint is read, as llama.cpp's converter folds them.)"""

    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        self.mamba, self.attention = Mamba2(config, layer), Attention(config, layer)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        return self.mamba(x, step) + self.attention(x, step)


MIXERS = {"attention": Attention, "delta": GatedDeltaNet, "conv": ShortConv, "mamba": Mamba2, "hybrid": Hybrid}


# ----------------------------------------------------------------------------------------------------------------
# 5. MLP and the decoder layer


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up are fused like q/k/v (one matmul). act: silu (SwiGLU) or tanh-GELU
    (GeGLU, Gemma)."""

    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        C, self.width = config.hidden_size, config.ffn_width(layer)
        self.parts = {"gate_proj": self.width, "up_proj": self.width}
        self.gate_up_proj = nn.Linear(C, 2 * self.width, bias=config.bias)
        self.down_proj = nn.Linear(self.width, C, bias=config.bias)
        self.act = nn.SiLU() if config.mlp == "swiglu" else nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.width, dim=-1)
        return self.down_proj(self.act(gate) * up)


# mlp kind -> an activation with learned parameters of its own (Apertus' xIELU: dense_engine/formats/activations.py
# adds it when a checkpoint is read)
ACTIVATIONS: dict = {}


class MLP(nn.Module):
    """down(act(up(x))): exact GELU (GPT-NeoX), or a family's activation of ACTIVATIONS."""

    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_width(layer), bias=config.bias)
        self.down_proj = nn.Linear(config.ffn_width(layer), config.hidden_size, bias=config.bias)
        self.act = nn.GELU() if config.mlp == "gelu" else ACTIVATIONS[config.mlp]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)): norms on each branch's input (pre-norms), on its output (post-norms),
    or both; or GPT-NeoX's parallel form, both branches reading x. A norm a family does not have is an Identity.
    (runtime/tp.py sums each branch's partial output over ranks as it enters its post-norm: a forward pre-hook.)"""

    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()

        def norm(present: bool) -> nn.Module:
            return make_norm(config, config.hidden_size) if present else nn.Identity()

        self.parallel, has_mlp = config.parallel_residual, config.ffn_width(layer) > 0
        pre, post = config.per_layer(config.pre_norms)[layer], config.per_layer(config.post_norms)[layer]
        self.attn_norm, self.mlp_norm = norm(pre), norm(pre and has_mlp)
        self.attn = MIXERS[config.mixer(layer)](config, layer)  # (attention, or a layer whose memory is a state)
        self.mlp = None if not has_mlp else GatedMLP(config, layer) if config.mlp in ("swiglu", "geglu") else \
            MLP(config, layer)  # (an FFN width of 0: no MLP, as Nemotron-H's blocks that only mix)
        self.attn_post_norm, self.mlp_post_norm = norm(post), norm(post and has_mlp)
        self.residual_scale = config.residual_scale
        self.index, P = layer, config.per_layer_input
        if P:  # Gemma 4: h + norm(proj(gelu(gate(h)) * its per-layer input))
            self.per_layer_gate = nn.Linear(config.hidden_size, P, bias=False)
            self.per_layer_proj = nn.Linear(P, config.hidden_size, bias=False)
            self.per_layer_norm, self.per_layer_act = make_norm(config, config.hidden_size), nn.GELU("tanh")
        self.layer_scalar = nn.Parameter(torch.ones(1)) if config.layer_scalars else None

    def scaled(self, y: torch.Tensor) -> torch.Tensor:  # (Granite; 1.0 elsewhere, no multiply in the graph)
        return y if self.residual_scale == 1.0 else y * self.residual_scale

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        if self.parallel:  # GPT-NeoX: both branches read x; (attn + mlp) + x, as the reference sums them
            branches = self.attn(self.attn_norm(x), step) + self.mlp(self.mlp_norm(x))
            return x + self.scaled(self.attn_post_norm(branches))
        h = x + self.scaled(self.attn_post_norm(self.attn(self.attn_norm(x), step)))
        if self.mlp is not None:
            h = h + self.scaled(self.mlp_post_norm(self.mlp(self.mlp_norm(h))))
        if step.per_layer is not None:
            gated = self.per_layer_act(self.per_layer_gate(h)) * step.per_layer[:, :, self.index]
            h = h + self.per_layer_norm(self.per_layer_proj(gated))
        return h if self.layer_scalar is None else h * self.layer_scalar


# ----------------------------------------------------------------------------------------------------------------
# 6. The model


class DenseDecoder(nn.Module):
    """Decoder-only LM. forward returns float32 logits [B, T, vocab] (and the mean cross-entropy when labels are
    given, label -100 ignored). With input_pos it runs a cached step after setup_cache."""

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.output_vocab_size or config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if config.per_layer_input:  # Gemma 4: a second table, every layer's input side by side, and a projection
            LP = config.num_hidden_layers * config.per_layer_input
            self.embed_per_layer = nn.Embedding(config.vocab_size, LP)
            self.per_layer_projection = nn.Linear(config.hidden_size, LP, bias=False)
            self.per_layer_norm = make_norm(config, config.per_layer_input)
        self.rope_kinds = sorted({kind for i in range(config.num_hidden_layers)
                                  if (kind := config.rope_kind(i)) is not None})
        self.attention_kinds = sorted({config.attention_kind(i) for i in range(config.num_hidden_layers)})
        self.rotary = nn.ModuleDict()  # kind -> Rotary, made by setup_cache for the cache's slots
        self.max_batch_size = self.max_seq_len = 0

    # An eager call's inputs are checked first, one ValueError each (they read values, a host sync, so compiled steps
    # skip them): dense_engine/formats/call_checks.py sets this when a checkpoint is read.
    check_inputs = None

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # (the final norm: every model has one, whatever its embedding holds)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def setup_cache(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None,
                    cache_class: type[KVCache] = KVCache) -> None:
        """Allocate the static KV cache, [max_batch_size, K, max_seq_len + 1, D] per layer (in `dtype`, default the
        model's), and the rotary tables for its slots. cache_class: a KVCache subclass (runtime/caches.py's)."""
        if not 0 < max_seq_len <= self.config.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} must be in 1..{self.config.max_position_embeddings} "
                             "(the model's context)")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        for mixer in self.mixers():  # free the old memory before allocating the new one
            mixer.memory = NoCache()
        for mixer in self.mixers():
            if isinstance(mixer, Attention) and mixer.reads is not None:  # the keys and values of the layer it reads
                del mixer.memory  # (held as a plain attribute, not a submodule: the cache's tensors are named once,
                object.__setattr__(mixer, "memory", self.layers[mixer.reads].attn.memory)  # as torch.export needs)
            elif isinstance(mixer, Attention):
                mixer.memory = cache_class(max_batch_size, mixer.n_kv_heads, max_seq_len, mixer.head_dim,
                                           dtype or self.dtype, self.device)
            else:  # a state: the conv's window, and Gated DeltaNet's or Mamba2's matrices
                heads = (mixer.v_heads, mixer.k_dim, mixer.v_dim) if isinstance(mixer, GatedDeltaNet) else (
                    mixer.heads, mixer.head_dim, mixer.state_size) if isinstance(mixer, Mamba2) else None
                mixer.memory = State(max_batch_size, max_seq_len, mixer.conv_weight.shape[0],
                                     mixer.conv_weight.shape[-1], heads, self.dtype, self.device)
        slots = torch.arange(max_seq_len + 1, device=self.device)
        self.register_buffer("kv_slots", slots, persistent=False)  # [S + 1]
        self.rotary = nn.ModuleDict({kind: Rotary(self.config, slots, max_seq_len, kind == "local")
                                     for kind in self.rope_kinds})
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len

    def mixers(self) -> list[nn.Module]:
        """The modules that keep a memory, in layer order: each layer's mixer, or both halves of a Hybrid."""
        return [m for layer in self.layers for m in
                ((layer.attn.mamba, layer.attn.attention) if isinstance(layer.attn, Hybrid) else (layer.attn,))]

    def hidden_states(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None, attend: int | None = None,
                      row_start: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                      causal: bool = False) -> torch.Tensor:
        """Final hidden states after the last norm, [B, T, C], in the model's dtype. The arguments as in make_step();
        attend is a Python int (the fixed width of a compiled step); eager calls may leave it None for "the slots in
        use"."""
        if not torch.compiler.is_compiling() and self.check_inputs is not None:
            self.check_inputs(input_ids, input_pos, rows, causal)
        T = input_ids.shape[1]
        if input_pos is not None and attend is None:
            attend = int(input_pos.max()) + 1
        step = make_step(self, T, input_pos, attend, row_start, rows, causal)
        x = self.embed_tokens(input_ids)  # [B, T, C]
        if self.config.embed_scale is not None:  # the scale rounded to the model's dtype first, as Gemma does
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=x.device)
        step.rope = {kind: (cos.to(x.dtype), sin.to(x.dtype)) for kind, (cos, sin) in step.rope.items()}
        if self.config.per_layer_input:
            step.per_layer = self.per_layer_inputs(input_ids, x)
        for layer in self.layers:
            x = layer(x, step)
        return self.norm(x)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gemma 4's per-layer inputs [B, T, L, P]: the token's row of the second table (times sqrt(P)) and a
        projection of its embedding x (normed per layer), averaged (times 1/sqrt(2), as the reference)."""
        B, T, C = x.shape
        L, P = self.config.num_hidden_layers, self.config.per_layer_input
        tokens = self.embed_per_layer(input_ids).to(x.dtype) * torch.tensor(P ** 0.5, dtype=x.dtype, device=x.device)
        context = self.per_layer_norm((self.per_layer_projection(x) * C ** -0.5).view(B, T, L, P))
        return (context + tokens.view(B, T, L, P)) * 2 ** -0.5

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head: hidden states [..., C] -> float32 logits [..., V]."""
        logits = self.lm_head(hidden).float()
        if self.config.logits_divisor != 1.0:
            logits = logits / self.config.logits_divisor
        if self.config.final_softcap is not None:
            logits = torch.tanh(logits / self.config.final_softcap) * self.config.final_softcap
        if logits.shape[-1] < self.config.vocab_size:  # a pruned head (Apertus 1.5): the ids past it never come
            # out; -1e30, not -inf, so that a sampler's entropy stays a number
            logits = F.pad(logits, (0, self.config.vocab_size - logits.shape[-1]), value=-1e30)
        return logits

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, *, attend: int | None = None,
                row_start: torch.Tensor | None = None, rows: torch.Tensor | None = None, causal: bool = False):
        logits = self.logits(self.hidden_states(input_ids, input_pos, attend, row_start, rows, causal))  # [B, T, V]
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return logits, loss
