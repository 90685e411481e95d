"""dense.py: one config-driven dense decoder-only transformer, with a static KV cache for fast decoding.

Read it top to bottom:
  1. DenseConfig: every architectural switch the supported families need (defaults = the ShellElastic model).
  2. The layers: norms, rotary embeddings, attention (+ static KV cache), MLP, the decoder block.
  3. DenseDecoder: the model, its cache and loading of the native checkpoint format.
  4. Sampling and generation: a prefill, then one fixed-shape decode step per token that torch.compile turns into
     a single graph (on CUDA, a single CUDA-graph replay).

Shapes: B batch, T tokens in this call, S cache length, H query heads, K key/value heads, D head_dim, C hidden size.
Foreign checkpoint layouts (Sprout, GermanGPT, OpenELM, GPT-NeoX, Llama, GGUF) are mapped in convert.py; this file
only knows its own tensor names.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DenseConfig", "DenseDecoder", "CheckpointError", "generate", "generate_tokens", "sample"]


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
                    "quantization", "source_format")
    ALIASES = {"rms_norm_eps": "norm_eps"}  # seed 000's name for the eps

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
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                bad(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for layer in range(self.num_hidden_layers):
            heads, kv, width = self.heads(layer), self.kv_heads(layer), self.ffn_width(layer)
            if heads <= 0 or kv <= 0 or width <= 0:
                bad(f"layer {layer}: heads ({heads}), key/value heads ({kv}) and FFN width ({width}) must be positive")
            if heads % kv:
                bad(f"layer {layer}: {heads} query heads do not divide into {kv} key/value heads")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            bad(f"rotary dimension {self.rope_dim} must be even and in 1..head_dim={self.head_dim}")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            bad("norm_eps and rope_theta must be positive")

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
        except TypeError as e:
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


def rope_tables(config: DenseConfig, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [num_positions, rope_dim] float32, laid out to match config.rope_layout. Computed on the CPU so
    every device gets the same numbers."""
    dim = config.rope_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim/2]
    positions = torch.arange(num_positions, dtype=torch.float32)
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
    """x: [B, T, heads, D]; cos, sin: [T, R] in x's dtype, R <= D. Rotates the first R channels of each head."""
    rot, keep = x[..., : cos.shape[-1]], x[..., cos.shape[-1]:]
    if layout == "half":  # (a, b) -> (-b, a) over the two halves
        a, b = rot.chunk(2, dim=-1)
        turned = torch.cat((-b, a), dim=-1)
    else:  # (even, odd) -> (-odd, even) within each pair
        turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    rot = rot * cos[None, :, None, :] + turned * sin[None, :, None, :]
    return torch.cat((rot, keep), dim=-1) if keep.shape[-1] else rot


