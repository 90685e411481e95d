"""tp.py: tensor parallelism over torch.distributed, Megatron style. N processes (launched by torchrun) each hold
1/N of every block's attention heads and FFN width, and add up their partial outputs with one all-reduce per
residual branch.

    torchrun --nproc-per-node 2 my_script.py          # each process:
    tp.setup("cpu")                                     # gloo on CPU, NCCL on CUDA
    model = tp.from_pretrained(path)                    # this rank's shard; logits equal the single-process model's

A rank's shard, per block (rank r of N):
  q, k, v, the output gate, the MLP's gate and up: split by output rows, whole heads for attention: rank r keeps
      query heads [r H/N, (r+1) H/N) and the key/value heads they use. With fewer key/value heads than ranks each
      rank keeps the one its queries use (replicated).
  o_proj, down_proj: split by input columns, so each rank's product is a partial sum; the all-reduce adds them (a
      bias is added by rank 0 only). GPT-NeoX's parallel residual adds attention and MLP first: one all-reduce.
  a Gated DeltaNet layer: its key heads split as query heads are, each with the value heads that read it (their q, k,
      v rows and conv channels, z, a, b, decays, states; out_proj by their columns); LFM2's short conv: whole on
      every rank, its out_proj rank 0's alone (the others' zeros add nothing).
  embedding, norms, output head: replicated (whole logits on every rank, no gather; every rank samples the same token
      from the same logits with the same seed). Gemma 4's per-layer inputs (their table, projections and norms) act
      on the residual stream every rank holds whole: replicated; a layer that reads an earlier layer's keys and values
      reads that layer's shard, the same heads.
dense.py knows none of this: a shard is an ordinary DenseDecoder whose config has H/N heads and W/N FFN width per
layer, loaded through the loader's one hook (`shard=` in load.from_pretrained), and tp.py adds the all-reduces to the
built model as hooks (a functional collective, so a compiled step stays one graph). Stands on dense.py,
layer_kinds.py, formats/families/ and load.py.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import dense
import layer_kinds
from dense_engine.formats import families, load
from dense_engine.system.errors import CheckpointError
from layer_kinds import record


def world() -> tuple[int, int]:
    """(rank, world size): of the process group, else what torchrun set in the environment, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def setup(device_type: str) -> tuple[int, int]:
    """Join the process group torchrun describes (gloo on CPU, NCCL on CUDA); (rank, world size)."""
    rank, size = world()
    if size > 1 and not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return world()


def exit(code: int) -> None:
    """End a rank's process: leave the group, flush, and skip the interpreter's teardown (destroying the process
    group's C++ threads at exit aborts now and then: 'terminate called without an active exception')."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def broadcast(value):
    """Rank 0's value on every rank (what rank 0 read from the terminal or stdin); the value itself when alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(flag: bool, device) -> bool:
    """Rank 0's flag on every rank (one small broadcast: cheap enough to ask after every token)."""
    box = torch.tensor([int(flag)], device=device)
    dist.broadcast(box, src=0)
    return bool(box.item())


