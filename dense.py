"""dense.py: one config-driven dense decoder-only transformer, with a static KV cache for fast decoding.

Read it top to bottom:
  1. DenseConfig: every architectural switch the supported families need (defaults = the ShellElastic model).
  2. The layers: norms, rotary embeddings, the static KV cache, attention, MLP, the decoder block.
  3. DenseDecoder: the model, its cache, and filling it from a table of checkpoint tensors.
  4. Sampling: logits -> next token, on the device, without a host sync.

How generation uses it (generate.py): a prefill writes the prompt's keys and values into the cache, then each decode
step feeds one token at a fixed shape. A step attends over a fixed number of cache slots (`attend`), so
torch.compile turns it into one graph per slot count, replayed for every token.

Shapes: B batch, T tokens in this call, S cache length, A slots attended, H query heads, K key/value heads,
D head_dim, C hidden size, R rotary channels. This file imports nothing of the project but torch: foreign checkpoint
layouts are mapped to its tensor names in families.py and gguf_import.py, quantized linears live in quantized.py, and
load.py puts a checkpoint into a model (load.from_pretrained); generate.py runs it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DenseConfig", "DenseDecoder", "CheckpointError", "sample"]


class CheckpointError(ValueError):
    """A checkpoint or config that cannot be used; the message is one line naming the file and what is wrong."""


# ----------------------------------------------------------------------------------------------------------------
# 1. Config

# The rotary scalings (rope_scaling["rope_type"]) and the keys each reads, the required ones first (a count); a key
# not listed here is refused, so a scaling is never half applied. What each computes: rope_frequencies below.
ROPE_SCALINGS = {
    "linear": (1, ("factor",)),
    "dynamic": (1, ("factor",)),
    "llama3": (4, ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")),
    "yarn": (2, ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                 "attention_factor", "truncate")),
    "longrope": (3, ("short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor")),
    "factors": (1, ("factors",)),
}


@dataclass
class DenseConfig:
    vocab_size: int = 50432
    hidden_size: int = 384
    intermediate_size: int | list[int] = 1536  # FFN width; a list gives one width per layer (OpenELM)
    num_hidden_layers: int = 32
    num_attention_heads: int | list[int] = 6  # a list gives one count per layer (OpenELM)
    num_key_value_heads: int | list[int] | None = None  # GQA; None = as many as query heads
    head_dim: int = 64  # independent of hidden_size / heads
    max_position_embeddings: int = 2048
    # rotary position embeddings
    rope_theta: float = 10000.0
    rope_precision: str = "bfloat16"  # "bfloat16": every step of the tables rounded (seed 000); "float32"
    rope_layout: str = "half"  # "half": rotate-half pairs (i, i + D/2); "interleaved": pairs (2i, 2i + 1)
    rotary_dim: int | None = None  # rotate only the first rotary_dim channels of each head; None = all
    rope_scaling: dict | None = None  # {"rope_type": one of ROPE_SCALINGS, its keys}: longer contexts (Llama 3, Phi-3)
    rope_local_theta: float | None = None  # sliding-window layers rotate with this base, unscaled (Gemma 3)
    nope_layers: list[int] | None = None  # layers whose attention has no rotary embedding at all (SmolLM3)
    # attention
    attn_scale: float | None = None  # scores = q.k * attn_scale; None = 1/sqrt(head_dim)
    attn_softcap: float | None = None  # scores = cap * tanh(scores / cap) before the softmax (Gemma 2)
    sliding_window: int | None = None  # a token sees itself and the sliding_window - 1 tokens before it
    layer_types: list[str] | None = None  # per layer "full_attention" | "sliding_attention"; None: all sliding if a
    #                                       window is set (Mistral), else all full
    qkv_bias: bool = False  # biases on the q, k and v projections only (Qwen2, StableLM)
    # the block
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm" (with bias)
    norm_eps: float = 1e-5
    norm_gain_in_float32: bool = False  # RMSNorm: gain applied in float32, then cast (torch.nn.RMSNorm, Sprout);
    #                                     False: cast to the compute dtype first, then the gain (seed 000, Llama)
    norm_unit_offset: bool = False  # RMSNorm gain is 1 + weight (Gemma: weights stored as offsets from 1)
    qk_norm: str = "per_channel"  # "none" | "per_channel": a norm per head, one gain per channel | "shared": per
    #                               head, one [D] gain for all heads | "whole": over all heads' channels (OLMo 2)
    attn_output_gate: bool = True  # attention output *= sigmoid(x W_gate^T), x the attention input
    mlp: str = "swiglu"  # "swiglu": down(silu(gate(x)) * up(x)) | "geglu": the same with tanh-approximated gelu
    #                      (Gemma) | "gelu": down(gelu(up(x))), exact gelu
    bias: bool = False  # biases on every linear of the blocks (not on lm_head)
    parallel_residual: bool = False  # x + attn(n1(x)) + mlp(n2(x)) instead of two sequential residuals
    pre_norms: bool = True  # norm the input of attention and MLP (every family but OLMo 2)
    post_norms: bool = False  # norm the output of attention and MLP before the residual add (Gemma 2/3, OLMo 2)
    residual_scale: float = 1.0  # each branch's output times this before the residual add (Granite)
    # embeddings and head
    tie_word_embeddings: bool = False
    embed_scale: float | None = None  # embeddings times this, rounded to the model's dtype (Gemma: sqrt(hidden))
    logits_divisor: float = 1.0  # logits / this (Granite's logits_scaling)
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)

    # Keys of a release's config.json that describe the release, not the model; all other unknown keys are errors.
    RELEASE_KEYS = ("method", "tier", "paper_table", "architectures", "model_type", "torch_dtype",
                    "transformers_version", "_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id",
                    "quantization", "source_format", "source_tensor_types")
    ALIASES = {"rms_norm_eps": "norm_eps"}  # seed 000's name for the eps
    MAX_SIZE = 1 << 24  # no width, count or context of a real model comes near this; a bigger one is a broken config

    def __post_init__(self) -> None:
        self.validate()

    def _per_layer(self, value, name: str) -> list[int]:
        if isinstance(value, (list, tuple)):
            if len(value) != self.num_hidden_layers:
                raise CheckpointError(f"config: {name} has {len(value)} entries, expected num_hidden_layers="
                                      f"{self.num_hidden_layers}")
            return [int(v) for v in value]
        return [int(value)] * self.num_hidden_layers

    def heads(self, layer: int) -> int:
        return self._per_layer(self.num_attention_heads, "num_attention_heads")[layer]

    def kv_heads(self, layer: int) -> int:
        kv = self.num_key_value_heads if self.num_key_value_heads is not None else self.num_attention_heads
        return self._per_layer(kv, "num_key_value_heads")[layer]

    def ffn_width(self, layer: int) -> int:
        return self._per_layer(self.intermediate_size, "intermediate_size")[layer]

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer's attention, or None (it sees every earlier token)."""
        if self.sliding_window is None:
            return None
        sliding = self.layer_types is None or self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def rope_of(self, layer: int) -> str | None:
        """Which rotary tables a layer uses: "global", "local" (sliding layers with their own base), or None."""
        if self.nope_layers and layer in self.nope_layers:
            return None
        return "local" if self.rope_local_theta is not None and self.window(layer) else "global"

    @property
    def rope_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def validate(self) -> None:
        def bad(msg: str):
            raise CheckpointError(f"config: {msg}")

        choices = {"rope_precision": ("bfloat16", "float32"), "rope_layout": ("half", "interleaved"),
                   "norm": ("rmsnorm", "layernorm"), "qk_norm": ("none", "per_channel", "shared", "whole"),
                   "mlp": ("swiglu", "geglu", "gelu")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                bad(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= self.MAX_SIZE:
                bad(f"{name} must be an integer in 1..{self.MAX_SIZE}, got {value!r}")
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = getattr(self, name)
            values = value if isinstance(value, (list, tuple)) else [value]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values if v is not None):
                bad(f"{name} must be an integer or a list of integers, got {value!r}")
        positive = ("norm_eps", "rope_theta", "rope_local_theta", "attn_scale", "attn_softcap", "residual_scale",
                    "embed_scale", "logits_divisor", "final_softcap")
        for name in positive:
            value = getattr(self, name)
            if value is None and name not in ("norm_eps", "rope_theta", "residual_scale", "logits_divisor"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                bad(f"{name} must be a positive number, got {value!r}")
        for layer in range(self.num_hidden_layers):
            heads, kv, width = self.heads(layer), self.kv_heads(layer), self.ffn_width(layer)
            if not (0 < heads <= self.MAX_SIZE and 0 < kv <= self.MAX_SIZE and 0 < width <= self.MAX_SIZE):
                bad(f"layer {layer}: heads ({heads}), key/value heads ({kv}) and FFN width ({width}) must be in "
                    f"1..{self.MAX_SIZE}")
            if heads % kv:
                bad(f"layer {layer}: {heads} query heads do not divide into {kv} key/value heads")
        if not isinstance(self.rope_dim, int) or not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            bad(f"rotary dimension {self.rope_dim} must be even and in 1..head_dim={self.head_dim}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            bad(f"sliding_window must be a whole number >= 1, got {self.sliding_window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {
                    "full_attention", "sliding_attention"}:
                bad(f"layer_types must list {self.num_hidden_layers} of 'full_attention' / 'sliding_attention'")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                bad("layer_types has sliding_attention layers but no sliding_window is set")
        if self.nope_layers is not None and not all(isinstance(i, int) and 0 <= i < self.num_hidden_layers
                                                    for i in self.nope_layers):
            bad(f"nope_layers must list layer indices in 0..{self.num_hidden_layers - 1}")
        if self.parallel_residual and (self.post_norms or not self.pre_norms):
            bad("parallel_residual has no post-norm form")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type") if isinstance(self.rope_scaling, dict) else None
            if kind not in ROPE_SCALINGS:
                bad(f"rope_scaling type {kind!r} is not implemented (implemented: {', '.join(ROPE_SCALINGS)})")
            required, known = ROPE_SCALINGS[kind]
            extra = sorted(set(self.rope_scaling) - {"rope_type", *known})
            if extra:
                bad(f"rope_scaling {kind!r}: key {extra[0]!r} is not implemented")
            missing = [key for key in known[:required] if self.rope_scaling.get(key) is None]
            if missing:
                bad(f"rope_scaling {kind!r} needs {missing[0]!r}")
            lists = [key for key in ("short_factor", "long_factor", "factors") if key in self.rope_scaling]
            for key in lists:
                if len(self.rope_scaling[key]) != self.rope_dim // 2:
                    bad(f"rope_scaling {key} has {len(self.rope_scaling[key])} entries, expected rotary dimension / 2"
                        f" = {self.rope_dim // 2}")
            if self.rope_precision != "float32":
                bad("rope_scaling needs rope_precision 'float32'")

    def num_parameters(self) -> int:
        """Parameters the config describes (norm gains and biases included), without building the model."""
        C, total = self.hidden_size, self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        for layer in range(self.num_hidden_layers):
            q, kv, w = self.heads(layer) * self.head_dim, self.kv_heads(layer) * self.head_dim, self.ffn_width(layer)
            total += C * (q + 2 * kv) + q * C + (C * q if self.attn_output_gate else 0)
            total += C * w * (2 if self.mlp == "gelu" else 3) + 4 * C
        return total + 2 * C

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> "DenseConfig":
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in values.items():
            key = cls.ALIASES.get(key, key)
            if key in known:
                kwargs[key] = value
            elif key not in cls.RELEASE_KEYS:
                raise CheckpointError(f"{source}: unknown config key {key!r}")
        try:
            return cls(**kwargs)
        except CheckpointError as e:
            raise CheckpointError(f"{source}: {str(e).removeprefix('config: ')}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: {e}") from None

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------------------------------------
# 2. Layers


class RMSNorm(nn.Module):
    """x / rms(x) * gain over the last dim. Statistics in float32; the result is cast back to x's dtype before the
    gain (seed 000), or after it when gain_in_float32 (torch.nn.RMSNorm). The two differ only below float32.
    unit_offset: the gain is 1 + weight, in float32 (Gemma). gain_shape lets a flat per-channel gain [H * D] act on
    per-head input [..., H, D]."""

    def __init__(self, dim: int, eps: float, gain_shape: tuple[int, ...] | None = None,
                 gain_in_float32: bool = False, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.gain_in_float32, self.unit_offset = eps, gain_in_float32 or unit_offset, unit_offset
        self.gain_shape = gain_shape or (dim,)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        gain = self.weight.view(self.gain_shape)
        if self.unit_offset:
            gain = 1.0 + gain.float()
        return (h * gain).to(x.dtype) if self.gain_in_float32 else h.to(x.dtype) * gain


class LayerNorm(nn.Module):
    """(x - mean) / std * gain + bias over the last dim; gain_shape as in RMSNorm (a gain per head: StableLM's
    per-head q/k norms, which have no bias)."""

    def __init__(self, dim: int, eps: float, gain_shape: tuple[int, ...] | None = None, bias: bool = True) -> None:
        super().__init__()
        self.eps, self.gain_shape = eps, gain_shape or (dim,)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gain_shape == (x.shape[-1],):  # one fused kernel, as nn.LayerNorm
            return F.layer_norm(x, self.gain_shape, self.weight, self.bias, self.eps)
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * self.weight.view(self.gain_shape)


def make_norm(config: DenseConfig, dim: int, gain_shape: tuple[int, ...] | None = None,
              bias: bool = True) -> nn.Module:
    if config.norm == "layernorm":
        return LayerNorm(dim, config.norm_eps, gain_shape, bias)
    return RMSNorm(dim, config.norm_eps, gain_shape, config.norm_gain_in_float32, config.norm_unit_offset)


def rope_frequencies(config: DenseConfig, seq_len: int, local: bool = False) -> tuple[torch.Tensor, float]:
    """The rotary frequencies [R/2] (float32) of a sequence of up to seq_len tokens, and the factor that scales
    cos and sin (1 unless yarn or longrope says otherwise). Each scaling as transformers computes it.

    local: the sliding-window layers' tables (their own base, unscaled). seq_len matters to two scalings: "longrope"
    uses its long factors when seq_len exceeds the original context (a cache longer than that: every position, as
    llama.cpp chooses by its context size), its short ones otherwise; "dynamic" raises the base only past the
    model's context, which no sequence here reaches (so it rotates as plain rope)."""
    dim = config.rope_dim
    base = config.rope_local_theta if local else config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [R/2]
    scaling = None if local else config.rope_scaling
    kind = scaling["rope_type"] if scaling else None
    if kind == "dynamic" and seq_len > config.max_position_embeddings:
        factor = scaling["factor"]
        base = base * ((factor * seq_len / config.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** exponents)
    if kind in (None, "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "factors":  # a divisor per frequency (a GGUF's rope_freqs tensor)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    original = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    if kind == "llama3":  # long wavelengths divided by factor, short ones kept, a smooth blend between
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, blended, scaled), 1.0
    factor = scaling.get("factor") or config.max_position_embeddings / original
    if kind == "longrope":
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = scaling["long_factor"] if seq_len > original else scaling["short_factor"]
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base ** exponents), attention
    # yarn: frequencies blended between interpolated (slow ones) and extrapolated (fast ones) by a linear ramp

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    positions_freq = base ** exponents
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * positions_freq)) * (1 - extrapolate) + (1.0 / positions_freq) * extrapolate
    return inv_freq, float(attention)


def rope_tables(config: DenseConfig, positions: torch.Tensor, seq_len: int | None = None,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [P, rope_dim] float32 for float positions [P], laid out to match config.rope_layout, for a sequence
    (or cache) of seq_len slots (default P). Each row depends only on its position, so a table for positions 0..P-1
    equals these rows computed one at a time."""
    inv_freq, attention_factor = rope_frequencies(config, len(positions) if seq_len is None else seq_len, local)
    inv_freq = inv_freq.to(positions.device)
    if config.rope_precision == "bfloat16":
        # Round each step to bfloat16; the product of two bfloat16 numbers is exact in float32, so rounding it once
        # gives the bfloat16 product.
        def bf16(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.bfloat16).float()

        angles = bf16(torch.outer(bf16(positions), bf16(inv_freq)))
    else:
        angles = torch.outer(positions, inv_freq)  # [P, R/2]
    if config.rope_layout == "half":
        angles = torch.cat((angles, angles), dim=-1)  # channel i and i + R/2 share an angle
    else:
        angles = angles.repeat_interleave(2, dim=-1)  # channels 2i and 2i + 1 share an angle
    cos, sin = angles.cos(), angles.sin()
    if config.rope_precision == "bfloat16":
        return bf16(cos), bf16(sin)
    return cos * attention_factor, sin * attention_factor


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


@dataclass
class CacheStep:
    """What a cached step tells every attention layer: it writes keys/values at slots input_pos ([T], the same for
    every row, or [B, T], a slot per row and token: rows of a server's batch are at different positions) and
    attends over slots 0..attend-1. mask [T, A] (or [B, 1, T, A]) hides the future, the slots not written yet and
    padding (None: a causal prefill from slot 0). row_start [B] (left-padded batches): where each row's tokens begin.
    rows [B] (None: 0..B-1): the cache rows this call's batch rows live in (a server prefilling one request).
    Sliding-window layers use window_mask instead; a decode step gives them only their window's slots,
    window_slots [B, W] (else None: slots 0..A-1 as the others)."""
    input_pos: torch.Tensor
    attend: int
    mask: torch.Tensor | None
    row_start: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    window: int | None = None
    window_mask: torch.Tensor | None = None
    window_slots: torch.Tensor | None = None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              softcap: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v for q [B, H, T, D] over k, v [B, K, A, D]; mask [T, A] or [B, 1, T, A] (True: seen),
    None: causal with A == T. Grouped-query heads share K/V without copies."""
    B, H, T, D = q.shape
    K, A = k.shape[1], k.shape[2]
    if mask is None and softcap is None:  # a causal prefill: SDPA's flash kernels take grouped heads as they are
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=K != H)
    if mask is None:
        mask = torch.ones(T, A, dtype=torch.bool, device=q.device).tril()
    # With a mask, SDPA's grouped-query support falls back to a path that copies K/V per head. Instead, the G query
    # heads of each K/V head become G * T query rows of that head (head h reads K/V head h // G): equal head counts,
    # the mask repeated per group, [B, K, G*T, D] against [B, K, A, D].
    G = H // K
    q = q.reshape(B, K, G * T, D)
    mask = mask.unsqueeze(-3).expand(*mask.shape[:-2], G, T, A).reshape(*mask.shape[:-2], G * T, A)
    if softcap is None:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:  # SDPA cannot soft-cap its scores (Gemma 2): written out, softmax in float32
        scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
        scores = scores.masked_fill(~mask, -math.inf)
        y = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype) @ v
    return y.reshape(B, H, T, D)


class KVCache(nn.Module):
    """Static cache: keys and values of every position so far, preallocated once: [B, K, S + 1, D] each. The extra
    last slot is scratch: tokens that are only padding (a fixed-size chunk's tail, an idle row of a server's batch)
    write there, and nothing reads it. (kernels.py subclasses it for the CPU: a layout and an attention kernel that
    read only the slots in use.)"""

    def __init__(self, batch: int, kv_heads: int, seq_len: int, head_dim: int, dtype, device) -> None:
        super().__init__()
        shape = (batch, kv_heads, seq_len + 1, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, step: CacheStep, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [B, K, T, D] at the step's slots, in place."""
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        if step.input_pos.ndim == 1 and step.rows is None:  # every row writes the same slots
            self.k[: k.shape[0]].index_copy_(2, step.input_pos, k)
            self.v[: v.shape[0]].index_copy_(2, step.input_pos, v)
            return
        rows, pos = row_slots(step, k.shape[0], k.shape[2])  # [B, T] each
        self.k[rows, :, pos] = k.transpose(1, 2)  # [B, T, K, D] by (row, slot)
        self.v[rows, :, pos] = v.transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: CacheStep, scale: float,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """Write this step's k, v [B, K, T, D]; attend q [B, H, T, D] over slots 0..attend-1 (a sliding layer: over
        its window) -> [B, H, T, D]."""
        self.update(step, k, v)
        B = q.shape[0]
        if window is not None and step.window_slots is not None:  # decode: only the window's slots, [B, K, W, D]
            index = step.window_slots[:, None, :, None].expand(B, self.k.shape[1], -1, self.k.shape[3])
            keys, values = (c[:B] if step.rows is None else c.index_select(0, step.rows) for c in (self.k, self.v))
            keys, values = keys.gather(2, index), values.gather(2, index)
        else:
            keys, values = (c[:B, :, :step.attend] if step.rows is None else
                            c[:, :, :step.attend].index_select(0, step.rows) for c in (self.k, self.v))
        mask = step.window_mask if window is not None else step.mask
        return attention(q, keys.to(q.dtype), values.to(q.dtype), mask, scale, softcap)


def sliding_mask(input_pos: torch.Tensor, attend: int, window: int) -> torch.Tensor:
    """[..., T, A]: which of slots 0..A-1 a token at slot input_pos [..., T] sees through a causal sliding window:
    itself and the window - 1 slots before it."""
    slots = torch.arange(attend, device=input_pos.device)
    return (slots <= input_pos[..., None]) & (slots > input_pos[..., None] - window)


def row_slots(step: CacheStep, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache row, slot) of every token of a step, [B, T] each."""
    rows = step.rows if step.rows is not None else torch.arange(B, device=step.input_pos.device)
    return rows[:, None].expand(B, T), step.input_pos.expand(B, T)


class Attention(nn.Module):
    """Queries, keys, values (and the output gate) come from one fused projection: their weights are stacked by rows,
    so a step reads the input once and makes one matmul (checkpoints store the parts; loading stacks them)."""

    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.heads(layer), config.kv_heads(layer), config.head_dim
        self.rope_layout, self.rope = config.rope_layout, config.rope_of(layer)
        self.scale = config.attn_scale or self.head_dim**-0.5
        self.softcap, self.window = config.attn_softcap, config.window(layer)
        q_width, kv_width, C = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, config.hidden_size
        self.parts = {"q_proj": q_width, "k_proj": kv_width, "v_proj": kv_width}
        if config.attn_output_gate:
            self.parts["gate_proj"] = q_width
        self.qkv_proj = nn.Linear(C, sum(self.parts.values()), bias=config.bias or config.qkv_bias)
        if config.qkv_bias and config.attn_output_gate:
            raise CheckpointError("config: qkv_bias with attn_output_gate is not a known layout")
        self.o_proj = nn.Linear(q_width, C, bias=config.bias)
        D = self.head_dim
        self.q_norm = self.k_norm = None
        self.qk_norm = config.qk_norm
        if config.qk_norm == "per_channel":  # per head, a gain per channel (no bias: StableLM's layer norms)
            self.q_norm = make_norm(config, q_width, (self.n_heads, D), bias=False)
            self.k_norm = make_norm(config, kv_width, (self.n_kv_heads, D), bias=False)
        elif config.qk_norm == "shared":
            self.q_norm, self.k_norm = make_norm(config, D, bias=False), make_norm(config, D, bias=False)
        elif config.qk_norm == "whole":  # over the whole projection, before it is split into heads (OLMo 2)
            self.q_norm, self.k_norm = make_norm(config, q_width, bias=False), make_norm(config, kv_width, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x, rope: dict, step: CacheStep | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        parts = self.qkv_proj(x).split(list(self.parts.values()), dim=-1)
        q, k, v = parts[0], parts[1], parts[2]
        if self.qk_norm == "whole":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        if self.qk_norm in ("per_channel", "shared"):  # q/k normalized within each head, before rotary
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            cos, sin = rope[self.rope]
            q = apply_rotary(q, cos, sin, self.rope_layout)
            k = apply_rotary(k, cos, sin, self.rope_layout)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        if step is None:  # no cache: a plain causal pass over this call's T tokens
            mask = None if self.window is None else sliding_mask(torch.arange(T, device=x.device), T, self.window)
            y = attention(q, k, v, mask, self.scale, self.softcap)
        else:  # cached step: write this call's keys/values, attend over the cache
            y = self.kv_cache.attend(q, k, v, step, self.scale, self.window, self.softcap)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        if len(parts) == 4:
            y = y * torch.sigmoid(parts[3])
        return self.o_proj(y)


class MLP(nn.Module):
    """The gated MLPs' gate and up projections are fused like q/k/v (one matmul); GELU MLPs have up and down only."""

    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        C, W = config.hidden_size, config.ffn_width(layer)
        self.width, self.kind = W, config.mlp
        if config.mlp == "gelu":
            self.up_proj = nn.Linear(C, W, bias=config.bias)
        else:
            self.parts = {"gate_proj": W, "up_proj": W}
            self.gate_up_proj = nn.Linear(C, 2 * W, bias=config.bias)
        self.down_proj = nn.Linear(W, C, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gelu":
            return self.down_proj(F.gelu(self.up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.width, dim=-1)
        gate = F.silu(gate) if self.kind == "swiglu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * up)


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)): norms before each branch (pre_norms), on each branch's output
    (post_norms), or both; or GPT-NeoX's parallel form, both branches reading x."""

    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        self.parallel, self.residual_scale = config.parallel_residual, config.residual_scale

        def norm(present: bool):
            return make_norm(config, config.hidden_size) if present else None

        self.attn_norm, self.mlp_norm = norm(config.pre_norms), norm(config.pre_norms)
        self.attn_post_norm, self.mlp_post_norm = norm(config.post_norms), norm(config.post_norms)
        self.attn = Attention(config, layer)
        self.mlp = MLP(config, layer)
        self.reduce: Callable | None = None  # tensor parallel (tp.py): sums each branch's partial output over ranks

    def branch(self, y: torch.Tensor, post_norm: nn.Module | None) -> torch.Tensor:
        """A branch's output as the residual adds it: summed over ranks, normed, scaled."""
        y = y if self.reduce is None else self.reduce(y)
        y = y if post_norm is None else post_norm(y)
        return y if self.residual_scale == 1.0 else y * self.residual_scale

    def forward(self, x, rope: dict, step: CacheStep | None = None) -> torch.Tensor:
        if self.parallel:  # GPT-NeoX: both branches read x; (attn + mlp) + x as the reference sums them
            attn = self.attn(self.attn_norm(x), rope, step)
            return x + self.branch(attn + self.mlp(self.mlp_norm(x)), None)
        y = self.attn(x if self.attn_norm is None else self.attn_norm(x), rope, step)
        h = x + self.branch(y, self.attn_post_norm)
        return h + self.branch(self.mlp(h if self.mlp_norm is None else self.mlp_norm(h)), self.mlp_post_norm)


# ----------------------------------------------------------------------------------------------------------------
# 3. The model


class DenseDecoder(nn.Module):
    """Decoder-only LM. forward returns float32 logits [B, T, vocab] (and the mean cross-entropy when labels are
    given, label -100 ignored). With input_pos it runs a cached step after setup_cache."""

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_batch_size = self.max_seq_len = 0
        self.tokens_prefilled = 0  # tokens prefilled by generation, in all (a chat's turns are checked on it)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def cache_bytes(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None) -> int:
        elem = torch.empty((), dtype=dtype or self.dtype).element_size()
        return sum(2 * max_batch_size * layer.attn.n_kv_heads * (max_seq_len + 1) * layer.attn.head_dim * elem
                   for layer in self.layers)

    def setup_cache(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None,
                    cache_class: type[KVCache] = KVCache) -> None:
        """Allocate the static KV cache, [max_batch_size, K, max_seq_len + 1, D] per layer (in `dtype`, default the
        model's), and the rotary tables for its slots. cache_class: a KVCache subclass (kernels.py's, on CPU)."""
        if not 0 < max_seq_len <= self.config.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} must be in 1..{self.config.max_position_embeddings} "
                             "(the model's context)")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        for layer in self.layers:
            layer.attn.kv_cache = None  # free the old cache before allocating the new one
        need, have = self.cache_bytes(max_batch_size, max_seq_len, dtype), available_memory(self.device)
        if need > have:
            raise ValueError(f"a KV cache of {max_seq_len} tokens x batch {max_batch_size} needs {need / 2**30:.1f} GiB; "
                             f"{self.device.type} has {have / 2**30:.1f} GiB available (a smaller max_seq_len fits)")
        for layer in self.layers:
            attn = layer.attn
            attn.kv_cache = cache_class(max_batch_size, attn.n_kv_heads, max_seq_len, attn.head_dim,
                                        dtype or self.dtype, self.device)
        slots = torch.arange(max_seq_len + 1, device=self.device)
        self.register_buffer("kv_slots", slots, persistent=False)  # [S + 1]
        for kind in self.rope_kinds():  # [S + 1, R] float32 each
            cos, sin = rope_tables(self.config, slots.float(), max_seq_len, kind == "local")
            self.register_buffer(f"rope_cos_{kind}", cos, persistent=False)
            self.register_buffer(f"rope_sin_{kind}", sin, persistent=False)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len

    def rope_kinds(self) -> tuple[str, ...]:
        return ("global", "local") if self.config.rope_local_theta is not None else ("global",)

    def _check_inputs(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None,
                      rows: torch.Tensor | None = None) -> None:
        """Eager-only checks (they read values, a host sync, so compiled steps skip them)."""
        if input_ids.ndim != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor [batch, tokens], got {input_ids.dtype} "
                             f"{list(input_ids.shape)}")
        B, T = input_ids.shape
        if T == 0:
            raise ValueError("input_ids has no tokens")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is out of range for the vocabulary of {self.config.vocab_size}")
        if input_pos is None:
            if T > self.config.max_position_embeddings:
                raise ValueError(f"{T} tokens exceed the context of {self.config.max_position_embeddings}")
            return
        if self.max_seq_len == 0:
            raise ValueError("call setup_cache(max_batch_size, max_seq_len) before a cached step (input_pos)")
        if B > self.max_batch_size:
            raise ValueError(f"batch {B} exceeds the cache's max_batch_size {self.max_batch_size}")
        if input_pos.shape not in ((T,), (B, T)):
            raise ValueError(f"input_pos must have shape [{T}] or [{B}, {T}] (one slot per token), got "
                             f"{list(input_pos.shape)}")
        if int(input_pos.max()) > self.max_seq_len or int(input_pos.min()) < 0:  # slot max_seq_len: the scratch slot
            raise ValueError(f"position {int(input_pos.max())} is outside the cache of {self.max_seq_len} tokens "
                             f"(context {self.config.max_position_embeddings})")
        if rows is not None and (rows.shape != (B,) or int(rows.min()) < 0 or int(rows.max()) >= self.max_batch_size):
            raise ValueError(f"rows must be [{B}] cache rows in 0..{self.max_batch_size - 1}")

    def cache_step(self, input_pos: torch.Tensor, attend: int, row_start: torch.Tensor | None = None,
                   rows: torch.Tensor | None = None) -> CacheStep:
        """The masks of a cached step over slots 0..attend-1 (see CacheStep)."""
        T = input_pos.shape[-1]
        slots = self.kv_slots[:attend]
        mask = slots <= input_pos[..., None]  # [T, A] or [B, T, A]: a token at slot p sees the keys at slots 0..p
        if row_start is not None:
            mask = mask & (slots >= row_start[:, None, None])  # [B, T, A]: padding is never seen
            mask = mask | (slots == input_pos[..., None])  # a padding token sees itself (no empty row)
        fresh = (attend == T and input_pos.ndim == 1 and row_start is None and not torch.compiler.is_compiling()
                 and int(input_pos[0]) == 0)  # a prefill of slots 0..T-1: exactly causal, SDPA's causal kernel
        step = CacheStep(input_pos, attend, None if fresh else (mask[:, None] if mask.ndim == 3 else mask), row_start,
                         rows)
        window = self.config.sliding_window
        if window is None or all(layer.attn.window is None for layer in self.layers):
            return step
        step.window = window
        if T == 1 and window < attend:  # decode: a sliding layer reads only its window's W slots
            first = input_pos.reshape(-1, 1) - (window - 1)  # [B or 1, 1]
            wanted = first + torch.arange(window, device=input_pos.device)  # [B or 1, W], < 0 before the first token
            seen = wanted >= (0 if row_start is None else row_start[:, None])
            step.window_slots = wanted.clamp(min=0)
            step.window_mask = seen[:, None, None, :]  # [B or 1, 1, 1, W]
        else:
            near = slots > input_pos[..., None] - window
            step.window_mask = sliding_mask(input_pos, attend, window) if fresh else (
                (mask & near)[:, None] if mask.ndim == 3 else mask & near)
        return step

    def hidden_states(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None, attend: int | None = None,
                      row_start: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states after the last norm, [B, T, C], in the model's dtype.

        Without input_pos: a full causal pass, no cache. With input_pos [T] (or [B, T]: a slot per row): a cached
        step that writes its keys and values at slots input_pos and attends over slots 0..attend-1 (a Python int: the
        fixed width of a compiled step; eager calls may leave it None for "the slots in use"). row_start [B]
        (left-padded batches): row b's tokens begin at slot row_start[b]; its positions count from there and the
        slots before it are never seen. rows [B]: the cache rows the batch's rows use (default 0..B-1)."""
        if not torch.compiler.is_compiling():
            self._check_inputs(input_ids, input_pos, rows)
        T = input_ids.shape[1]
        if input_pos is None:
            step, positions = None, torch.arange(T, device=input_ids.device)
            rope = {kind: rope_tables(self.config, positions.float(), T, kind == "local") for kind in self.rope_kinds()}
        else:
            step = self.cache_step(input_pos, int(input_pos.max()) + 1 if attend is None else attend, row_start, rows)
            positions = input_pos if row_start is None else (input_pos[None, :] - row_start[:, None]).clamp(min=0)
            rope = {kind: (getattr(self, f"rope_cos_{kind}")[positions], getattr(self, f"rope_sin_{kind}")[positions])
                    for kind in self.rope_kinds()}  # [T, R] or [B, T, R] each
        x = self.embed_tokens(input_ids)  # [B, T, C]
        if self.config.embed_scale is not None:  # the scale rounded to the model's dtype first, as Gemma does
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=x.device)
        rope = {kind: (cos.to(x.dtype), sin.to(x.dtype)) for kind, (cos, sin) in rope.items()}
        for layer in self.layers:
            x = layer(x, rope, step)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head: hidden states [..., C] -> float32 logits [..., vocab]."""
        logits = self.lm_head(hidden).float()
        if self.config.logits_divisor != 1.0:
            logits = logits / self.config.logits_divisor
        if self.config.final_softcap is not None:
            logits = torch.tanh(logits / self.config.final_softcap) * self.config.final_softcap
        return logits

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, *, attend: int | None = None,
                row_start: torch.Tensor | None = None, rows: torch.Tensor | None = None):
        logits = self.logits(self.hidden_states(input_ids, input_pos, attend, row_start, rows))  # [B, T, vocab]
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return logits, loss

    # -- loading ---------------------------------------------------------------------------------------------------

    def fused_parts(self, module_name: str) -> dict[str, int]:
        """{checkpoint prefix: rows} of the tensors a module is stacked from (itself alone for most modules)."""
        parent, _, leaf = module_name.rpartition(".")
        parts = getattr(self.get_submodule(parent), "parts", None) if leaf in ("qkv_proj", "gate_up_proj") else None
        return {f"{parent}.{p}": rows for p, rows in parts.items()} if parts else {module_name: 0}

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's tensors under checkpoint names (fused projections split back into their parts; a tied head
        left out): what convert.write_native saves and load_tensors reads."""
        state = {}
        for name, t in self.state_dict().items():
            module_name, _, attr = name.rpartition(".")
            parts = self.fused_parts(module_name)
            if name == "lm_head.weight" and self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
                continue
            rows = [r for r in parts.values()]
            pieces = t.split([t.shape[0] * r // sum(rows) for r in rows]) if len(parts) > 1 else [t]
            state.update({f"{prefix}.{attr}": piece for prefix, piece in zip(parts, pieces)})
        return state

    def load_tensors(self, tensors: dict[str, Callable[[], torch.Tensor]], device, dtype, source: str):
        """Fill a meta-device model from {checkpoint name: thunk returning the tensor}. A fused projection's tensor is
        its parts' tensors stacked by rows (for quantized layers too: every stored layout is row-major per output row)."""
        tied = self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear)  # a quantized head has its own
        expected = dict(self.state_dict(keep_vars=True))
        if tied:
            expected.pop("lm_head.weight")
        sources = {}  # model tensor name -> {checkpoint name: expected shape}
        for name, param in expected.items():
            module_name, _, attr = name.rpartition(".")
            parts = self.fused_parts(module_name)
            total = sum(parts.values())
            sources[name] = {f"{prefix}.{attr}": (param.shape[0] * rows // total, *param.shape[1:]) if total else
                             tuple(param.shape) for prefix, rows in parts.items()}
        wanted = [n for s in sources.values() for n in s]
        missing = [n for n in wanted if n not in tensors]
        unexpected = [n for n in tensors if n not in set(wanted)]
        if missing:
            raise CheckpointError(f"{source}: missing tensor {missing[0]!r}" + _more(missing))
        if unexpected:
            raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r}" + _more(unexpected))
        for name, parts in sources.items():
            pieces = []
            for part, shape in parts.items():
                t = tensors[part]()
                if tuple(t.shape) != tuple(shape):
                    raise CheckpointError(f"{source}: tensor {part!r} has shape {list(t.shape)}, expected {list(shape)}")
                pieces.append(t)
            t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
            module_name, _, attr = name.rpartition(".")
            module = self.get_submodule(module_name)
            keep = attr in getattr(module, "keep_dtype", ())  # quantization scales load as stored
            t = t.to(device=device, dtype=dtype if t.is_floating_point() and not keep else t.dtype)
            if attr in module._buffers:
                module._buffers[attr] = t
            else:
                setattr(module, attr, nn.Parameter(t, requires_grad=False))
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
        for module in self.modules():  # quantized linears repack for this device's kernels
            if hasattr(module, "finish_loading"):
                module.finish_loading()
        return self.eval()


def available_memory(device: torch.device) -> int:
    """Bytes a new allocation can take on device: free GPU memory; on the CPU the OS's MemAvailable, or less under
    an address-space limit (ulimit -v). Unknown: no limit."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    have = 1 << 62
    try:
        import resource

        with open("/proc/meminfo") as f:
            have = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY:
            with open("/proc/self/status") as f:
                used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
            have = min(have, max(0, limit - used))
    except (OSError, StopIteration, ValueError, ImportError):
        pass
    return have


def check_fits(config: DenseConfig, dtype: torch.dtype, device: torch.device, source: str,
               bytes_per_weight: float | None = None) -> None:
    """Refuse, before allocating anything, a config whose weights would not fit the device's available memory,
    naming its largest term (a config from the internet must not make us allocate hundreds of GB).
    bytes_per_weight: of the quantized layers (all but the embedding), when they are quantized."""
    elem = torch.empty((), dtype=dtype).element_size()
    embedding = config.vocab_size * config.hidden_size
    need = embedding * elem + (config.num_parameters() - embedding) * (bytes_per_weight or elem)
    have = available_memory(device)
    if need <= have:
        return
    C, L = config.hidden_size, config.num_hidden_layers
    terms = {f"vocab_size {config.vocab_size} x hidden_size {C}": config.vocab_size * C,
             f"num_hidden_layers {L} x (intermediate_size {config.ffn_width(0)} x hidden_size {C})":
                 L * config.ffn_width(0) * C,
             f"num_hidden_layers {L} x (attention heads {config.heads(0)} x head_dim {config.head_dim} x hidden_size "
             f"{C})": L * config.heads(0) * config.head_dim * C}
    raise CheckpointError(f"{source}: the config describes {config.num_parameters() / 1e9:.1f}B parameters, "
                          f"{need / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}, mostly "
                          f"{max(terms, key=terms.get)}; {device.type} has {have / 2**30:.1f} GiB available")


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def torch_dtype(name) -> torch.dtype | None:
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    return table.get(str(name).removeprefix("torch.")) if name else None


# ----------------------------------------------------------------------------------------------------------------
# 4. Sampling


def sample(logits: torch.Tensor, temperature=0.0, top_k=None, top_p=None, vocab_limit: int | None = None,
           noise: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> next ids [B, 1]. temperature, top_k and top_p: numbers for every row, or [B] tensors, a value
    per row (inputs of a compiled step, so new values need no new graph; per row, temperature 0 is greedy, top_k 0
    and top_p 1 are off). Everything stays on the device (no host sync): argmax(p / q) with q ~ Exp(1) samples from
    p without torch.multinomial; noise [B, V] gives those draws (default: drawn here from torch's generator)."""
    probs = probabilities(logits, temperature, top_k, top_p, vocab_limit)
    if probs is None:
        return mask_vocab(logits, vocab_limit).argmax(dim=-1, keepdim=True)
    noise = torch.empty_like(probs).exponential_(1) if noise is None else noise
    sampled = (probs / noise).argmax(dim=-1, keepdim=True)
    if not torch.is_tensor(temperature):
        return sampled
    greedy = mask_vocab(logits, vocab_limit).argmax(dim=-1, keepdim=True)  # the rows whose temperature is 0
    return torch.where(temperature[:, None] == 0, greedy, sampled)


def mask_vocab(logits: torch.Tensor, vocab_limit: int | None) -> torch.Tensor:
    """Padded embedding rows (ids >= vocab_limit, the tokenizer's size) are never sampled."""
    if vocab_limit is None or vocab_limit >= logits.shape[-1]:
        return logits
    return logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= vocab_limit, -math.inf)


def probabilities(logits: torch.Tensor, temperature, top_k=None, top_p=None,
                  vocab_limit: int | None = None) -> torch.Tensor | None:
    """The distribution sample() draws from, [..., V] float32 (None at temperature 0: greedy). Settings as in
    sample(); [B] tensors apply to the rows of [B, V] logits."""
    per_row = torch.is_tensor(temperature)
    if not per_row and temperature == 0:
        return None
    V = logits.shape[-1]
    logits = mask_vocab(logits.float(), vocab_limit)
    logits = logits / (temperature.clamp(min=1e-6)[:, None] if per_row else temperature)  # (greedy rows: unused)
    if torch.is_tensor(top_k):  # the k-th largest of each row, k = V where off
        k = torch.where(top_k > 0, top_k, V).clamp(max=V)
        kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, -math.inf)
    elif top_k is not None:
        kth = torch.topk(logits, min(top_k, V), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if torch.is_tensor(top_p) or (top_p is not None and top_p < 1.0):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        limit = top_p[:, None] if torch.is_tensor(top_p) else top_p
        drop = probs.cumsum(dim=-1) - probs > limit  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    return logits.softmax(dim=-1)
