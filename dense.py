"""dense.py: one config-driven decoder-only transformer with a static KV cache, for fast decoding.

Read it top to bottom: config -> norms -> rotary -> attention and its cache (and the one place where a step's masks
and rotary rows are decided) -> MLP -> layer -> model. A prefill writes the prompt's keys and values into the cache,
then each decode step feeds one token at a fixed shape over a fixed number of cache slots (`attend`): torch.compile
makes it one graph, replayed for every token. The layer kinds of particular families are layer_kinds.py's subclasses.

Shapes: B batch, T tokens in this call, S cache length, A slots attended, H query heads, K key/value heads,
D head_dim, C hidden size, R rotary channels, V vocabulary. This file imports only torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DenseConfig", "DenseDecoder"]


# ----------------------------------------------------------------------------------------------------------------
# 1. Config. The defaults are a plain Llama-2-7B; each switch names families that turn it (more: layer_kinds.py).


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
    rope_layout: str = "half"  # "half": rotate pairs (i, i + D/2) | "interleaved": pairs (2i, 2i + 1) (GermanGPT)
    rotary_dim: int | None = None  # rotate only the first rotary_dim channels of each head (GPT-NeoX, Phi-3)
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "dynamic" | "llama3" | "yarn", ...}: longer contexts
    # attention
    attn_scale: float | None = None  # scores = q.k * attn_scale; None: 1/sqrt(head_dim) (Gemma 2/3, Granite)
    sliding_window: int | None = None  # a token sees itself and the window - 1 tokens before it (Mistral, Gemma 2/3)
    layer_types: list[str] | None = None  # per layer "full_attention" | "sliding_attention"; None: all slide (Mistral)
    qkv_bias: bool = False  # biases on the q, k and v projections only (Qwen2, StableLM)
    qk_norm: str = "none"  # "per_channel": per head, a gain per (head, channel) (ShellElastic, StableLM) |
    #                        "shared": per head, one [D] gain (OpenELM, Qwen3, Gemma 3) | "whole": all heads (OLMo 2)
    attn_output_gate: bool = False  # attention output *= sigmoid(x W_gate^T) (ShellElastic, Qwen3.5)
    # the block
    norm: str = "rmsnorm"  # "layernorm" (with bias: GPT-NeoX, StableLM)
    norm_eps: float = 1e-5
    norm_gain_in_float32: bool = False  # RMSNorm's gain in float32, then cast (Sprout, OLMo 2); False: after (Llama)
    norm_unit_offset: bool = False  # RMSNorm's gain is 1 + weight (Gemma stores offsets from 1)
    mlp: str = "swiglu"  # down(silu(gate(x)) * up(x)) | "geglu": tanh-GELU (Gemma) | "gelu": down(gelu(up(x))) (NeoX)
    bias: bool = False  # biases on every linear of the blocks (GPT-NeoX)
    parallel_residual: bool = False  # x + mixer(n1(x)) + mlp(n2(x)) (GPT-NeoX, StableLM 2)
    pre_norms: bool | list[bool] = True  # norm each branch's input (every family but OLMo 2); a list: per layer
    post_norms: bool | list[bool] = False  # norm each branch's output before the residual add (Gemma 2/3, OLMo 2)
    # embeddings and head
    tie_word_embeddings: bool = False
    embed_scale: float | None = None  # embeddings times this, rounded to the model's dtype (Gemma: sqrt(C), Granite)
    extras: dict = field(default_factory=dict)  # layer_kinds.py's records by name (DenseDecoder refuses any)

    def per_layer(self, value) -> list[int]:
        return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * self.num_hidden_layers

    def heads(self, layer: int) -> int:
        return self.per_layer(self.num_attention_heads)[layer]

    def kv_heads(self, layer: int) -> int:
        kv = self.num_key_value_heads if self.num_key_value_heads is not None else self.num_attention_heads
        return self.per_layer(kv)[layer]

    def ffn_width(self, layer: int) -> int:
        return self.per_layer(self.intermediate_size)[layer]

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "full_attention"

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer's attention, or None (it sees every earlier token)."""
        sliding = self.layer_types is None or self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def attention_kind(self, layer: int) -> str:
        return "full" if self.window(layer) is None else "sliding"