def gather(value) -> list:
    """Every rank's value, in rank order (on every rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# ----------------------------------------------------------------------------------------------------------------
# What each rank keeps


@dataclasses.dataclass(frozen=True)
class LayerShard:
    heads: tuple[int, int]  # query heads [start, stop)
    kv_heads: tuple[int, int]  # key/value heads
    ffn: tuple[int, int]  # FFN columns
    key_heads: tuple[int, int] = (0, 0)  # a Gated DeltaNet layer's key heads [start, stop)
    value_heads: tuple[int, ...] = ()  # and the value heads they serve, in the rank's order
    mamba_heads: tuple[int, int] = (0, 0)  # a Mamba2 mixer's heads [start, stop)
    mamba_groups: tuple[int, int] = (0, 0)  # and the groups of B and C they read (shared by ranks where G < ranks)
    experts: tuple[int, int] = (0, 0)  # a mixture's columns of every expert's width [start, stop)
    shared: tuple[int, int] = (0, 0)  # and of its shared expert's


def plan(config: dense.DenseConfig, rank: int, size: int) -> list[LayerShard]:
    """Each layer's slice for this rank; a width that does not divide by the number of ranks is an error naming the
    layer and the numbers (before any weight is read)."""
    if config.qk_norm == "whole" and size > 1:
        raise CheckpointError("its q/k norms are taken over every head's channels at once (OLMo 2): they cannot be "
                              "split across ranks")
    if record(config, "attention").sinks and size > 1:
        raise CheckpointError("its attention sinks (Granite SWA) are not split across ranks yet")
    if record(config, "attention").head_gate and size > 1:
        raise CheckpointError("its attention's gate per head (LFM3) is not split across ranks yet")
    experts = expert_columns(config, rank, size)
    shards = []
    for i in range(config.num_hidden_layers):
        H, K, W = config.heads(i), config.kv_heads(i), config.ffn_width(i)
        if H % size:
            raise CheckpointError(f"layer {i}: {H} attention heads do not divide over {size} ranks")
        if K % size and size % K:
            raise CheckpointError(f"layer {i}: {K} key/value heads can neither be split nor replicated over {size} "
                                  "ranks (one must divide the other)")
        if W % size:
            raise CheckpointError(f"layer {i}: FFN width {W} does not divide over {size} ranks")
        h = H // size
        if K >= size:
            k = K // size
            kv = (rank * k, rank * k + k)
        else:  # replicated: the one key/value head this rank's queries use
            group = H // K
            kv = (rank * h // group, rank * h // group + 1)
        w = W // size
        mamba = mamba_heads(config, rank, size, i) if config.layer_type(i) in ("mamba", "hybrid") else ((0, 0), (0, 0))
        shards.append(LayerShard((rank * h, rank * h + h), kv, (rank * w, rank * w + w),
                                 *(delta_heads(config, rank, size, i) if config.layer_type(i) == "linear_attention" else
                                   ((0, 0), ())), *mamba, *experts))
    return shards


def expert_columns(config: dense.DenseConfig, rank: int, size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """A mixture's columns of every expert's width for this rank, and of its shared expert's: each expert split by
    its width, as a dense MLP is (each rank runs its share of every chosen expert, one all-reduce a layer; experts
    spread over the ranks would leave a rank idle whenever none of its experts is chosen)."""
    experts = config.extras.get("experts")
    if experts is None:
        return (0, 0), (0, 0)
    if experts.beside_mlp and size > 1:
        raise CheckpointError("its experts beside the MLP (Gemma 4) are not split across ranks yet")
    for what, width in (("experts' width", experts.width), ("shared expert's width", experts.shared_width)):
        if width % size:
            raise CheckpointError(f"its {what} {width} does not divide over {size} ranks")
    return tuple((rank * width // size, (rank + 1) * width // size) for width in (experts.width, experts.shared_width))


def mamba_heads(config: dense.DenseConfig, rank: int, size: int, layer: int) -> tuple[tuple[int, int], tuple]:
    """A Mamba2 mixer's heads for this rank, a run, and the groups of B and C they read: split with the heads, or
    read whole by each rank whose heads share them (fewer groups than ranks), where no norm spans a group or the one
    group spans every rank (SpreadNorm)."""
    H, _, G, _ = config.extras["mamba2"].heads
    if H % size:
        raise CheckpointError(f"layer {layer}: {H} Mamba2 heads do not divide over {size} ranks")
    normed = config.extras["mamba2"].norm
    if G % size and (size % G or normed) and G != 1:  # (one group normed: SpreadNorm sums its squares)
        raise CheckpointError(f"layer {layer}: its Mamba2 heads' {G} groups of B and C (normed by groups) do not "
                              f"divide over {size} ranks")
    h, per_group = H // size, H // G
    heads = (rank * h, rank * h + h)
    return heads, (heads[0] // per_group, (heads[1] - 1) // per_group + 1)


def delta_heads(config: dense.DenseConfig, rank: int, size: int, layer: int) -> tuple[tuple[int, int], tuple]:
    """A Gated DeltaNet layer's key heads for this rank, and the value heads that read them: grouped (value head j
    reads key head j // (V / K)), a run; tiled (j reads j % K, llama.cpp's order), every K-th from each key head, in
    the order that keeps the shard tiled over its own key heads."""
    delta = config.extras["gated_deltanet"]
    K, V = delta.heads
    if K % size:
        raise CheckpointError(f"layer {layer}: {K} Gated DeltaNet key heads do not divide over {size} ranks")
    k, share = K // size, V // K
    keys = (rank * k, rank * k + k)
    if delta.tiled_values:
        return keys, tuple(m * K + j for m in range(share) for j in range(*keys))
    return keys, tuple(range(keys[0] * share, keys[1] * share))


def shard_config(config: dense.DenseConfig, shards: list[LayerShard]) -> dense.DenseConfig:
    """The config of one rank's model: per-layer head counts and FFN widths of its slice."""
    extras = dict(config.extras)
    delta = next((s for s in shards if s.value_heads), None)  # (every Gated DeltaNet layer has the same heads)
    if delta:
        heads = (delta.key_heads[1] - delta.key_heads[0], len(delta.value_heads))
        extras["gated_deltanet"] = dataclasses.replace(extras["gated_deltanet"], heads=heads)
    mamba = next((s for s in shards if s.mamba_heads[1]), None)  # (and every Mamba2 mixer)
    if mamba:
        _, P, _, N = extras["mamba2"].heads
        heads = (mamba.mamba_heads[1] - mamba.mamba_heads[0], P, mamba.mamba_groups[1] - mamba.mamba_groups[0], N)
        extras["mamba2"] = dataclasses.replace(extras["mamba2"], heads=heads)
    if "experts" in extras:
        (a, b), (c, d) = shards[0].experts, shards[0].shared
        extras["experts"] = dataclasses.replace(extras["experts"], width=b - a, shared_width=d - c)
    return dataclasses.replace(config, num_attention_heads=[s.heads[1] - s.heads[0] for s in shards],
                               num_key_value_heads=[s.kv_heads[1] - s.kv_heads[0] for s in shards],
                               intermediate_size=[s.ffn[1] - s.ffn[0] for s in shards], extras=extras)


