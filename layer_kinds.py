"""layer_kinds.py: the layer kinds of particular families, beside dense.py's plain decoder. Each is a module with a
small config record of its own (RECORDS: what a family's reader puts in DenseConfig.extras, by name), and
`Decoder`, dense.DenseDecoder's subclass that builds them: a layer's mixer and MLP are whichever its config asks for,
and its memory (a KV cache, a state, both or none) is made by the mixer itself (setup_cache, cache_bytes).

Read it after dense.py: records -> attention's variants (soft-caps, sinks, head gates, q/k norms after the rotary,
Gemma 4's full-layer heads and shared keys and values) -> the layers whose memory is a state (Gated DeltaNet, the
short conv, Mamba2, and the hybrid of attention and Mamba2) -> activations -> mixtures of experts -> the layer
(residual scale, Gemma 4's per-layer inputs) -> the model (rotary kinds and scalings, the output head). Imports only
torch and dense.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import dense

# ----------------------------------------------------------------------------------------------------------------
# 1. The records: each kind's own config, in DenseConfig.extras by its name in RECORDS


@dataclass(frozen=True)
class AttentionExtras:
    softcap: float | None = None  # scores = cap * tanh(scores / cap) before the softmax (Gemma 2)
    sinks: bool = False  # a learned logit per head beside the keys' in each softmax: attention may go nowhere
    #                      (Granite SWA, gpt-oss)
    head_gate: bool = False  # the output gate with one gate per head (LFM3)
    norm_after_rope: bool = False  # the q/k norms after the rotary instead of before (Hunyuan)
    full_head_dim: int | None = None  # the full-attention layers' head size, rotated whole (Gemma 4)
    value_norm: bool = False  # values RMS-normed per head, no gain (Gemma 4)
    keys_are_values: bool = False  # full layers' values are their keys' projection, before its norm (Gemma 4)
    shared_layers: int = 0  # the last this many layers attend over the keys and values of the last earlier layer of
    #                         their kind, computing none (Gemma 4)


@dataclass(frozen=True)
class RotaryExtras:
    precision: str = "float32"  # "bfloat16": every step of the tables rounded (the native ShellElastic model)
    local_theta: float | None = None  # sliding-window layers rotate with this base, unscaled (Gemma 3)
    nope_layers: list[int] | None = None  # layers with no rotary embedding at all (SmolLM3)


@dataclass(frozen=True)
class LayerExtras:
    residual_scale: float = 1.0  # each branch's output times this before the residual add (Granite)
    per_layer_input: int = 0  # each layer adds a gated input of this width, from its own embedding table and the
    #                           token's embedding (Gemma 4's per-layer embeddings); 0: none
    layer_scalars: bool = False  # each layer's output times a learned scalar (Gemma 4)


@dataclass(frozen=True)
class OutputHead:
    divisor: float = 1.0  # logits / this (Granite)
    softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)
    rows: int | None = None  # a head of the first ids only (Apertus 1.5): the others never come out


@dataclass(frozen=True)
class GatedDeltaNetConfig:  # layer_types "linear_attention" (Qwen3.5)
    heads: tuple[int, int] = (16, 32)  # (key, value) heads
    head_dims: tuple[int, int] = (128, 128)  # (key, value) channels per head
    conv_kernel: int = 4  # the causal depthwise conv's width
    tiled_values: bool = False  # value head j reads key head j % key_heads (llama.cpp's qwen35 files); False:
    #                             j // (value_heads / key_heads) (transformers)
    beta_scale: float = 1.0  # beta = scale * sigmoid(b); 2 lets the delta rule's eigenvalues go negative (OLMo hybrid)
    norm_eps: float | None = None  # its output norm's eps (None: the config's norm_eps; OLMo hybrid: 1e-5)


@dataclass(frozen=True)
class ShortConvConfig:  # layer_types "conv" (LFM2)
    conv_kernel: int = 4


@dataclass(frozen=True)
class Mamba2Config:  # layer_types "mamba" (Granite 4.0 H, Nemotron-H) and "hybrid" (Falcon-H1)
    heads: tuple[int, int, int, int] = (0, 64, 1, 128)  # (heads, channels per head, groups of B and C, state size N)
    biases: tuple[bool, bool] = (False, True)  # biases on its projections, on its conv
    conv_kernel: int = 4
    norm: bool = True  # its gated RMSNorm before out_proj; False: y * silu(z) goes straight in (Falcon-H1)
    time_step_limit: tuple[float, float] = (0.0, math.inf)  # its dt clamped to this range (prompts' chunked form)


@dataclass(frozen=True)
class ExpertsConfig:  # a mixture of experts in place of the MLP (Mixtral, Qwen3-MoE, gpt-oss, GLM-4.5, ...)
    count: int = 8  # routed experts
    chosen: int = 2  # experts each token runs
    width: int = 0  # each expert's hidden width
    scoring: str = "softmax"  # the router's scores: a "softmax" over the experts, or each one's "sigmoid"
    renormalize: bool = True  # the chosen experts' scores divided by their sum
    choice_bias: bool = False  # a learned bias added to the scores for the choice only (e_score_correction_bias)
    groups: tuple[int, int] = (1, 1)  # (groups, groups kept): experts are chosen within the kept groups, each group
    #                                   scored by the sum of its two best (DeepSeek V3's grouped top-k)
    routed_scale: float = 1.0  # the chosen experts' weights times this
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    activation: str = "swiglu"  # each expert: "swiglu" | "geglu" (tanh-GELU gate: Gemma 4) | "clamped_swiglu"
    #                             (gpt-oss: biases, gate and up clamped, (up + 1) * gate * sigmoid(1.702 gate)) |
    #                             "relu2": down(relu(up(x))^2) (Nemotron-H)
    clamp: float = 7.0  # clamped_swiglu's limit
    shared_width: int = 0  # a shared expert, a SwiGLU MLP every token runs (relu2: a squared-ReLU one, Nemotron-H),
    #                        of this width (0: none)
    shared_gate: bool = False  # the shared expert's output times sigmoid(x . w) (Qwen2-MoE, Qwen3.5)
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is a plain one, intermediate_size wide
    router_norm: bool = False  # Gemma 4's router: it reads rms_norm(x) (no gain) times a learned scale [C] and
    #                            1/sqrt(C), and the chosen weights (renormalized) are times a learned scale per expert
    #                            (neither folds into the router's weight exactly: the norm is not linear, and the
    #                            per-expert scale comes after the softmax and the choice)
    beside_mlp: bool = False  # the experts run beside the layer's MLP, not in its place (Gemma 4): FamilyLayer sums
    #                           both, each post-normed, the experts pre-normed by their own norm, the router reading
    #                           the layer's un-normed h


RECORDS = {"attention": AttentionExtras, "rotary": RotaryExtras, "layer": LayerExtras, "head": OutputHead,
           "gated_deltanet": GatedDeltaNetConfig, "short_conv": ShortConvConfig, "mamba2": Mamba2Config,
           "experts": ExpertsConfig}
STATE_LAYERS = {"linear_attention": "gated_deltanet", "conv": "short_conv", "mamba": "mamba2", "hybrid": "mamba2"}


def record(config: dense.DenseConfig, name: str):
    """The config's record `name`, or that record's defaults."""
    return config.extras.get(name) or RECORDS[name]()


def head_size(config: dense.DenseConfig, layer: int) -> int:
    full = record(config, "attention").full_head_dim
    return full if full and config.window(layer) is None else config.head_dim


def kv_source(config: dense.DenseConfig, layer: int) -> int | None:
    """The layer whose keys and values this one reads instead of its own (AttentionExtras.shared_layers), or None."""
    first = config.num_hidden_layers - record(config, "attention").shared_layers
    if layer < first:
        return None
    return max(i for i in range(first) if config.attention_kind(i) == config.attention_kind(layer))


def rope_kind(config: dense.DenseConfig, layer: int) -> str | None:
    """Which rotary tables a layer uses: "base", "local" (sliding layers with their own base), or None."""
    rotary = record(config, "rotary")
    if rotary.nope_layers and layer in rotary.nope_layers:
        return None
    return "local" if rotary.local_theta is not None and config.window(layer) else "base"


def rope_dim(config: dense.DenseConfig, local: bool = False) -> int:
    """The rotated channels of a head: the local (sliding) kind's, or the base kind's."""
    full = record(config, "attention").full_head_dim
    if full and not local:
        return full
    return config.head_dim if config.rotary_dim is None else config.rotary_dim


# ----------------------------------------------------------------------------------------------------------------
# 2. Attention's variants


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """dense.attention written out, for what SDPA cannot do: soft-capped scores (Gemma 2), and sinks [H]: one more
    logit per head in the softmax, with no value (what the sink takes goes nowhere). Softmax in float32."""
    B, H, T, D = q.shape
    K, A = k.shape[1], k.shape[2]
    if mask is None:
        mask = dense.additive(torch.ones(T, A, dtype=torch.bool, device=q.device).tril(), q.dtype)
    folded, mask = dense.grouped(q, K, mask)  # [B, K, G*T, D]
    scores = (folded @ k.transpose(-1, -2)) * scale
    scores = scores if softcap is None else torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    if sinks is not None:  # query head k * G + g's sink beside its row's scores, dropped after the softmax
        G = H // K
        sink = sinks.float().view(K, G, 1, 1).expand(K, G, T, 1).reshape(K, G * T, 1).to(scores.dtype)
        scores = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
    probs = scores.softmax(dim=-1, dtype=torch.float32)
    return ((probs if sinks is None else probs[..., :-1]).to(q.dtype) @ v).reshape(B, H, T, D)


class ValueNorm(nn.Module):
    """Values [..., D] RMS-normed in float32 with no gain (Gemma 4)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class FamilyAttention(dense.Attention):
    """dense.Attention with what AttentionExtras asks: soft-capped scores and sinks, one output gate per head, the q/k
    norms after the rotary, the head size of full layers, values normed or taken from the keys' projection, and
    layers that read an earlier layer's keys and values (its memory is that layer's: setup_cache)."""

    def __init__(self, config: dense.DenseConfig, layer: int) -> None:
        super().__init__(config, layer, head_size(config, layer), rope_kind(config, layer))
        extras = record(config, "attention")
        self.softcap, self.norm_after_rope = extras.softcap, extras.norm_after_rope
        # reads: another layer's keys and values; keys_are_values: v is k's projection
        self.reads, self.keys_are_values = kv_source(config, layer), extras.keys_are_values and self.kind == "full"
        self.shares = extras.shared_layers > 0 and self.reads is None  # (its k, v may be read by a later layer)
        own_keys = self.reads is None
        self.k_norm = self.k_norm if own_keys else nn.Identity()
        self.v_norm = ValueNorm(config.norm_eps) if extras.value_norm and own_keys else nn.Identity()
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if extras.sinks else None

    def part_rows(self, config: dense.DenseConfig, layer: int) -> dict[str, int]:
        extras, q_width, kv_width = record(config, "attention"), self.n_heads * self.head_dim, \
            self.n_kv_heads * self.head_dim
        parts = {"q_proj": q_width}
        if kv_source(config, layer) is None:  # (a layer reading another's keys and values has no k, v of its own)
            keys_are_values = extras.keys_are_values and self.kind == "full"
            parts.update({"k_proj": kv_width} if keys_are_values else {"k_proj": kv_width, "v_proj": kv_width})
        if config.attn_output_gate or extras.head_gate:  # a gate per channel, or one per head (LFM3)
            parts["gate_proj"] = q_width if config.attn_output_gate else self.n_heads
        return parts

    def queries_keys_values(self, parts: dict, step: dense.Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = parts["q_proj"].shape
        q = self.placed(self.q_norm, parts["q_proj"].view(B, T, self.n_heads, self.head_dim), step).transpose(1, 2)
        if self.reads is not None:  # the keys and values of the layer it reads (its memory is that layer's)
            return (q, *step.carried[self.kind])
        k = parts["k_proj"].view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_norm(k if self.keys_are_values else parts["v_proj"].view(B, T, self.n_kv_heads, self.head_dim))
        k, v = self.placed(self.k_norm, k, step).transpose(1, 2), v.transpose(1, 2)
        if self.shares:
            step.carried[self.kind] = (k, v)
        return q, k, v

    def placed(self, norm: nn.Module, x: torch.Tensor, step: dense.Step) -> torch.Tensor:
        """Queries or keys [B, T, heads, D] normed, then rotated to their positions (Hunyuan: the other way round)."""
        return norm(self.rotated(x, step)) if self.norm_after_rope else self.rotated(norm(x), step)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self.softcap is None and self.sinks is None:
            return super().attention(q, k, v, mask)
        return capped_attention(q, k, v, mask, self.scale, self.softcap, self.sinks)

    def gated(self, y: torch.Tensor, parts: dict) -> torch.Tensor:
        gate = parts.get("gate_proj")
        if gate is None or gate.shape[-1] == y.shape[-1]:
            return super().gated(y, parts)
        B, T, _ = y.shape  # one gate per head (LFM3)
        return (y.view(B, T, self.n_heads, -1) * torch.sigmoid(gate)[..., None]).view(B, T, -1)

    def setup_cache(self, batch: int, seq_len: int, dtype, cache_class: type, model: dense.DenseDecoder) -> None:
        if self.reads is None:
            return super().setup_cache(batch, seq_len, dtype, cache_class, model)
        del self.memory  # (held as a plain attribute, not a submodule: the cache's tensors are named once, as
        object.__setattr__(self, "memory", model.layers[self.reads].mixer.memory)  # torch.export needs)

    def cache_bytes(self, batch: int, seq_len: int, dtype, cache_class: type, model: dense.DenseDecoder) -> int:
        return 0 if self.reads is not None else super().cache_bytes(batch, seq_len, dtype, cache_class, model)


# ----------------------------------------------------------------------------------------------------------------
# 3. Layers whose memory is a state: Gated DeltaNet (Qwen3.5), the short conv (LFM2) and Mamba2 (Granite 4.0 H). An
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

    def read(self, step: dense.Step, B: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The step's B rows of (window, recurrent), and keep [B, T] (False: padding)."""
        # a row whose step starts at position 0 begins a new sequence: its state is zeroed (a multiply, not a branch:
        # the same graph for every step)
        continuing = (step.input_pos[..., :1] != 0).reshape(-1, 1, 1)  # [B or 1, 1, 1]
        window = dense.cache_rows(self.window, step, B) * continuing
        recurrent = self.recurrent if self.recurrent is None else \
            dense.cache_rows(self.recurrent, step, B) * continuing[..., None]
        keep = (step.input_pos != self.scratch).expand(B, -1)
        if step.row_start is not None:
            keep = keep & (step.input_pos >= step.row_start[:, None])
        return window, recurrent, keep

    def write(self, step: dense.Step, window: torch.Tensor, recurrent: torch.Tensor | None) -> None:
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


class StateMixer(nn.Module):
    """What a mixer whose memory is a State shares: its memory made and its bytes said from its conv's shape and its
    matrices per row (a shape, or None: a conv alone)."""

    has_state = True
    matrices: tuple | None

    def setup_cache(self, batch: int, seq_len: int, dtype, cache_class: type, model: dense.DenseDecoder) -> None:
        channels, width = self.conv_weight.shape[0], self.conv_weight.shape[-1]
        self.memory = State(batch, seq_len, channels, width, self.matrices, model.dtype, model.device)

    def cache_bytes(self, batch: int, seq_len: int, dtype, cache_class: type, model: dense.DenseDecoder) -> int:
        """The conv window in the model's dtype and float32 matrices, per row."""
        channels, width = self.conv_weight.shape[0], self.conv_weight.shape[-1]
        return batch * (channels * (width - 1) * model.dtype.itemsize + 4 * math.prod(self.matrices or (0,)))


class GatedDeltaNet(StateMixer):
    """Qwen3.5's linear attention. One fused projection gives q, k, v (then a causal conv and silu), z (the output
    gate), and per value head b and a: a write strength beta = sigmoid(b) and a decay g = -exp(A_log) *
    softplus(a + dt_bias). q and k are L2-normalized; the delta rule runs on a [Dk, Dv] matrix per value head (a key
    head serves value_heads / key_heads of them); the output goes through an RMSNorm per head gated by silu(z)."""

    def __init__(self, config: dense.DenseConfig, layer: int) -> None:
        super().__init__()
        kind = config.extras["gated_deltanet"]
        (self.k_heads, self.v_heads), (self.k_dim, self.v_dim) = kind.heads, kind.head_dims
        self.tiled, self.matrices = kind.tiled_values, (self.v_heads, self.k_dim, self.v_dim)
        keys, values = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.parts = {"in_proj_qkv": 2 * keys + values, "in_proj_z": values, "in_proj_b": self.v_heads,
                      "in_proj_a": self.v_heads}
        self.in_proj = nn.Linear(config.hidden_size, sum(self.parts.values()), bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(2 * keys + values, 1, kind.conv_kernel))
        self.dt_bias, self.A_log = nn.Parameter(torch.ones(self.v_heads)), nn.Parameter(torch.zeros(self.v_heads))
        self.norm = dense.RMSNorm(self.v_dim, kind.norm_eps or config.norm_eps)
        self.beta_scale = kind.beta_scale
        self.out_proj = nn.Linear(values, config.hidden_size, bias=False)
        self.memory: nn.Module = dense.NoCache()

    def forward(self, x: torch.Tensor, step: dense.Step) -> torch.Tensor:
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


class ShortConv(StateMixer):
    """LFM2's gated short conv: b, c, h = in_proj(x); out_proj(c * conv(b * h)), the conv causal and depthwise over
    the last W inputs."""

    def __init__(self, config: dense.DenseConfig, layer: int) -> None:
        super().__init__()
        C = config.hidden_size
        self.in_proj, self.out_proj = nn.Linear(C, 3 * C, bias=False), nn.Linear(C, C, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(C, 1, config.extras["short_conv"].conv_kernel))
        self.matrices = None
        self.memory: nn.Module = dense.NoCache()

    def forward(self, x: torch.Tensor, step: dense.Step) -> torch.Tensor:
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


class Mamba2(StateMixer):
    """Mamba2's selective state space layer (state space duality). One projection gives z (the output gate), x with
    B and C (through a causal conv and silu) and a time step per head, dt = softplus(dt + dt_bias); each head keeps
    a [P, N] state that decays by e^(dt A), A = -exp(A_log), and takes dt x B^T; C reads it, D x is added, then an
    RMSNorm by groups of silu(z)-gated channels and out_proj. A group's B and C serve heads / groups heads."""

    def __init__(self, config: dense.DenseConfig, layer: int) -> None:
        super().__init__()
        kind = config.extras["mamba2"]
        (self.heads, self.head_dim, self.groups, self.state_size), (bias, conv_bias) = kind.heads, kind.biases
        inner, self.limit = self.heads * self.head_dim, kind.time_step_limit
        self.matrices = (self.heads, self.head_dim, self.state_size)
        self.sizes = [inner, inner + 2 * self.groups * self.state_size, self.heads]  # z, x|B|C, dt
        self.in_proj = nn.Linear(config.hidden_size, sum(self.sizes), bias=bias)
        self.conv_weight = nn.Parameter(torch.zeros(self.sizes[1], 1, kind.conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(self.sizes[1])) if conv_bias else None
        self.dt_bias, self.A_log, self.D = (nn.Parameter(torch.ones(self.heads)) for _ in range(3))
        self.norm = dense.RMSNorm(inner, config.norm_eps, gain_shape=(self.groups, inner // self.groups)) \
            if kind.norm else nn.Identity()
        self.out_proj = nn.Linear(inner, config.hidden_size, bias=bias)
        self.memory: nn.Module = dense.NoCache()

    def forward(self, x: torch.Tensor, step: dense.Step) -> torch.Tensor:
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

    def __init__(self, config: dense.DenseConfig, layer: int) -> None:
        super().__init__()
        self.mamba, self.attention = Mamba2(config, layer), FamilyAttention(config, layer)

    def forward(self, x: torch.Tensor, step: dense.Step) -> torch.Tensor:
        return self.mamba(x, step) + self.attention(x, step)

# ----------------------------------------------------------------------------------------------------------------
# 4. Activations with learned parameters or shapes of their own


class XIELU(nn.Module):
    """xIELU (Apertus; arXiv 2411.13010), as transformers computes it: alpha_p x^2 + beta x where x > 0, else
    alpha_n (expm1(min(x, eps)) - x) + beta x, with alpha_p = softplus(a_p), alpha_n = beta + softplus(a_n) learned
    per layer (a_p, a_n as stored) and beta, eps stored beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p, self.alpha_n = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
        self.register_buffer("beta", torch.tensor(0.5))
        self.register_buffer("eps", torch.tensor(-1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p, alpha_n = F.softplus(self.alpha_p), self.beta + F.softplus(self.alpha_n)
        negative = (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n
        return torch.where(x > 0, alpha_p * x * x, negative) + self.beta * x


class ReLU2(nn.Module):
    """relu(x)^2 (Nemotron-H's MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).square()


ACTIVATIONS = {"xielu": XIELU, "relu2": ReLU2}  # config.mlp -> the activation of dense.MLP
MIXERS = {"linear_attention": GatedDeltaNet, "conv": ShortConv, "mamba": Mamba2, "hybrid": Hybrid}  # layer_types


# ----------------------------------------------------------------------------------------------------------------
# 5. Mixtures of experts: a router picks a few of many MLPs for each token, and only those run


class Experts(nn.Module):
    """The MLP of a mixture (ExpertsConfig): a router scores every expert from x, each token runs the `chosen` best and
    sums their outputs by their weights, plus a shared expert's where there is one. The experts' weights are stacked:
    experts_gate_up [E, 2I, C] (gate rows, then up rows; relu2: up rows alone [E, I, C]), experts_down [E, C, I]."""

    def __init__(self, config: dense.DenseConfig, layer: int) -> None:
        super().__init__()
        self.spec = spec = record(config, "experts")
        C, E, I = config.hidden_size, spec.count, spec.width
        rows = I if spec.activation == "relu2" else 2 * I
        self.router = nn.Linear(C, E, bias=spec.router_bias)
        self.choice_bias = nn.Parameter(torch.zeros(E)) if spec.choice_bias else None
        self.experts_gate_up = nn.Parameter(torch.empty(E, rows, C))
        self.experts_down = nn.Parameter(torch.empty(E, C, I))
        biased = spec.activation == "clamped_swiglu"
        self.experts_gate_up_bias = nn.Parameter(torch.zeros(E, rows)) if biased else None
        self.experts_down_bias = nn.Parameter(torch.zeros(E, C)) if biased else None
        self.shared = None
        if spec.shared_width:  # a SwiGLU MLP of its own width (relu2: up and down alone)
            shared = dense.DenseConfig(**{**vars(config), "intermediate_size": spec.shared_width, "mlp": "swiglu",
                                          "bias": False})
            self.shared = dense.MLP(shared, layer, ReLU2()) if spec.activation == "relu2" else \
                dense.GatedMLP(shared, layer)
        self.shared_gate = nn.Linear(C, 1, bias=False) if spec.shared_gate else None
        if spec.router_norm:  # Gemma 4
            self.router_norm = ValueNorm(config.norm_eps)
            self.router_scale, self.expert_scale = nn.Parameter(torch.ones(C)), nn.Parameter(torch.ones(E))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, C] -> (weights [N, k] float32, chosen experts [N, k])."""
        spec = self.spec
        if spec.router_norm:
            x = self.router_norm(x) * self.router_scale * x.shape[-1] ** -0.5
        logits = self.router(x).float()
        scores = logits.softmax(-1) if spec.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.choice_bias is None else scores + self.choice_bias.float()
        groups, kept = spec.groups
        if groups > 1:  # the experts of the `kept` best groups only
            by_group = choice.view(x.shape[0], groups, -1)
            best = by_group.topk(2, dim=-1).values.sum(-1).topk(kept, dim=-1).indices  # [N, kept]
            keep = torch.zeros_like(by_group[..., 0], dtype=torch.bool).scatter(1, best, True)  # [N, groups]
            choice = by_group.masked_fill(~keep.unsqueeze(-1), -math.inf).flatten(1)
        chosen = choice.topk(spec.chosen, dim=-1).indices
        weights = scores.gather(1, chosen)
        if spec.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
        if spec.router_norm:
            weights = weights * self.expert_scale[chosen]
        return weights * spec.routed_scale, chosen

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """An expert's hidden [.., 2I] (relu2: [.., I]) -> [.., I]."""
        if self.spec.activation == "relu2":
            return torch.relu(h).square()
        gate, up = h.chunk(2, dim=-1)
        if self.spec.activation == "clamped_swiglu":
            gate, up = gate.clamp(max=self.spec.clamp), up.clamp(-self.spec.clamp, self.spec.clamp)
            return (up + 1) * gate * torch.sigmoid(gate * 1.702)
        if self.spec.activation == "geglu":
            return F.gelu(gate, approximate="tanh") * up
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor, routed: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, C]; routed: what the router reads where it is not x (Gemma 4: h before the experts' norm)."""
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        weights, chosen = self.route(flat if routed is None else routed.reshape(-1, C))
        if torch.compiler.is_compiling():
            y = self.gathered(flat, weights.to(x.dtype), chosen)
        else:
            y = self.grouped(flat, weights.to(x.dtype), chosen)
        if self.shared is not None:
            shared = self.shared(flat)
            y = y + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(flat)) * shared)
        return y.view(B, T, C)

    def gathered(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each (token, chosen expert) pair with that expert's weights gathered [N, k, ...]: fixed shapes, one graph
        (a compiled step)."""
        h = torch.einsum("nc,nkhc->nkh", x, self.experts_gate_up[chosen])  # [N, k, 2I]
        if self.experts_gate_up_bias is not None:
            h = h + self.experts_gate_up_bias[chosen]
        y = torch.einsum("nki,nkci->nkc", self.activate(h), self.experts_down[chosen])  # [N, k, C]
        if self.experts_down_bias is not None:
            y = y + self.experts_down_bias[chosen]
        return (y * weights.unsqueeze(-1)).sum(1)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each chosen expert once, over the tokens that chose it (an eager pass: a prompt's tokens share each
        expert's weights)."""
        y = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            token, slot = (chosen == e).nonzero(as_tuple=True)
            h = F.linear(x[token], self.experts_gate_up[e], None if self.experts_gate_up_bias is None else
                         self.experts_gate_up_bias[e])
            out = F.linear(self.activate(h), self.experts_down[e], None if self.experts_down_bias is None else
                           self.experts_down_bias[e])
            y.index_add_(0, token, out * weights[token, slot].unsqueeze(-1))
        return y


# ----------------------------------------------------------------------------------------------------------------
# 6. The layer and the model


class FamilyLayer(dense.DecoderLayer):
    """dense.DecoderLayer with LayerExtras: each branch scaled before its residual add (Granite), Gemma 4's experts
    beside the MLP (ExpertsConfig.beside_mlp), then Gemma 4's h + norm(proj(gelu(gate(h)) * its per-layer input)), and
    its learned scalar."""

    def __init__(self, config: dense.DenseConfig, layer: int, mixer: nn.Module, mlp: nn.Module | None) -> None:
        super().__init__(config, layer, mixer, mlp)
        extras = record(config, "layer")
        self.residual_scale, self.index, P = extras.residual_scale, layer, extras.per_layer_input
        if P:
            self.per_layer_gate = nn.Linear(config.hidden_size, P, bias=False)
            self.per_layer_proj = nn.Linear(P, config.hidden_size, bias=False)
            self.per_layer_norm, self.per_layer_act = dense.make_norm(config, config.hidden_size), nn.GELU("tanh")
        self.layer_scalar = nn.Parameter(torch.ones(1)) if extras.layer_scalars else None
        experts = config.extras.get("experts")
        beside = experts and experts.beside_mlp and mlp is not None and layer not in experts.dense_layers
        self.experts = Experts(config, layer) if beside else None
        if self.experts is not None:  # (Gemma 4) the experts' pre- and post-norm, the MLP's own post-norm
            self.experts_norm, self.experts_post_norm, self.mlp_branch_post_norm = (
                dense.make_norm(config, config.hidden_size) for _ in range(3))

    def scaled(self, y: torch.Tensor) -> torch.Tensor:  # (1.0: no multiply in the graph)
        return y if self.residual_scale == 1.0 else y * self.residual_scale

    def forward(self, x: torch.Tensor, step: dense.Step) -> torch.Tensor:
        if self.parallel:
            branches = self.mixer(self.mixer_norm(x), step) + self.mlp(self.mlp_norm(x))
            return x + self.scaled(self.mixer_post_norm(branches))
        h = x + self.scaled(self.mixer_post_norm(self.mixer(self.mixer_norm(x), step)))
        if self.experts is not None:  # Gemma 4: the MLP and the experts beside it, their sum post-normed
            y = self.mlp_branch_post_norm(self.mlp(self.mlp_norm(h))) + \
                self.experts_post_norm(self.experts(self.experts_norm(h), routed=h))
            h = h + self.scaled(self.mlp_post_norm(y))
        elif self.mlp is not None:
            h = h + self.scaled(self.mlp_post_norm(self.mlp(self.mlp_norm(h))))
        if "per_layer" in step.carried:
            gated = self.per_layer_act(self.per_layer_gate(h)) * step.carried["per_layer"][:, :, self.index]
            h = h + self.per_layer_norm(self.per_layer_proj(gated))
        return h if self.layer_scalar is None else h * self.layer_scalar


def family_frequencies(config: dense.DenseConfig, seq_len: int, base: float, dim: int,
                       scaling: dict) -> tuple[torch.Tensor, float]:
    """dense.rope_frequencies, and the rarer scalings, as transformers computes them: a GGUF's divisor per frequency
    ("factors"), Phi-3's longrope, Gemma 4's proportional."""
    powers = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # [R/2]
    kind, original = scaling["rope_type"], scaling.get("original_max_position_embeddings")
    original = original or config.max_position_embeddings
    if kind == "factors":
        return 1.0 / powers / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    if kind == "longrope":  # its long factors when seq_len exceeds the original context (a cache longer than that:
        # every position, as llama.cpp chooses by its context size), its short ones otherwise
        factor = scaling.get("factor") or config.max_position_embeddings / original
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = scaling["long_factor"] if seq_len > original else scaling["short_factor"]
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * powers), attention
    if kind == "proportional":  # the first partial_rotary_factor of the pairs turn as plain rope over the whole
        # head, the rest not at all (frequency 0)
        turned = int(scaling["partial_rotary_factor"] * len(powers))
        inv_freq = 1.0 / powers / scaling.get("factor", 1.0)
        return torch.where(torch.arange(len(powers)) < turned, inv_freq, torch.zeros(())), 1.0
    return dense.rope_frequencies(config, seq_len, base, dim, scaling)


class Decoder(dense.DenseDecoder):
    """The model the engine loads: dense.DenseDecoder with every kind here (each layer's mixer by layer_types, its
    MLP's activation, the layer's extras, the rotary's kinds, scalings and precision, Gemma 4's per-layer inputs, the
    output head's extras), and an eager call's inputs checked."""

    extras_built = frozenset(RECORDS)

    def __init__(self, config: dense.DenseConfig) -> None:
        super().__init__(config)
        self.head, P = record(config, "head"), record(config, "layer").per_layer_input
        if self.head.rows is not None and self.head.rows != config.vocab_size:  # a pruned head (never tied)
            self.lm_head = nn.Linear(config.hidden_size, self.head.rows, bias=False)
        if P:  # Gemma 4: a second table, every layer's input side by side, and a projection
            LP = config.num_hidden_layers * P
            self.embed_per_layer = nn.Embedding(config.vocab_size, LP)
            self.per_layer_projection = nn.Linear(config.hidden_size, LP, bias=False)
            self.per_layer_norm = dense.make_norm(config, P)

    def hidden_states(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None, attend: int | None = None,
                      row_start: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                      causal: bool = False) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            self.check_inputs(input_ids, input_pos, rows, causal)
        return super().hidden_states(input_ids, input_pos, attend, row_start, rows, causal)

    def check_inputs(self, ids: torch.Tensor, pos: torch.Tensor | None, rows: torch.Tensor | None, causal: bool):
        """An eager call's inputs, one ValueError each (they read values, a host sync: compiled steps skip them)."""
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        require(ids.ndim == 2 and ids.dtype in (torch.int64, torch.int32),
                f"input_ids must be an integer tensor [batch, tokens], got {ids.dtype} {list(ids.shape)}")
        (B, T), S, held, context = ids.shape, self.max_seq_len, self.max_batch_size, self.config.max_position_embeddings
        require(T > 0, "input_ids has no tokens")
        lo, hi = int(ids.min()), int(ids.max())
        require(0 <= lo and hi < self.config.vocab_size,
                f"token id {lo if lo < 0 else hi} is out of range for the vocabulary of {self.config.vocab_size}")
        require(pos is not None or T <= context, f"{T} tokens exceed the context of {context}")
        if pos is None:
            return
        require(S > 0, "call setup_cache(max_batch_size, max_seq_len) before a cached step (input_pos)")
        require(B <= held, f"batch {B} exceeds the cache's max_batch_size {held}")
        require(pos.shape in ((T,), (B, T)),
                f"input_pos must have shape [{T}] or [{B}, {T}] (one slot per token), got {list(pos.shape)}")
        require(0 <= int(pos.min()) and int(pos.max()) <= S,  # slot S: the scratch slot
                f"position {int(pos.max())} is outside the cache of {S} tokens (context {context})")
        require(rows is None or (rows.shape == (B,) and 0 <= int(rows.min()) and int(rows.max()) < held),
                f"rows must be [{B}] cache rows in 0..{held - 1}")
        require(not causal or (pos.ndim == 1 and int(pos[0]) == 0 and int(pos[-1]) == T - 1),
                "a causal step writes slots 0..T-1 of every row")

    def make_layer(self, i: int) -> dense.DecoderLayer:
        if "layer" not in self.config.extras and not record(self.config, "experts").beside_mlp:
            return super().make_layer(i)
        return FamilyLayer(self.config, i, self.make_mixer(i), self.make_mlp(i))

    def make_mixer(self, i: int) -> nn.Module:
        kind, extras = self.config.layer_type(i), self.config.extras
        if kind in MIXERS:
            return MIXERS[kind](self.config, i)
        return FamilyAttention(self.config, i) if "attention" in extras or "rotary" in extras else \
            super().make_mixer(i)

    def make_mlp(self, i: int) -> nn.Module | None:
        experts = self.config.extras.get("experts")
        if experts and i not in experts.dense_layers and not experts.beside_mlp:  # (beside: FamilyLayer's)
            return Experts(self.config, i)
        if self.config.mlp in ACTIVATIONS and self.config.ffn_width(i):
            return dense.MLP(self.config, i, ACTIVATIONS[self.config.mlp]())
        return super().make_mlp(i)

    def rope_frequencies(self, seq_len: int, kind: str) -> tuple[torch.Tensor, float]:
        """"local": the sliding layers' own base, unscaled; "base": the config's scaling over rope_dim's channels."""
        local = kind == "local"
        scaling = {"rope_type": "plain"} if local else self.config.rope_scaling or {"rope_type": "plain"}
        base = record(self.config, "rotary").local_theta if local else self.config.rope_theta
        return family_frequencies(self.config, seq_len, base, rope_dim(self.config, local), scaling)

    def rope_tables(self, positions: torch.Tensor, seq_len: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """bfloat16 precision: every step of the tables rounded."""
        frequencies = self.rope_frequencies(seq_len, kind)
        if record(self.config, "rotary").precision == "bfloat16":
            return dense.rope_tables(self.config, positions, frequencies, lambda t: t.to(torch.bfloat16).float())
        return dense.rope_tables(self.config, positions, frequencies)

    def embed(self, input_ids: torch.Tensor, step: dense.Step) -> torch.Tensor:
        x = super().embed(input_ids, step)
        if hasattr(self, "embed_per_layer"):
            step.carried["per_layer"] = self.per_layer_inputs(input_ids, x)
        return x

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gemma 4's per-layer inputs [B, T, L, P]: the token's row of the second table (times sqrt(P)) and a
        projection of its embedding x (normed per layer), averaged (times 1/sqrt(2), as the reference)."""
        B, T, C = x.shape
        L, P = self.config.num_hidden_layers, record(self.config, "layer").per_layer_input
        tokens = self.embed_per_layer(input_ids).to(x.dtype) * torch.tensor(P ** 0.5, dtype=x.dtype, device=x.device)
        context = self.per_layer_norm((self.per_layer_projection(x) * C ** -0.5).view(B, T, L, P))
        return (context + tokens.view(B, T, L, P)) * 2 ** -0.5

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().logits(hidden)
        if self.head.divisor != 1.0:
            logits = logits / self.head.divisor
        if self.head.softcap is not None:
            logits = torch.tanh(logits / self.head.softcap) * self.head.softcap
        if logits.shape[-1] < self.config.vocab_size:  # a pruned head (Apertus 1.5): the ids past it never come
            # out; -1e30, not -inf, so that a sampler's entropy stays a number
            logits = F.pad(logits, (0, self.config.vocab_size - logits.shape[-1]), value=-1e30)
        return logits