# ----------------------------------------------------------------------------------------------------------------
# 2. Norms and rotary embeddings


class RMSNorm(nn.Module):
    """x / rms(x) * gain in float32 over the last `dims` dims, cast before the gain (Llama) or after (gain_in_float32:
    torch.nn.RMSNorm); unit_offset: gain 1 + weight (Gemma); gain_shape: a gain [H * D] on input [..., H, D]."""

    def __init__(self, dim: int, eps: float, gain_shape: tuple[int, ...] | None = None,
                 gain_in_float32: bool = False, unit_offset: bool = False, dims: int = 1) -> None:
        super().__init__()
        self.eps, self.gain_in_float32, self.unit_offset = eps, gain_in_float32 or unit_offset, unit_offset
        self.gain_shape, self.dims = gain_shape or (dim,), tuple(range(-dims, 0))
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(self.dims, keepdim=True) + self.eps)
        gain = self.weight.view(self.gain_shape)
        if self.unit_offset:
            gain = 1.0 + gain.float()
        return (h * gain).to(x.dtype) if self.gain_in_float32 else h.to(x.dtype) * gain


class LayerNorm(nn.Module):
    """(x - mean) / std * gain + bias over the last `dims` dims; gain_shape as RMSNorm's (StableLM's q/k norms)."""

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


