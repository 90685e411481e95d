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
D head_dim, C hidden size. This file imports nothing of the project but torch: foreign checkpoint layouts are mapped to
its tensor names in families.py and gguf_import.py, quantized linears live in quantized.py, and load.py puts a
checkpoint into a model (load.from_pretrained); generate.py runs it.
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
    # the block
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm" (with bias)
    norm_eps: float = 1e-5
    norm_gain_in_float32: bool = False  # RMSNorm: gain applied in float32, then cast (torch.nn.RMSNorm, Sprout);
    #                                     False: cast to the compute dtype first, then the gain (seed 000, Llama)
    qk_norm: str = "per_channel"  # "none" | "per_channel": RMSNorm per head, one gain per channel | "shared": one [D] gain
    attn_output_gate: bool = True  # attention output *= sigmoid(x W_gate^T), x the attention input
    mlp: str = "swiglu"  # "swiglu": down(silu(gate(x)) * up(x)) | "gelu": down(gelu(up(x))), exact gelu
    bias: bool = False  # biases on every linear of the blocks (not on lm_head)
    parallel_residual: bool = False  # x + attn(n1(x)) + mlp(n2(x)) instead of two sequential residuals
    tie_word_embeddings: bool = False

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

    @property
    def rope_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def validate(self) -> None:
        def bad(msg: str):
            raise CheckpointError(f"config: {msg}")

        choices = {"rope_precision": ("bfloat16", "float32"), "rope_layout": ("half", "interleaved"),
                   "norm": ("rmsnorm", "layernorm"), "qk_norm": ("none", "per_channel", "shared"),
                   "mlp": ("swiglu", "gelu")}
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
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
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

    def num_parameters(self) -> int:
        """Parameters the config describes (norm gains and biases included), without building the model."""
        C, total = self.hidden_size, self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        for layer in range(self.num_hidden_layers):
            q, kv, w = self.heads(layer) * self.head_dim, self.kv_heads(layer) * self.head_dim, self.ffn_width(layer)
            total += C * (q + 2 * kv) + q * C + (C * q if self.attn_output_gate else 0)
            total += C * w * (3 if self.mlp == "swiglu" else 2) + 4 * C
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
    gain_shape lets a flat per-channel gain [H * D] act on per-head input [..., H, D]."""

    def __init__(self, dim: int, eps: float, gain_shape: tuple[int, ...] | None = None,
                 gain_in_float32: bool = False) -> None:
        super().__init__()
        self.eps, self.gain_in_float32 = eps, gain_in_float32
        self.gain_shape = gain_shape or (dim,)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        gain = self.weight.view(self.gain_shape)
        return (h * gain).to(x.dtype) if self.gain_in_float32 else h.to(x.dtype) * gain


def make_norm(config: DenseConfig, dim: int) -> nn.Module:
    if config.norm == "layernorm":
        return nn.LayerNorm(dim, eps=config.norm_eps)
    return RMSNorm(dim, config.norm_eps, gain_in_float32=config.norm_gain_in_float32)


def rope_tables(config: DenseConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [P, rope_dim] float32 for float positions [P], laid out to match config.rope_layout. Each row
    depends only on its position, so a table for positions 0..P-1 equals these rows computed one at a time."""
    dim = config.rope_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim/2]
    inv_freq = inv_freq.to(positions.device)
    if config.rope_precision == "bfloat16":
        # Round each step to bfloat16; the product of two bfloat16 numbers is exact in float32, so rounding it once
        # gives the bfloat16 product.
        def bf16(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.bfloat16).float()

        angles = bf16(torch.outer(bf16(positions), bf16(inv_freq)))
    else:
        angles = torch.outer(positions, inv_freq)  # [P, dim/2]
    if config.rope_layout == "half":
        angles = torch.cat((angles, angles), dim=-1)  # channel i and i + dim/2 share an angle
    else:
        angles = angles.repeat_interleave(2, dim=-1)  # channels 2i and 2i + 1 share an angle
    cos, sin = angles.cos(), angles.sin()
    if config.rope_precision == "bfloat16":
        cos, sin = bf16(cos), bf16(sin)
    return cos, sin


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
    """What a cached step tells every attention layer: it writes keys/values at slots input_pos [T] and attends
    over slots 0..attend-1; mask [T, A] (or [B, 1, T, A]) hides the future, the slots not written yet and padding
    (None: a causal prefill from slot 0); row_start [B] (left-padded batches): where each row's tokens begin."""
    input_pos: torch.Tensor
    attend: int
    mask: torch.Tensor | None
    row_start: torch.Tensor | None = None