class KVCache(nn.Module):
    """Static cache: keys and values of every position so far, preallocated once. [B, K, S, D] each."""

    def __init__(self, batch: int, kv_heads: int, seq_len: int, head_dim: int, dtype, device) -> None:
        super().__init__()
        shape = (batch, kv_heads, seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [B, K, T, D] at positions input_pos [T], in place; return the whole cache [B, K, S, D]."""
        k_cache, v_cache = self.k[: k.shape[0]], self.v[: k.shape[0]]
        k_cache.index_copy_(2, input_pos, k)
        v_cache.index_copy_(2, input_pos, v)
        return k_cache, v_cache


class Attention(nn.Module):
    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.heads(layer), config.kv_heads(layer), config.head_dim
        self.rope_layout = config.rope_layout
        q_width, kv_width, C = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, config.hidden_size
        self.q_proj = nn.Linear(C, q_width, bias=config.bias)
        self.k_proj = nn.Linear(C, kv_width, bias=config.bias)
        self.v_proj = nn.Linear(C, kv_width, bias=config.bias)
        self.gate_proj = nn.Linear(C, q_width, bias=config.bias) if config.attn_output_gate else None
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

    def forward(self, x, cos, sin, input_pos=None, mask=None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:  # q/k RMS-normalized within each head, before rotary
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, cos, sin, self.rope_layout)
        k = apply_rotary(k, cos, sin, self.rope_layout)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        gqa = self.n_kv_heads != self.n_heads  # SDPA shares each K/V head among H/K query heads, without copies
        if input_pos is not None:  # cached step: write this call's keys/values, attend over the first kv_len slots
            k, v = self.kv_cache.update(input_pos, k, v)
            kv_len = T if mask is None else mask.shape[-1]
            k, v = k[:, :, :kv_len], v[:, :, :kv_len]
        # no mask: a plain causal pass over this call's T tokens (no cache, or a prefill from position 0);
        # else mask [T, kv_len] hides the future and the slots not written yet
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.head_dim**-0.5,
                                           enable_gqa=gqa)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        if self.gate_proj is not None:
            y = y * torch.sigmoid(self.gate_proj(x))
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        C, W = config.hidden_size, config.ffn_width(layer)
        self.gate_proj = nn.Linear(C, W, bias=config.bias) if config.mlp == "swiglu" else None
        self.up_proj = nn.Linear(C, W, bias=config.bias)
        self.down_proj = nn.Linear(W, C, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(F.gelu(self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DenseConfig, layer: int) -> None:
        super().__init__()
        self.parallel = config.parallel_residual
        self.attn_norm = make_norm(config, config.hidden_size)
        self.attn = Attention(config, layer)
        self.mlp_norm = make_norm(config, config.hidden_size)
        self.mlp = MLP(config, layer)

    def forward(self, x, cos, sin, input_pos=None, mask=None) -> torch.Tensor:
        if self.parallel:  # GPT-NeoX: both branches read x; (attn + mlp) + x as the reference sums them
            return x + (self.attn(self.attn_norm(x), cos, sin, input_pos, mask) + self.mlp(self.mlp_norm(x)))
        h = x + self.attn(self.attn_norm(x), cos, sin, input_pos, mask)
        return h + self.mlp(self.mlp_norm(h))


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
        self.tokens_prefilled = 0  # tokens generate_tokens has prefilled, in all (a chat's turns are checked on it)
        self.init_rope()

    def init_rope(self, device=None) -> None:
        """(Re)build the rotary tables [max_position_embeddings, rope_dim] in float32 on `device`."""
        cos, sin = rope_tables(self.config, self.config.max_position_embeddings)
        device = device if device is not None else self.embed_tokens.weight.device
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate the static KV cache: [max_batch_size, K, max_seq_len, D] per layer, in the model's dtype."""
        if not 0 < max_seq_len <= self.config.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} must be in 1..{self.config.max_position_embeddings} "
                             "(the model's context)")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        for layer in self.layers:
            attn = layer.attn
            attn.kv_cache = KVCache(max_batch_size, attn.n_kv_heads, max_seq_len, attn.head_dim, self.dtype,
                                    self.device)
        self.register_buffer("kv_positions", torch.arange(max_seq_len, device=self.device), persistent=False)
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
            raise ValueError(f"input_pos must have shape [{T}] (one position per token), got {list(input_pos.shape)}")
        if int(input_pos.max()) >= self.max_seq_len or int(input_pos.min()) < 0:
            raise ValueError(f"position {int(input_pos.max())} is outside the cache of {self.max_seq_len} tokens "
                             f"(context {self.config.max_position_embeddings})")

    def hidden_states(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states after the last norm, [B, T, C], in the model's dtype. Without input_pos: a full causal
        pass, no cache. With input_pos [T]: a cached step writing positions input_pos (a prefill or a decode)."""
        if not torch.compiler.is_compiling():
            self._check_inputs(input_ids, input_pos)
        T = input_ids.shape[1]
        if input_pos is None:
            cos, sin, mask = self.rope_cos[:T], self.rope_sin[:T], None
        else:
            cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
            # Attend over the cache up to the last position written: all S slots in a compiled step (fixed shapes),
            # only the slots in use in an eager call (a prefill, or decoding without compile).
            kv_len = self.max_seq_len if torch.compiler.is_compiling() else int(input_pos.max()) + 1
            mask = self.kv_positions[None, :kv_len] <= input_pos[:, None]  # [T, kv_len]: query at p sees keys 0..p
            if kv_len == T and not torch.compiler.is_compiling() and int(input_pos[0]) == 0:
                mask = None  # a prefill of positions 0..T-1: exactly causal, SDPA's causal kernel does half the work
        x = self.embed_tokens(input_ids)  # [B, T, C]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, input_pos, mask)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None,
                labels: torch.Tensor | None = None):
        logits = self.lm_head(self.hidden_states(input_ids, input_pos)).float()  # [B, T, vocab]
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return logits, loss

    # -- loading ---------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str, device="cpu", dtype: torch.dtype | None = None,
                        quant: str | None = None) -> "DenseDecoder":
        """Load a checkpoint folder (or file). The native format is a folder with config.json and model.safetensors;
        other layouts (see convert.py) are mapped on the fly. The model is built on the meta device and each tensor
        is read (memory-mapped), checked, cast to `dtype` and moved to `device` one at a time, so only one copy of
        the weights is ever held. dtype=None: the checkpoint's declared torch_dtype, else float32.
        quant="int8" | "int4" | "nf4" | "llm.int8" loads (or makes) a weight-quantized variant (quantize.py)."""
        path = os.fspath(path)
        if quant is None and os.path.isdir(path) and not os.path.isfile(os.path.join(path, "model.safetensors")):
            import quantize

            saved = quantize.saved_variants(path)
            quant = next(iter(saved)) if len(saved) == 1 else None  # a folder holding only one quantized variant
        if quant is not None:
            import quantize

            return quantize.load_quantized(path, quant, device, dtype)
        config, tensors, declared = read_checkpoint(path)
        dtype = dtype or declared or torch.float32
        with torch.device("meta"):
            model = cls(config)
        return model.load_tensors(tensors, device, dtype, source=path)

    def load_tensors(self, tensors: dict[str, Callable[[], torch.Tensor]], device, dtype, source: str):
        """Fill a meta-device model from {native name: thunk returning the tensor}."""
        expected = dict(self.state_dict(keep_vars=True))
        if self.config.tie_word_embeddings:
            expected.pop("lm_head.weight")
        missing = [n for n in expected if n not in tensors]
        unexpected = [n for n in tensors if n not in expected]
        if missing:
            raise CheckpointError(f"{source}: missing tensor {missing[0]!r}" + _more(missing))
        if unexpected:
            raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r}" + _more(unexpected))
        for name, param in expected.items():
            t = tensors[name]()
            if tuple(t.shape) != tuple(param.shape):
                raise CheckpointError(f"{source}: tensor {name!r} has shape {list(t.shape)}, expected "
                                      f"{list(param.shape)}")
            module_name, _, attr = name.rpartition(".")
            module = self.get_submodule(module_name)
            keep = attr in getattr(module, "keep_dtype", ())  # quantization scales load as stored
            t = t.to(device=device, dtype=dtype if t.is_floating_point() and not keep else t.dtype)
            if attr in module._buffers:
                module._buffers[attr] = t
            else:
                setattr(module, attr, nn.Parameter(t, requires_grad=False))
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.init_rope(device)
        return self.eval()


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def open_safetensors(path: str) -> dict[str, Callable[[], torch.Tensor]]:
    """{name: thunk} over a memory-mapped safetensors file; a truncated or corrupt file is a CheckpointError."""
    from safetensors import safe_open

    try:
        handle = safe_open(path, framework="pt", device="cpu")
        names = list(handle.keys())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except Exception as e:  # safetensors raises its own error types for bad headers and short files
        raise CheckpointError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None

    def reader(name: str):
        def read() -> torch.Tensor:
            try:
                return handle.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"{path}: cannot read tensor {name!r} ({str(e).splitlines()[0]})") from None
        return read

    return {name: reader(name) for name in names}


def torch_dtype(name) -> torch.dtype | None:
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    return table.get(str(name).removeprefix("torch.")) if name else None


def read_checkpoint(path: str, weights: bool = True):
    """(config, {native name: thunk}, declared dtype or None) for any supported checkpoint. weights=False reads
    only the config of a native folder (whose weights may be a quantized variant, see quantize.py)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or folder")
    config_file = os.path.join(path, "config.json")
    if os.path.isdir(path) and os.path.isfile(config_file):
        raw = read_json(config_file)
        if raw.get("model_type", "dense") == "dense" and "dim" not in raw:  # native (seed 000 release) format
            config = DenseConfig.from_dict(raw, source=config_file)
            file = os.path.join(path, "model.safetensors")
            if not weights:
                return config, {}, torch_dtype(raw.get("torch_dtype"))
            if not os.path.isfile(file):
                raise CheckpointError(f"{path}: no model.safetensors beside config.json")
            return config, open_safetensors(file), torch_dtype(raw.get("torch_dtype"))
    import convert  # foreign layouts: family tables live there, not in the model

    return convert.read_foreign(path)


# ----------------------------------------------------------------------------------------------------------------
# 4. Sampling and generation


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           vocab_limit: int | None = None) -> torch.Tensor:
    """logits [B, V] -> next ids [B, 1]. Greedy at temperature 0. Everything stays on the device (no host sync):
    drawing argmax(p / q) with q ~ Exp(1) samples from p without torch.multinomial."""
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:  # padded embedding rows are never sampled
        logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= vocab_limit, -math.inf)
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(1)
    return (probs / noise).argmax(dim=-1, keepdim=True)