# Which slice of a checkpoint tensor a rank reads: (pattern, how). "heads"/"kv_heads"/"ffn": rows of those units;
# "in_heads"/"in_ffn": columns; "rank0": whole on rank 0, zeros elsewhere (a bias added after the partial sums).
# A Gated DeltaNet layer: "qkv" rows of its key heads' q and k and its value heads' v (the conv's channels too),
# "values" rows of its value heads, "in_values" their columns (a short conv's: whole, and out_proj rank 0's).
MAMBA = r"layers\.(\d+)\.mixer\.(?:mamba\.)?"  # (a Mamba2 mixer's, or a Falcon-H1 layer's Mamba2 half's)
RULES = [
    (MAMBA + r"in_proj\.(weight|bias|qweight|scales|mins|absmax)", "mamba_in"),
    (MAMBA + r"conv_(weight|bias)", "mamba_conv"),
    (MAMBA + r"(A_log|D|dt_bias)", "mamba_heads"),
    (MAMBA + r"norm\.weight", "mamba_norm"),
    (MAMBA + r"out_proj\.(weight|qweight|scales|mins)", "mamba_out"),
    (MAMBA + r"out_proj\.bias", "mamba_bias"),
    (r"layers\.(\d+)\.mixer\.(in_proj_qkv\.(weight|qweight|scales|mins|absmax)|conv_weight)", "qkv"),
    (r"layers\.(\d+)\.mixer\.(in_proj_[zab]\.(weight|qweight|scales|mins|absmax)|A_log|dt_bias)", "values"),
    (r"layers\.(\d+)\.mixer\.out_proj\.(weight|qweight|scales|mins)", "in_values"),
    (r"layers\.(\d+)\.mixer\.(?:attention\.)?(q_proj|gate_proj)\.(weight|bias|qweight|scales|mins|absmax)", "heads"),
    (r"layers\.(\d+)\.mixer\.(?:attention\.)?(k_proj|v_proj)\.(weight|bias|qweight|scales|mins|absmax)", "kv_heads"),
    (r"layers\.(\d+)\.mixer\.q_norm\.weight", "norm_heads"),
    (r"layers\.(\d+)\.mixer\.k_norm\.weight", "norm_kv_heads"),
    (r"layers\.(\d+)\.mixer\.(?:attention\.)?o_proj\.(weight|qweight|scales|mins)", "in_heads"),
    (r"layers\.(\d+)\.mlp\.(gate_proj|up_proj)\.(weight|bias|qweight|scales|mins|absmax)", "ffn"),
    (r"layers\.(\d+)\.mlp\.down_proj\.(weight|qweight|scales|mins)", "in_ffn"),
    (r"layers\.(\d+)\.(mixer\.(?:attention\.)?o_proj|mlp\.down_proj)\.bias", "rank0"),
    (r"layers\.(\d+)\.mlp\.experts_gate_up(_bias)?", "experts"),
    (r"layers\.(\d+)\.mlp\.experts_down", "in_experts"),
    (r"layers\.(\d+)\.mlp\.experts_down_bias", "rank0"),
    (r"layers\.(\d+)\.mlp\.shared\.(gate_proj|up_proj)\.weight", "shared"),
    (r"layers\.(\d+)\.mlp\.shared\.down_proj\.weight", "in_shared"),
]