class KVCache(nn.Module):
    """Static cache: keys and values of every position so far, preallocated once: [B, K, S + 1, D] each. The extra
    last slot is scratch: tokens that are only padding (a fixed-size chunk's tail) write there, and nothing reads it.
    (kernels.py subclasses it for the CPU: a layout and an attention kernel that read only the slots in use.)"""

    def __init__(self, batch: int, kv_heads: int, seq_len: int, head_dim: int, dtype, device) -> None:
        super().__init__()
        shape = (batch, kv_heads, seq_len + 1, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [B, K, T, D] at slots input_pos [T], in place; return the whole cache [B, K, S + 1, D]."""
        k_cache, v_cache = self.k[: k.shape[0]], self.v[: k.shape[0]]
        k_cache.index_copy_(2, input_pos, k.to(k_cache.dtype))
        v_cache.index_copy_(2, input_pos, v.to(v_cache.dtype))
        return k_cache, v_cache

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: CacheStep, scale: float) -> torch.Tensor:
        """Write this step's k, v [B, K, T, D]; attend q [B, H, T, D] over slots 0..attend-1 -> [B, H, T, D]."""
        k, v = self.update(step.input_pos, k, v)
        k, v = k[:, :, :step.attend].to(q.dtype), v[:, :, :step.attend].to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask, is_causal=step.mask is None, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])  # K/V heads shared, no copies