def decode_one_token(model: DenseDecoder, token: torch.Tensor, input_pos: torch.Tensor, temperature: float,
                     top_k: int | None, top_p: float | None, vocab_limit: int | None) -> torch.Tensor:
    """One decode step with fixed shapes: token [B, 1] at position input_pos [1] -> next token [B, 1]."""
    logits = model(token, input_pos=input_pos)[:, -1]
    return sample(logits, temperature, top_k, top_p, vocab_limit)


_compiled_decode: dict = {}


def compiled_decode_step(device: torch.device):
    """The decode step compiled once, whole (fullgraph), static shapes. On CUDA, mode "reduce-overhead": one
    CUDA-graph replay per token. On CPU, Inductor's decompose_mm_pass turns each M=1 matmul into a fused
    multiply-reduce (a GEMV) that reads the weights faster than the BLAS call it replaces: 1.6x decode, measured."""
    kind = torch.device(device).type
    if kind not in _compiled_decode:
        if kind == "cuda":
            options = {"mode": "reduce-overhead"}
        else:
            options = {"options": {"post_grad_fusion_options": {"decompose_mm_pass": {}}}}
        _compiled_decode[kind] = torch.compile(decode_one_token, fullgraph=True, dynamic=False, **options)
    return _compiled_decode[kind]