def rope_frequencies(config: DenseConfig, seq_len: int, base: float | None = None, dim: int | None = None,
                     scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """The rotary frequencies [R/2] (float32) of a sequence of up to seq_len tokens, and the factor that scales cos
    and sin (1 but for yarn), as transformers computes them. base, dim, scaling: the config's unless given."""
    base, R = base or config.rope_theta, dim or (config.head_dim if config.rotary_dim is None else config.rotary_dim)
    powers = base ** (torch.arange(0, R, 2, dtype=torch.int64).float() / R)  # [R/2]
    inv_freq = 1.0 / powers
    scaling = scaling or config.rope_scaling or {"rope_type": "plain"}
    kind, factor = scaling["rope_type"], scaling.get("factor", 1.0)
    original = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    # (dynamic: NTK-aware scaling raises the base only past the model's context, which no cache reaches)
    if kind in ("plain", "dynamic", "linear"):
        return inv_freq / (factor if kind == "linear" else 1.0), 1.0
    if kind == "llama3":  # long wavelengths divided by factor, short ones kept, a smooth blend between
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, blended, scaled), 1.0
    if kind == "yarn":  # blended between interpolated (slow) and extrapolated (fast) frequencies by a linear ramp
        return yarn_frequencies(scaling, powers, base, R, original, scaling.get("factor") or
                                config.max_position_embeddings / original)
    raise ValueError(f"rope_scaling {kind!r}: layer_kinds.Decoder computes it")


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_frequencies(scaling: dict, powers: torch.Tensor, base: float, R: int, original: int,
                     factor: float) -> tuple[torch.Tensor, float]:
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    low, high = ((R * math.log(original / ((scaling.get(key) or default) * 2 * math.pi))) / (2 * math.log(base))
                 for key, default in (("beta_fast", 32), ("beta_slow", 1)))  # the dimensions of those rotations
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    extrapolate = 1 - ((torch.arange(R // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)
                       ).clamp(0, 1)
    return (1.0 / (factor * powers)) * (1 - extrapolate) + (1.0 / powers) * extrapolate, float(attention)


def rope_tables(config: DenseConfig, positions: torch.Tensor, frequencies: tuple[torch.Tensor, float],
                rounded=lambda t: t) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [P, R] float32 for float positions [P] from (frequencies, factor), laid out as config.rope_layout; a
    row depends only on its position. rounded: applied at every step (layer_kinds.py's bfloat16 tables)."""
    inv_freq, attention_factor = frequencies
    angles = rounded(torch.outer(rounded(positions), rounded(inv_freq.to(positions.device))))  # [P, R/2]
    # cos and sin of each angle once (attention_factor != 1: yarn), then laid out as the channels pair up
    tables = [rounded(angles.cos() * attention_factor), rounded(angles.sin() * attention_factor)]
    if config.rope_layout == "half":  # channel i and i + R/2 share an angle
        return tuple(torch.cat((t, t), dim=-1) for t in tables)
    return tuple(t.repeat_interleave(2, dim=-1) for t in tables)  # channels 2i and 2i + 1 share an angle


class Rotary(nn.Module):
    """One rotary kind's cos and sin for every slot of the cache, [S + 1, R] float32; a step looks up its rows."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotates the first R channels of each head of x [B, T, heads, D] by cos, sin [T, R] or [B, T, R] (x's dtype)."""
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
    """What one attention kind's layers see in a step: its own keys (own_keys), causal (mask None) or by mask [T, T];
    the cache's slots 0..attend-1 by mask [T, A] or [B, 1, T, A]; or a sliding decode step's W slots [B or 1, W]. A
    mask is what is added to the scores (0: seen, -inf: not), made once a step for every layer."""
    own_keys: bool
    mask: torch.Tensor | None
    attend: int
    window: int | None = None
    slots: torch.Tensor | None = None


@dataclass
class Step:
    """What a call tells its layers (make_step): its slots (input_pos [T] or [B, T]; None: a plain pass), cache rows
    (rows [B]), left-padded rows' starts (row_start [B]), a View per attention kind, (cos, sin) rows per rotary kind."""
    input_pos: torch.Tensor | None
    rows: torch.Tensor | None
    row_start: torch.Tensor | None
    views: dict[str, View]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
    carried: dict = field(default_factory=dict)  # what a family's layers hand each other within the call


def make_step(model: DenseDecoder, T: int, input_pos: torch.Tensor | None = None, attend: int | None = None,
              row_start: torch.Tensor | None = None, rows: torch.Tensor | None = None, causal: bool = False) -> Step:
    """What every layer of a call of T tokens sees. Without input_pos: a plain causal pass (no cache written). With
    input_pos [T] (or [B, T]): a cached step that writes at those slots and attends over slots 0..attend-1, each token
    up to its own slot (row_start [B]: left-padded rows' first slots). causal: slots 0..T-1 of an empty cache."""
    window, sliding = model.config.sliding_window, "sliding" in model.attention_kinds
    own_keys = input_pos is None or causal
    own = torch.arange(T, device=model.device) if own_keys else None  # positions 0..T-1 of the call's own tokens
    if input_pos is None:  # plain pass: rotary rows for positions 0..T-1 of a T-token sequence
        rope = {kind: model.rope_tables(own.float(), T, kind) for kind in model.rope_kinds}
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
        wanted = first + torch.arange(window, device=model.device)  # [B or 1, W], < 0 before the first token
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


def grouped(q: torch.Tensor, K: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """With a mask, SDPA's grouped-query support copies K/V per head. Instead, the G query heads of each K/V head become
    G * T query rows of that head: q [B, H, T, D] -> [B, K, G*T, D], the mask repeated per group."""
    B, H, T, D = q.shape
    G, A = H // K, mask.shape[-1]
    mask = mask.unsqueeze(-3).expand(*mask.shape[:-2], G, T, A).reshape(*mask.shape[:-2], G * T, A)
    return q.reshape(B, K, G * T, D), mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float):
    """softmax(q k^T * scale + mask) v for q [B, H, T, D] over k, v [B, K, A, D]; mask [T, A] or [B, 1, T, A] (None:
    causal, A == T). Grouped-query heads share K/V without copies."""
    if mask is None:  # a causal pass: SDPA's flash kernels take grouped heads
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    folded, mask = grouped(q, k.shape[1], mask)
    return F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale).reshape(q.shape)


def row_slots(step: Step, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache row, slot) of every token of a step, [B, T] each."""
    rows = step.rows if step.rows is not None else torch.arange(B, device=step.input_pos.device)
    return rows[:, None].expand(B, T), step.input_pos.expand(B, T)


def cache_rows(cache: torch.Tensor, step: Step, B: int) -> torch.Tensor:
    """The step's B rows of cache [max batch, ...]: rows 0..B-1, or step.rows [B]."""
    return cache[:B] if step.rows is None else cache.index_select(0, step.rows)


class NoCache(nn.Module):
    """A layer's memory before setup_cache: a plain pass attends over its own keys and values and keeps nothing."""

    def attend(self, q, k, v, step: Step, view: View, layer: Attention) -> torch.Tensor:
        return layer.attention(q, k, v, view.mask)


class KVCache(NoCache):
    """Keys and values of every position so far, preallocated once: [B, K, S + 1, D] each; the last slot is scratch,
    written by padding (a chunk's tail, an idle row) and never read. It stores; the layer attends (see caches.py)."""

    def __init__(self, batch: int, kv_heads: int, seq_len: int, head_dim: int, dtype, device) -> None:
        super().__init__()
        shape = (batch, kv_heads, seq_len + 1, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @staticmethod
    def bytes_for(batch: int, kv_heads: int, seq_len: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * batch * kv_heads * (seq_len + 1) * head_dim * dtype.itemsize

    def attend(self, q, k, v, step: Step, view: View, layer: Attention) -> torch.Tensor:
        """Write k, v [B, K, T, D] (a cached step); the layer's attention of q [B, H, T, D] over what the view shows."""
        if step.input_pos is not None:
            self.write(step, k, v)
        if view.own_keys:
            return layer.attention(q, k, v, view.mask)
        keys, values = self.read(step, view, q.shape[0])
        return layer.attention(q, keys.to(q.dtype), values.to(q.dtype), view.mask)

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
        """The step's B rows of keys and values that the view shows: [B, K, A, D], or [B, K, W, D] (view.slots)."""
        if view.slots is not None:
            index = view.slots[:, None, :, None].expand(B, self.k.shape[1], -1, self.k.shape[3])  # [B, K, W, D]
            return cache_rows(self.k, step, B).gather(2, index), cache_rows(self.v, step, B).gather(2, index)
        keys, values = self.k[:, :, :view.attend], self.v[:, :, :view.attend]  # [max batch, K, A, D]
        return cache_rows(keys, step, B), cache_rows(values, step, B)  # [B, K, A, D]


class Attention(nn.Module):
    """Queries, keys, values (and the output gate) come from one fused projection: their weights are stacked by rows
    (checkpoints store the parts; loading stacks them), one matmul a step. Its memory: a KV cache (setup_cache)."""

    def __init__(self, config: DenseConfig, layer: int, head_dim: int | None = None,
                 rope_kind: str | None = "base") -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.heads(layer), config.kv_heads(layer), \
            head_dim or config.head_dim
        self.kind, self.rope_kind, self.rope_layout = config.attention_kind(layer), rope_kind, config.rope_layout
        self.scale = config.attn_scale or self.head_dim**-0.5
        self.parts = self.part_rows(config, layer)  # checkpoint name: rows
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.parts.values()), bias=config.bias or config.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=config.bias)
        self.q_norm = qk_norm(config, self.n_heads, self.head_dim)
        self.k_norm = qk_norm(config, self.n_kv_heads, self.head_dim)
        self.memory: nn.Module = NoCache()

    def part_rows(self, config: DenseConfig, layer: int) -> dict[str, int]:
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {"q_proj": q_width, "k_proj": kv_width, "v_proj": kv_width} | (
            {"gate_proj": q_width} if config.attn_output_gate else {})

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        B, T, _ = x.shape
        parts = dict(zip(self.parts, self.qkv_proj(x).split(list(self.parts.values()), dim=-1)))
        q, k, v = self.queries_keys_values(parts, step)  # [B, heads, T, D] each
        y = self.memory.attend(q, k, v, step, step.views[self.kind], self)
        return self.o_proj(self.gated(y.transpose(1, 2).reshape(B, T, -1), parts))

    def queries_keys_values(self, parts: dict, step: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = parts["q_proj"].shape
        q = self.rotated(self.q_norm(parts["q_proj"].view(B, T, self.n_heads, self.head_dim)), step)
        k = self.rotated(self.k_norm(parts["k_proj"].view(B, T, self.n_kv_heads, self.head_dim)), step)
        v = parts["v_proj"].view(B, T, self.n_kv_heads, self.head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def rotated(self, x: torch.Tensor, step: Step) -> torch.Tensor:  # queries or keys [B, T, heads, D]
        if self.rope_kind is None:
            return x
        cos, sin = step.rope[self.rope_kind]
        return apply_rotary(x, cos, sin, self.rope_layout)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return attention(q, k, v, mask, self.scale)

    def gated(self, y: torch.Tensor, parts: dict) -> torch.Tensor:
        """The output [B, T, H * D] times the output gate (ShellElastic, Qwen3.5), if the layer has one."""
        return y * torch.sigmoid(parts["gate_proj"]) if "gate_proj" in parts else y

    def setup_cache(self, batch: int, seq_len: int, dtype: torch.dtype, cache_class: type, model: DenseDecoder) -> None:
        self.memory = cache_class(batch, self.n_kv_heads, seq_len, self.head_dim, dtype, model.device)

    def cache_bytes(self, batch: int, seq_len: int, dtype: torch.dtype, cache_class: type, model: DenseDecoder) -> int:
        return cache_class.bytes_for(batch, self.n_kv_heads, seq_len, self.head_dim, dtype)


# ----------------------------------------------------------------------------------------------------------------
# 4. MLP and the decoder layer


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused like q/k/v; act: silu (SwiGLU) or tanh-GELU (GeGLU, Gemma)."""

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


class MLP(nn.Module):
    """down(act(up(x))): exact GELU (GPT-NeoX), or an activation layer_kinds.py gives."""

    def __init__(self, config: DenseConfig, layer: int, act: nn.Module) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_width(layer), bias=config.bias)
        self.down_proj = nn.Linear(config.ffn_width(layer), config.hidden_size, bias=config.bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class DecoderLayer(nn.Module):
    """x + mixer(norm(x)), then + mlp(norm(.)), norms on each branch's input (pre-norms), output (post-norms) or both
    (an Identity where a family has none); or GPT-NeoX's parallel form. The mixer mixes across positions (Attention
    here, or a layer_kinds.py kind); mlp None: a layer that only mixes. (tp.py sums partial outputs entering the
    post-norms.)"""

    def __init__(self, config: DenseConfig, layer: int, mixer: nn.Module, mlp: nn.Module | None) -> None:
        super().__init__()

        def norm(present: bool) -> nn.Module:
            return make_norm(config, config.hidden_size) if present else nn.Identity()

        self.parallel, has_mlp = config.parallel_residual, mlp is not None
        pre, post = config.per_layer(config.pre_norms)[layer], config.per_layer(config.post_norms)[layer]
        self.mixer_norm, self.mlp_norm = norm(pre), norm(pre and has_mlp)
        self.mixer, self.mlp = mixer, mlp
        self.mixer_post_norm, self.mlp_post_norm = norm(post), norm(post and has_mlp)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        if self.parallel:  # GPT-NeoX: both branches read x; (mixer + mlp) + x, as the reference sums them
            return x + self.mixer_post_norm(self.mixer(self.mixer_norm(x), step) + self.mlp(self.mlp_norm(x)))
        h = x + self.mixer_post_norm(self.mixer(self.mixer_norm(x), step))
        return h if self.mlp is None else h + self.mlp_post_norm(self.mlp(self.mlp_norm(h)))


# ----------------------------------------------------------------------------------------------------------------
# 5. The model


class DenseDecoder(nn.Module):
    """Decoder-only LM: float32 logits [B, T, V] (and the mean cross-entropy of labels, -100 ignored); with input_pos
    a cached step after setup_cache. make_* choose each layer's parts (layer_kinds.Decoder: the families' kinds)."""

    extras_built: frozenset = frozenset()  # the config extras this class builds (a config asking others is refused)

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        if set(config.extras) - self.extras_built:
            raise ValueError(f"config extras {sorted(set(config.extras) - self.extras_built)}: use layer_kinds.Decoder")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(config.num_hidden_layers))
        # the modules that keep a memory between steps: each layer's mixer, or both halves of a hybrid one
        self.mixers = [m for m in self.layers.modules() if hasattr(m, "memory")]
        self.norm = make_norm(config, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope_kinds = sorted({m.rope_kind for m in self.mixers if getattr(m, "rope_kind", None)})
        self.attention_kinds = sorted({config.attention_kind(i) for i in range(config.num_hidden_layers)})
        self.rotary = nn.ModuleDict()  # kind -> Rotary, made by setup_cache for the cache's slots
        self.max_batch_size = self.max_seq_len = 0

    def make_layer(self, i: int) -> DecoderLayer:
        return DecoderLayer(self.config, i, self.make_mixer(i), self.make_mlp(i))

    def make_mixer(self, i: int) -> nn.Module:
        if self.config.layer_type(i) not in ("full_attention", "sliding_attention"):
            raise ValueError(f"layer {i} is a {self.config.layer_type(i)!r} layer: use layer_kinds.Decoder")
        return Attention(self.config, i)

    def make_mlp(self, i: int) -> nn.Module | None:
        if self.config.ffn_width(i) == 0:  # (an FFN width of 0: no MLP, as Nemotron-H's blocks that only mix)
            return None
        if self.config.mlp not in ("swiglu", "geglu", "gelu"):
            raise ValueError(f"mlp {self.config.mlp!r}: use layer_kinds.Decoder")
        return MLP(self.config, i, nn.GELU()) if self.config.mlp == "gelu" else GatedMLP(self.config, i)

    def rope_tables(self, positions: torch.Tensor, seq_len: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) rows [P, R] of rotary kind `kind` at float positions [P], for a sequence of seq_len."""
        return rope_tables(self.config, positions, rope_frequencies(self.config, seq_len))

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # (the final norm: every model has one, whatever its embedding holds)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def setup_cache(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None,
                    cache_class: type[KVCache] = KVCache) -> None:
        """Each layer's memory for max_batch_size rows of max_seq_len slots (keys and values: cache_class in `dtype`,
        default the model's), and the rotary tables of those slots."""
        if not 0 < max_seq_len <= (context := self.config.max_position_embeddings):
            raise ValueError(f"max_seq_len {max_seq_len} must be in 1..{context} (the model's context)")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        for mixer in self.mixers:  # free the old memory before allocating the new one
            mixer.memory = NoCache()
        for mixer in self.mixers:
            mixer.setup_cache(max_batch_size, max_seq_len, dtype or self.dtype, cache_class, self)
        slots = torch.arange(max_seq_len + 1, device=self.device)
        self.register_buffer("kv_slots", slots, persistent=False)  # [S + 1]
        self.rotary = nn.ModuleDict({kind: Rotary(*self.rope_tables(slots.float(), max_seq_len, kind))
                                     for kind in self.rope_kinds})
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len

    def hidden_states(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None, attend: int | None = None,
                      row_start: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                      causal: bool = False) -> torch.Tensor:
        """Hidden states after the last norm [B, T, C]; arguments as make_step's (attend: a compiled step's width)."""
        if input_pos is not None and attend is None:
            attend = int(input_pos.max()) + 1
        step = make_step(self, input_ids.shape[1], input_pos, attend, row_start, rows, causal)
        x = self.embed(input_ids, step)  # [B, T, C]
        step.rope = {kind: (cos.to(x.dtype), sin.to(x.dtype)) for kind, (cos, sin) in step.rope.items()}
        for layer in self.layers:
            x = layer(x, step)
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor, step: Step) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:  # the scale rounded to the model's dtype first, as Gemma does
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=x.device)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head: hidden states [..., C] -> float32 logits [..., V]."""
        return self.lm_head(hidden).float()

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, *, attend: int | None = None,
                row_start: torch.Tensor | None = None, rows: torch.Tensor | None = None, causal: bool = False):
        logits = self.logits(self.hidden_states(input_ids, input_pos, attend, row_start, rows, causal))  # [B, T, V]
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return logits, loss