class Attention(nn.Module):
    """Queries, keys, values (and the output gate) come from one fused projection: their weights are stacked by rows,
    so a step reads the input once and makes one matmul (checkpoints store the parts; loading stacks them)."""

    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.heads(layer), config.kv_heads(layer), config.head_dim
        self.rope_layout = config.rope_layout
        q_width, kv_width, C = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, config.hidden_size
        self.parts = {"q_proj": q_width, "k_proj": kv_width, "v_proj": kv_width}
        if config.attn_output_gate:
            self.parts["gate_proj"] = q_width
        self.qkv_proj = nn.Linear(C, sum(self.parts.values()), bias=config.bias)
        self.o_proj = nn.Linear(q_width, C, bias=config.bias)
        D, eps = self.head_dim, config.norm_eps
        if config.qk_norm == "per_channel":
            self.q_norm = RMSNorm(q_width, eps, gain_shape=(self.n_heads, D))
            self.k_norm = RMSNorm(kv_width, eps, gain_shape=(self.n_kv_heads, D))
        elif config.qk_norm == "shared":
            self.q_norm, self.k_norm = RMSNorm(D, eps), RMSNorm(D, eps)
        else:
            self.q_norm = self.k_norm = None
        self.kv_cache: KVCache | None = None

    def forward(self, x, cos, sin, step: CacheStep | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        parts = self.qkv_proj(x).split(list(self.parts.values()), dim=-1)
        q = parts[0].view(B, T, self.n_heads, self.head_dim)
        k = parts[1].view(B, T, self.n_kv_heads, self.head_dim)
        v = parts[2].view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:  # q/k RMS-normalized within each head, before rotary
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, cos, sin, self.rope_layout)
        k = apply_rotary(k, cos, sin, self.rope_layout)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        if step is None:  # no cache: a plain causal pass over this call's T tokens
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5,
                                               enable_gqa=self.n_kv_heads != self.n_heads)
        else:  # cached step: write this call's keys/values, attend over the cache
            y = self.kv_cache.attend(q, k, v, step, self.head_dim**-0.5)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        if len(parts) == 4:
            y = y * torch.sigmoid(parts[3])
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU's gate and up projections are fused like q/k/v (one matmul); GELU MLPs have up and down only."""

    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        C, W = config.hidden_size, config.ffn_width(layer)
        self.width = W
        if config.mlp == "swiglu":
            self.parts = {"gate_proj": W, "up_proj": W}
            self.gate_up_proj = nn.Linear(C, 2 * W, bias=config.bias)
        else:
            self.up_proj = nn.Linear(C, W, bias=config.bias)
        self.down_proj = nn.Linear(W, C, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "gate_up_proj"):
            return self.down_proj(F.gelu(self.up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.width, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        self.parallel = config.parallel_residual
        self.attn_norm = make_norm(config, config.hidden_size)
        self.attn = Attention(config, layer)
        self.mlp_norm = make_norm(config, config.hidden_size)
        self.mlp = MLP(config, layer)
        self.reduce: Callable | None = None  # tensor parallel (tp.py): sums each branch's partial output over ranks

    def branch(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.reduce is None else self.reduce(y)

    def forward(self, x, cos, sin, step: CacheStep | None = None) -> torch.Tensor:
        if self.parallel:  # GPT-NeoX: both branches read x; (attn + mlp) + x as the reference sums them
            attn = self.attn(self.attn_norm(x), cos, sin, step)
            return x + self.branch(attn + self.mlp(self.mlp_norm(x)))
        h = x + self.branch(self.attn(self.attn_norm(x), cos, sin, step))
        return h + self.branch(self.mlp(self.mlp_norm(h)))


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
        cos, sin = rope_tables(self.config, slots.float())
        self.register_buffer("kv_slots", slots, persistent=False)  # [S + 1]
        self.register_buffer("rope_cos", cos, persistent=False)  # [S + 1, R] float32
        self.register_buffer("rope_sin", sin, persistent=False)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len

    def _check_inputs(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None) -> None:
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
        if input_pos.shape != (T,):
            raise ValueError(f"input_pos must have shape [{T}] (one slot per token), got {list(input_pos.shape)}")
        if int(input_pos.max()) > self.max_seq_len or int(input_pos.min()) < 0:  # slot max_seq_len: the scratch slot
            raise ValueError(f"position {int(input_pos.max())} is outside the cache of {self.max_seq_len} tokens "
                             f"(context {self.config.max_position_embeddings})")

    def hidden_states(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None, attend: int | None = None,
                      row_start: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states after the last norm, [B, T, C], in the model's dtype.

        Without input_pos: a full causal pass, no cache. With input_pos [T]: a cached step that writes its keys and
        values at slots input_pos and attends over slots 0..attend-1 (a Python int: the fixed width of a compiled
        step; eager calls may leave it None for "the slots in use"). row_start [B] (left-padded batches): row b's
        tokens begin at slot row_start[b]; its positions count from there and the slots before it are never seen."""
        if not torch.compiler.is_compiling():
            self._check_inputs(input_ids, input_pos)
        T = input_ids.shape[1]
        step = None
        if input_pos is None:
            cos, sin = rope_tables(self.config, torch.arange(T, device=input_ids.device, dtype=torch.float32))
        else:
            if attend is None:
                attend = int(input_pos.max()) + 1
            slots = self.kv_slots[:attend]
            mask = slots <= input_pos[:, None]  # [T, A]: a token at slot p sees the keys at slots 0..p
            if row_start is None:
                cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [T, R]
                fresh = attend == T and not torch.compiler.is_compiling() and int(input_pos[0]) == 0
                if fresh:  # a prefill of slots 0..T-1: exactly causal, SDPA's causal kernel does half the work
                    mask = None
            else:
                positions = (input_pos[None, :] - row_start[:, None]).clamp(min=0)  # [B, T]
                cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [B, T, R]
                mask = mask & (slots >= row_start[:, None, None])  # [B, T, A]: padding is never seen
                mask = (mask | (slots == input_pos[:, None]))[:, None]  # a padding token sees itself (no empty row)
            step = CacheStep(input_pos, attend, mask, row_start)
        x = self.embed_tokens(input_ids)  # [B, T, C]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, step)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, *, attend: int | None = None,
                row_start: torch.Tensor | None = None):
        logits = self.lm_head(self.hidden_states(input_ids, input_pos, attend, row_start)).float()  # [B, T, vocab]
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


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           vocab_limit: int | None = None) -> torch.Tensor:
    """logits [B, V] -> next ids [B, 1]. Greedy at temperature 0. Everything stays on the device (no host sync):
    drawing argmax(p / q) with q ~ Exp(1) samples from p without torch.multinomial."""
    probs = probabilities(logits, temperature, top_k, top_p, vocab_limit)
    if probs is None:
        return mask_vocab(logits, vocab_limit).argmax(dim=-1, keepdim=True)
    noise = torch.empty_like(probs).exponential_(1)
    return (probs / noise).argmax(dim=-1, keepdim=True)


def mask_vocab(logits: torch.Tensor, vocab_limit: int | None) -> torch.Tensor:
    """Padded embedding rows (ids >= vocab_limit, the tokenizer's size) are never sampled."""
    if vocab_limit is None or vocab_limit >= logits.shape[-1]:
        return logits
    return logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= vocab_limit, -math.inf)


def probabilities(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                  vocab_limit: int | None = None) -> torch.Tensor | None:
    """The distribution sample() draws from, [..., V] float32 (None at temperature 0: greedy)."""
    if temperature == 0:
        return None
    logits = mask_vocab(logits.float(), vocab_limit) / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    return logits.softmax(dim=-1)