def slicer(name: str, config: dense.DenseConfig, shards: list[LayerShard], rank: int, mode: str | None):
    """A function cutting this rank's part out of checkpoint tensor `name` (None: the rank keeps it whole)."""
    for pattern, how in RULES:
        m = re.fullmatch(pattern, name)
        if m and not (how.startswith("mamba") and config.layer_type(int(m.group(1))) not in ("mamba", "hybrid")):
            break  # (LFM2's short conv and Gated DeltaNet name an in_proj, out_proj or conv too: their own rules)
    else:
        return None
    i = int(m.group(1))
    s = shards[i]
    if how.startswith("mamba"):
        if how == "mamba_out" and mode == "nf4":
            raise CheckpointError(f"{name}: nf4 weights cannot be split by input columns; use int8 or int4 with "
                                  "tensor parallel")
        return lambda t: mamba_part(t, config, s, how, name, rank)
    if how in ("qkv", "values", "in_values") and config.layer_type(i) == "conv":  # (a short conv: whole)
        if how != "in_values":
            return None
        how = "rank0"
    if how in ("qkv", "values"):
        return lambda t: delta_rows(t, config, s, how)
    if how == "rank0":
        return lambda t: t if rank == 0 else torch.zeros_like(t)
    if how in ("experts", "in_experts", "shared", "in_shared"):
        return lambda t: expert_part(t, config, s, how)
    if how in ("norm_heads", "norm_kv_heads"):
        if config.qk_norm != "per_channel":  # one gain shared by every head: replicated
            return None
        units, (a, b) = (config.heads(i), s.heads) if how == "norm_heads" else (config.kv_heads(i), s.kv_heads)
        return lambda t: t.reshape(units, -1)[a:b].reshape(-1, *t.shape[1:])
    if how.startswith("in_") and mode == "nf4":  # nf4's blocks run along the flattened weight
        raise CheckpointError(f"{name}: nf4 weights cannot be split by input columns; use int8 or int4 with "
                              "tensor parallel")
    if how == "in_values":
        return lambda t: value_columns(t, config, s, name)
    units, (a, b) = {"heads": (config.heads(i), s.heads), "kv_heads": (config.kv_heads(i), s.kv_heads),
                     "in_heads": (config.heads(i), s.heads), "ffn": (config.ffn_width(i), s.ffn),
                     "in_ffn": (config.ffn_width(i), s.ffn)}[how]
    if not how.startswith("in_"):  # rows (every stored layout is row-major per output row)
        return lambda t: t.narrow(0, a * t.shape[0] // units, (b - a) * t.shape[0] // units)
    inputs = config.heads(i) * layer_kinds.head_size(config, i) if how == "in_heads" else config.ffn_width(i)

    def columns(t: torch.Tensor) -> torch.Tensor:  # weight [N, K], qweight [N, K/2], int4 scales/mins [N, K/group]
        if t.ndim < 2 or t.shape[1] == 1:  # per-row scales (int8's [N], fp8's [N, 1]): every rank needs them whole
            return t
        width = t.shape[1]
        if width * (b - a) % units:
            raise CheckpointError(f"{name}: int4 groups of {inputs // width} inputs do not divide a rank's "
                                  f"{inputs * (b - a) // units} inputs ({inputs} over {units // (b - a)} ranks); "
                                  "quantize with a smaller --group-size")
        return t.narrow(1, a * width // units, (b - a) * width // units).contiguous()

    return columns


def expert_part(t: torch.Tensor, config: dense.DenseConfig, s: LayerShard, how: str) -> torch.Tensor:
    """A mixture's tensor for this rank: each expert's gate and up rows of its width's share (experts_gate_up [E, 2I,
    C] or its bias [E, 2I]; relu2: up rows alone), experts_down's columns [E, C, I]; the shared expert's rows, its
    down_proj's columns."""
    if how == "in_experts":
        return t[..., s.experts[0]:s.experts[1]].contiguous()
    if how == "in_shared":
        return t[:, s.shared[0]:s.shared[1]].contiguous()
    if how == "shared":
        return t[s.shared[0]:s.shared[1]]
    (a, b), width = s.experts, config.extras["experts"].width
    parts = t.split(width, dim=1)  # (gate, up), or (up,)
    return torch.cat([p[:, a:b] for p in parts], dim=1)


def delta_rows(t: torch.Tensor, config: dense.DenseConfig, s: LayerShard, how: str) -> torch.Tensor:
    """A Gated DeltaNet tensor's rows for this rank ("qkv": in_proj_qkv or the conv's channels, q | k | v; "values":
    a row or Dv rows per value head). Counted in stored rows (a quantized layout may hold several a weight row)."""
    (K, V), (Dk, Dv) = config.extras["gated_deltanet"].heads, config.extras["gated_deltanet"].head_dims
    if how == "values":
        per = t.shape[0] // V
        return torch.cat([t[j * per:(j + 1) * per] for j in s.value_heads])
    f = t.shape[0] // (2 * K * Dk + V * Dv)
    q, k, v = t.split([K * Dk * f, K * Dk * f, V * Dv * f])
    a, b = s.key_heads
    return torch.cat([q[a * Dk * f:b * Dk * f], k[a * Dk * f:b * Dk * f],
                      *(v[j * Dv * f:(j + 1) * Dv * f] for j in s.value_heads)])


def mamba_part(t: torch.Tensor, config: dense.DenseConfig, s: LayerShard, how: str, name: str,
               rank: int) -> torch.Tensor:
    """A Mamba2 tensor's part for this rank: in_proj's rows z | x | B | C | dt (heads' z, x and dt rows, its groups'
    B and C), the conv's channels x | B | C, a value per head, the norm's gains of its heads' channels, out_proj's
    columns of its heads (a bias: rank 0's). Rows counted in stored rows (a layout may hold several a weight row)."""
    H, P, G, N = config.extras["mamba2"].heads
    (a, b), (ga, gb) = s.mamba_heads, s.mamba_groups
    if how == "mamba_bias":
        return t if rank == 0 else torch.zeros_like(t)
    if how == "mamba_heads":
        return t[a:b]
    if how == "mamba_norm":  # [inner]: the gains of its heads' channels (its groups', or its share of the one)
        return t[a * P:b * P]
    if how == "mamba_out":
        if t.ndim < 2:  # int8's per-row scales: whole
            return t
        width = t.shape[1]  # (weight: H * P columns; int4's qweight, scales and mins fewer, the same share a head)
        if width * (b - a) % H or width * a % H:
            raise CheckpointError(f"{name}: int4 groups of {H * P // width} inputs do not divide a rank's "
                                  f"{(b - a) * P} inputs; quantize with a smaller --group-size")
        return t.narrow(1, a * width // H, (b - a) * width // H).contiguous()
    sizes = ([H * P] if how == "mamba_in" else []) + [H * P, G * N, G * N] + ([H] if how == "mamba_in" else [])
    f = t.shape[0] // sum(sizes)
    parts = t.split([n * f for n in sizes])
    z, parts = (parts[0], parts[1:]) if how == "mamba_in" else (None, parts)
    x, B, C = parts[:3]
    keep = [x[a * P * f:b * P * f], B[ga * N * f:gb * N * f], C[ga * N * f:gb * N * f]]
    if how == "mamba_in":
        keep = [z[a * P * f:b * P * f], *keep, parts[3][a * f:b * f]]
    return torch.cat(keep)


def value_columns(t: torch.Tensor, config: dense.DenseConfig, s: LayerShard, name: str) -> torch.Tensor:
    """out_proj's columns of this rank's value heads (weight [N, V Dv], qweight [N, V Dv / 2], int4 scales and mins
    [N, V Dv / group]; int8's per-row scales whole)."""
    if t.ndim < 2:
        return t
    V, Dv = config.extras["gated_deltanet"].heads[1], config.extras["gated_deltanet"].head_dims[1]
    if t.shape[1] % V:
        raise CheckpointError(f"{name}: int4 groups of {V * Dv // t.shape[1]} inputs do not divide a value head's {Dv} "
                              "inputs; quantize with a smaller --group-size")
    w = t.shape[1] // V
    return torch.cat([t[:, j * w:(j + 1) * w] for j in s.value_heads], dim=1)


def shard(rank: int, size: int) -> Callable:
    """load.from_pretrained's `shard` hook: (config, {name: thunk}, mode) -> this rank's config and
    thunks that read only its slices (memory-mapped tensors: only the pages of those slices are read)."""

    def hook(checkpoint, tensors: dict, mode: str | None):
        config = hook.config = checkpoint.config  # (from_pretrained reads the whole model's config after)
        try:
            shards, problem = plan(config, rank, size), None
        except CheckpointError as e:
            shards, problem = None, str(e)
        # every rank reaches this point: all learn of a failure together and each reports it (the first rank to exit
        # makes torchrun stop the others, which would otherwise be killed before they say why)
        problem = next((p for p in gather(problem) if p), None)
        if problem:
            raise CheckpointError(f"{checkpoint.path}: {problem} (torchrun --nproc-per-node {size})")
        if size == 2 and mode in (None, "none") and glob.glob(os.path.join(checkpoint.path, "global_step*")):
            # GPT-NeoX's original two-way release: rank r reads shard r's files, merges nothing
            return shard_config(config, shards), families.neox_original(checkpoint.path, rank)[1]
        sliced = {}
        for name, thunk in tensors.items():
            cut = slicer(name, config, shards, rank, mode)
            sliced[name] = thunk if cut is None else (lambda thunk=thunk, cut=cut: cut(thunk()))
        return shard_config(config, shards), sliced

    return hook


def all_reduce(y: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, traceable (a functional collective: torch.compile keeps the step one graph)."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(y, "sum", dist.group.WORLD)


def from_pretrained(path, device="cpu", dtype: torch.dtype | None = None, quant: str | None = None):
    """This rank's shard of the checkpoint at path (every process of the group calls it)."""
    rank, size = world()
    hook = shard(rank, size)
    model = load.from_pretrained(path, device=device, dtype=dtype, quant=quant, shard=hook)
    if size > 1:
        add_reduces(model)
        spread_norms(model, hook.config, size)
    return model


class SpreadNorm(nn.Module):
    """Mamba2's gated RMSNorm over one group whose channels every rank holds a share of (its heads'): the mean square
    is each rank's sum of squares, summed over ranks, over the group's whole width."""

    def __init__(self, norm: nn.Module, width: int) -> None:
        super().__init__()
        self.weight, self.eps, self.width = norm.weight, norm.eps, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., 1, this rank's channels of the group]
        h = x.float()
        h = h * torch.rsqrt(all_reduce(h.pow(2).sum(-1, keepdim=True)) / self.width + self.eps)
        return h.to(x.dtype) * self.weight.view(x.shape[-2:])


def spread_norms(model, config: dense.DenseConfig, size: int) -> None:
    """Put a SpreadNorm where a model's one group of Mamba2 channels (normed) is spread over the ranks."""
    if size == 1 or "mamba2" not in config.extras:
        return
    H, P, G, _ = config.extras["mamba2"].heads
    if G != 1 or not config.extras["mamba2"].norm:
        return
    for i, layer in enumerate(model.layers):
        kind = config.layer_type(i)
        if kind in ("mamba", "hybrid"):
            mamba = layer.mixer if kind == "mamba" else layer.mixer.mamba
            mamba.norm = SpreadNorm(mamba.norm, H * P)


def add_reduces(model) -> None:
    """Each branch's partial output is summed over ranks as it enters its post-norm (an Identity where the family has
    none), before the residual add: a forward pre-hook, as gpt-fast's tp.py adds its all-reduces. (GPT-NeoX's
    parallel form adds both branches first, then enters mixer_post_norm: one all-reduce.)"""
    for layer in model.layers:
        for module in (layer.mixer_post_norm, layer.mlp_post_norm):
            module.register_forward_pre_hook(lambda _module, args: (all_reduce(args[0]),))