def cache_length(needed: int, context: int) -> int:
    """Cache sizes come in powers of two (>= 256) so prompts of different lengths reuse one compiled step."""
    return min(context, max(256, 1 << (needed - 1).bit_length()))


@torch.no_grad()
def generate_tokens(model: DenseDecoder, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, compile: bool = False, start_pos: int = 0,
                    vocab_limit: int | None = None) -> Iterator[torch.Tensor]:
    """Yield max_new_tokens new tokens [B, 1], one per step. input_ids [B, T] is prefilled at positions start_pos..;
    positions before start_pos must already be in the cache (a chat continuing its conversation). The last token
    yielded has not been fed to the model yet."""
    B, T = input_ids.shape
    needed = start_pos + T + max_new_tokens - 1
    if needed > model.config.max_position_embeddings:
        raise ValueError(f"{start_pos + T} tokens + {max_new_tokens} new exceed the context of "
                         f"{model.config.max_position_embeddings}")
    if model.max_seq_len < needed or model.max_batch_size < B:
        if start_pos:
            raise ValueError(f"the cache ({model.max_seq_len} tokens) is too small to continue to {needed} tokens")
        model.setup_cache(max(B, model.max_batch_size), cache_length(needed, model.config.max_position_embeddings))
    device = input_ids.device
    step = compiled_decode_step(device) if compile else decode_one_token
    hidden = model.hidden_states(input_ids, input_pos=torch.arange(start_pos, start_pos + T, device=device))
    model.tokens_prefilled += T
    logits = model.lm_head(hidden[:, -1]).float()  # the prefill needs the head at its last position only
    token = sample(logits, temperature, top_k, top_p, vocab_limit)
    yield token
    for i in range(max_new_tokens - 1):
        input_pos = torch.tensor([start_pos + T + i], device=device)
        token = step(model, token, input_pos, temperature, top_k, top_p, vocab_limit).clone()  # a CUDA graph
        yield token  # reuses its output buffer, hence the clone


@torch.no_grad()
def generate(model: DenseDecoder, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | list[int] | None = None,
             compile: bool = False) -> torch.Tensor:
    """[B, T] prompt -> [B, T + new] ids. Stops early once every row has produced an eos id; rows that finished
    earlier are padded with their eos id."""
    eos = torch.tensor([eos_id] if isinstance(eos_id, int) else (eos_id or []), device=input_ids.device)
    done = torch.zeros(input_ids.shape[0], 1, dtype=torch.bool, device=input_ids.device)
    out = [input_ids]
    for token in generate_tokens(model, input_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                                 top_p=top_p, compile=compile):
        if len(eos):
            token = torch.where(done, out[-1][:, -1:], token)  # a finished row repeats its eos
            done = done | torch.isin(token, eos)
        out.append(token)
        if len(eos) and bool(done.all()):
            break
    return torch.cat(out, dim=1)
