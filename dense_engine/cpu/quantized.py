"""quantized.py: weight-only int8, int4 and nf4 (and bitsandbytes' LLM.int8) linears, and the quantizers that make
their stored tensors. Stands on dense.py and kernels.py (whose CPU kernels the layers call).

Which layers: every linear of the decoder blocks; the output head in int8 for the 4-bit modes (it is the most
sensitive layer), in the mode itself for int8, in float for fp8 (as FP8 checkpoints keep it); the embedding table stays
in the model's dtype (gguf: every tensor, embedding and head included, in the file's own type; int4 made from a GGUF's
Q4_0/Q4_1 blocks: the head in the file's own blocks too, GGUFHead, and the embedding's float32 values are the file's
exactly). A folder that came quantized, loaded in its own mode (params "stored": formats/prequantized.py), has only
the linears it stores quantized in the mode; every other linear, the head included, stays float as stored.

| mode     | stored per linear                                   | value                          |
| -------- | --------------------------------------------------- | ------------------------------ |
| int8     | weight int8 [out, in], scales [out]                 | scale[o] * q                   |
| int4     | qweight uint8 [out, in/2], scales, mins [out, in/g] | min + scale * q, q in 0..15    |
| nf4      | weight uint8 [out*in/2, 1], absmax [out*in/64]      | absmax * NF4[q] (bitsandbytes) |
|          | --double-quant: absmax_q uint8, absmax_scales, ...  | absmax 8-bit, blocks of 256    |
| llm.int8 | as int8 (bitsandbytes' CB and SCB / 127)            | bitsandbytes Linear8bitLt      |
| fp8      | weight float8 e4m3 [out, in], scales [out, in/b]    | scale[o, i/b] * q (b: block)   |
| gguf     | a GGUF file's rows of blocks, as stored (not saved) | gguf's dequantizer's value     |

int4's grid is llama.cpp's Q4_1 grid (min + scale * q per group): a checkpoint converted from a Q4_0 or Q4_1 GGUF
gets an int4-g32 variant made from the GGUF's own blocks, bit for bit. nf4 is bitsandbytes' layout bit for bit:
blocks of 64 over the flattened weight, absmax per block, two codes per byte with the first in the high nibble.

Files store one tensor set per checkpoint linear (q_proj, k_proj, ...); the model stacks q/k/v/gate and gate/up by
rows when it loads them (load.load_tensors). Every layout here is row-major per output row (nf4's
blocks never cross a part, whose size is a multiple of 64), so the stacked tensors are the stacked layer's own.
Files of variants are written by convert.py (convert.write_variant; the command line is quantize.py), and chosen at
load time by load.py.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

import layer_kinds
from dense import DenseDecoder
from dense_engine.cpu import kernels
from dense_engine.system.errors import CheckpointError

MODES = ("int8", "int4", "nf4", "llm.int8", "fp8")  # (and "gguf" at load time: a GGUF file's own blocks, below)
# bitsandbytes' NF4 code (float32), in increasing order.
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])
# Checkpoint linears of the decoder blocks (what files store) and the model's linears (fused, what the model holds).
# (checkpoint names; MODEL_LINEAR: the model's modules. A state layer's projections too: Gated DeltaNet's in_proj from
# in_proj_qkv | z | b | a, the short conv's and Mamba2's in_proj and out_proj)
BLOCK_LINEAR = re.compile(r"layers\.\d+\.(mixer\.(q|k|v|gate|o|in|out)_proj|mixer\.in_proj_(qkv|z|b|a)|"
                          r"mlp\.(gate|up|down)_proj)")
MODEL_LINEAR = re.compile(r"layers\.\d+\.(mixer\.(qkv|o|in|out)_proj|mlp\.(gate_up|up|down)_proj)")
# A checkpoint linear the model stacks with others into one (MODEL_LINEAR's qkv_proj, in_proj, gate_up_proj): its
# parent, and which stack (stack_of)
STACKED_PART = re.compile(r"(.+\.mixer)\.(?:(q|k|v|gate)_proj|in_proj_(?:qkv|z|b|a))|(.+\.mlp)\.(?:gate|up)_proj")
EXACT_INT4_TYPES = ("Q4_0", "Q4_1")  # GGUF tensor types whose blocks int4-g32 holds exactly
BYTES_PER_WEIGHT = {"int8": 1.0, "llm.int8": 1.0, "int4": 0.65, "nf4": 0.6, "gguf": 1.07,
                    "fp8": 1.0}  # stored, scales included (about)


def import_bitsandbytes():
    """bitsandbytes, without its import-time warning about an optional CPU kernel fetched from the Hugging Face hub
    (`kernels` package), which this project does not use."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes

    return bitsandbytes


# ----------------------------------------------------------------------------------------------------------------
# Quantizers: float weight [out, in] -> the tensors stored for it


def int8_quantize(w: torch.Tensor) -> dict:
    """Symmetric, per output channel: q = round(w / s), s = max|w_row| / 127."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    return {"weight": torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8), "scales": scales}


def int4_quantize(w: torch.Tensor, group: int) -> dict:
    """Asymmetric, per group of `group` inputs: w ~ min + scale * q, q = round((w - min) / scale) in 0..15."""
    out, inp = w.shape
    if inp % group:
        raise CheckpointError(f"int4: input width {inp} is not a multiple of the group size {group}")
    g = w.float().reshape(out, inp // group, group)
    mins, maxs = g.amin(dim=-1), g.amax(dim=-1)
    # scale and min stored in float16, as llama.cpp's Q4_1 stores them; quantize against the stored values
    scales, mins = ((maxs - mins) / 15).clamp(min=1e-7).half(), mins.half()
    q = torch.round((g - mins.float()[..., None]) / scales.float()[..., None]).clamp(0, 15).to(torch.uint8)
    return int4_pack(q.reshape(out, inp), scales, mins)


def int4_pack(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> dict:
    """codes [out, in] in 0..15 -> the stored tensors: two codes a byte, the even input in the low nibble."""
    codes = codes.to(torch.uint8)
    return {"qweight": codes[:, 0::2] | (codes[:, 1::2] << 4), "scales": scales.half(), "mins": mins.half()}


def nf4_quantize(w: torch.Tensor, block: int = 64, double_quant: bool = False) -> dict:
    """bitsandbytes' quantize_4bit(quant_type="nf4", blocksize=64), the same arithmetic step by step. double_quant
    (bitsandbytes' compress_statistics): the absmax values minus their mean are quantized again to 8 bits in
    blocks of 256, with bitsandbytes' own quantize_blockwise."""
    flat = w.reshape(-1).float()
    if flat.numel() % block:
        raise CheckpointError(f"nf4: {flat.numel()} weights are not a multiple of the block size {block}")
    blocks = flat.reshape(-1, block)
    absmax = blocks.abs().amax(dim=-1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)[:, None]), -1, 1).reshape(-1)
    code = NF4.to(scaled.device)
    q = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8)
    stored = {"weight": ((q[0::2] << 4) | q[1::2]).unsqueeze(1)}
    if not double_quant:
        return {**stored, "absmax": absmax}
    bnbf = import_bitsandbytes().functional
    offset = absmax.mean()
    absmax_q, state = bnbf.quantize_blockwise(absmax - offset, blocksize=256)
    return {**stored, "absmax_q": absmax_q, "absmax_scales": state.absmax, "absmax_code": state.code,
            "absmax_offset": offset.reshape(1)}


def double_quant_absmax(absmax_q, absmax_scales, absmax_code, absmax_offset) -> torch.Tensor:
    """The absmax of every 64-block, float32, from nf4 --double-quant's stored tensors:
    code[absmax_q] * absmax_scales[block of 256] + offset."""
    scales = absmax_scales.float().repeat_interleave(256)[: absmax_q.numel()]
    return absmax_code.float()[absmax_q.long()] * scales + absmax_offset.float()


DOUBLE_QUANT = ("absmax_q", "absmax_scales", "absmax_code", "absmax_offset")
FP8_MAX = 448.0  # the largest float8 e4m3fn value


def fp8_quantize(w: torch.Tensor, block: int = 0) -> dict:
    """Symmetric, per output row and `block` inputs (0: the whole row): q = w / s in float8 e4m3, s = max|w| / 448
    (the scale each value is multiplied by back, as FP8 checkpoints store it)."""
    out, inp = w.shape
    cols = block or inp
    g = F.pad(w.float(), (0, -inp % cols)).reshape(out, -1, cols)
    scales = g.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [out, groups]
    q = (g / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).reshape(out, -1)[:, :inp]
    return {"weight": q.to(torch.float8_e4m3fn), "scales": scales}


# ----------------------------------------------------------------------------------------------------------------
# Quantized linears. Each holds its stored tensors as buffers; keep_dtype names those that load as stored.


class QuantLinear(nn.Module):
    keep_dtype: tuple[str, ...] = ()

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def finish_loading(self) -> None:
        """Repack for this device's kernel (buffers kernel_*), once the stored tensors are in place."""

    def _apply(self, fn, recurse=True):
        """A move or a cast (model.to("cuda", torch.bfloat16)): the stored scales (keep_dtype) and the nf4 code table
        move but keep their dtype, and the kernel layouts, which belong to a device, are made again from the stored
        tensors."""
        kept = {n: self._buffers.pop(n) for n in (*self.keep_dtype, "code") if self._buffers.get(n) is not None}
        for name in [n for n in self._buffers if n.startswith("kernel_")]:
            del self._buffers[name]
        super()._apply(fn, recurse)
        if kept:
            device = fn(torch.empty(0, device=next(iter(kept.values())).device)).device  # where fn moves things
            self._buffers.update({n: t.to(device) for n, t in kept.items()})
        self.finish_loading()
        return self

    def register_kernel(self, packed: dict) -> None:
        for key, t in packed.items():
            self.register_buffer(key, t, persistent=False)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias


class Int8Linear(QuantLinear):
    keep_dtype = ("scales",)

    def __init__(self, in_features, out_features, bias, **_) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features))

    @staticmethod
    def stored(w, **_):
        return int8_quantize(w)

    def dequantize(self, dtype) -> torch.Tensor:
        return (self.weight.float() * self.scales.float()[:, None]).to(dtype)

    def finish_loading(self) -> None:
        if self.weight.device.type == "cpu":  # repacked for the CPU kernel (kernels.py)
            self.register_kernel(kernels.pack_int8(self.weight, self.scales))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "kernel_weight"):
            return self.add_bias(kernels.linear_int8(x, self.kernel_weight, self.kernel_scales))
        # Elsewhere (CUDA): gpt-fast's dequantize-and-matmul. Compiled with coordinate descent tuning, Inductor turns a
        # one-row matmul into one reduction that converts each int8 weight as it loads it: the weight is read once,
        # at int8's size. The scales stay float32 on purpose: with bfloat16 scales Inductor's weight-only-int8
        # pattern routes the matmul to aten._weight_int8pack_mm, whose CUDA kernel loops over K in one thread per
        # output (a fraction of the bandwidth). Rows > 1 (prefill) are a GEMM on the converted weight.
        y = F.linear(x, self.weight.to(x.dtype)) * self.scales.float()
        return self.add_bias(y.to(x.dtype))


class Int4Linear(QuantLinear):
    keep_dtype = ("scales", "mins")

    def __init__(self, in_features, out_features, bias, group_size=32, layout="pairs", **_) -> None:
        super().__init__(in_features, out_features, bias)
        self.group_size = group_size
        self.layout = layout  # of the stored tensors: "pairs", or a saved variant's kernels.INT4_LAYOUT
        groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.float16))
        self.register_buffer("mins", torch.zeros(out_features, groups, dtype=torch.float16))

    @staticmethod
    def stored(w, group_size=32, **_):
        return int4_quantize(w, group_size)

    def codes(self, pairs: torch.Tensor | None = None) -> torch.Tensor:
        """q in 0..15, [out, in] (pairs: the stored pairs, when the caller has them)."""
        pairs = self.stored_pairs()["qweight"] if pairs is None else pairs
        return torch.stack((pairs & 15, pairs >> 4), dim=-1).reshape(self.out_features, self.in_features)

    def stored_pairs(self) -> dict:
        """{"qweight", "scales", "mins"} in the pairs layout, whichever layout holds them."""
        stored = {name: self._buffers[name] for name in ("qweight", "scales", "mins")}
        if self.layout == "pairs":
            return stored
        return {name: kernels.int4_from_kernel(name, t) for name, t in stored.items()}

    def finish_loading(self) -> None:
        if self.layout != "pairs":  # a saved variant in the CPU kernel's layout: its tensors are the kernel's
            if self.qweight.device.type == "cpu" and kernels.available():
                self.register_kernel({"kernel_weight": self.qweight, "kernel_scales": self.scales,
                                      "kernel_mins": self.mins})
                return
            self._buffers.update(self.stored_pairs())  # (another device, or no kernels)
            self.layout = "pairs"
        if self.qweight.device.type in ("cpu", "cuda"):  # repacked for the kernel (kernels.py)
            self.register_kernel(kernels.pack_int4(self.qweight, self.scales, self.mins, self.group_size))

    def dequantize(self, dtype) -> torch.Tensor:
        stored = self.stored_pairs()
        g = self.codes(stored["qweight"]).reshape(self.out_features, -1, self.group_size).to(torch.float32)
        w = stored["mins"].float()[..., None] + stored["scales"].float()[..., None] * g
        return w.reshape(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "kernel_weight"):
            return self.add_bias(kernels.linear_int4(x, self.kernel_weight, self.kernel_scales, self.kernel_mins,
                                                     self.out_features, self.group_size))
        # elsewhere: dequantize-and-matmul, which torch.compile fuses into the weight loads
        return self.add_bias(F.linear(x, self.dequantize(x.dtype)))


class NF4Linear(QuantLinear):
    keep_dtype = ("absmax",)

    def __init__(self, in_features, out_features, bias, **_) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight", torch.zeros(out_features * in_features // 2, 1, dtype=torch.uint8))
        self.register_buffer("absmax", torch.ones(out_features * in_features // 64))
        self.register_buffer("code", NF4.clone(), persistent=False)

    @staticmethod
    def stored(w, double_quant=False, **_):
        return nf4_quantize(w, double_quant=double_quant)

    def finish_loading(self) -> None:
        self.code = self.code.to(self.absmax.device)  # (made on the CPU; a copy per call on a GPU otherwise)
        self.register_kernel(kernels.pack_nf4(self.weight, self.absmax, self.out_features, self.in_features) or {})

    def dequantize(self, dtype) -> torch.Tensor:
        packed = self.weight.reshape(-1)
        q = torch.stack((packed >> 4, packed & 15), dim=-1).reshape(-1, 64).int()  # (int32 indices: no int64 copy)
        w = self.code[q] * self.absmax[:, None]
        return w.reshape(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "kernel_weight"):
            return self.add_bias(kernels.linear_nf4(x, self.kernel_weight, self.kernel_absmax, self.code))
        # dequantize-and-matmul: torch.compile fuses the table lookup into the weight loads; on the CPU (rows of K %
        # 64 values) kernels.cpp's float32 tiles, whose rows do not depend on the batch
        return self.add_bias(kernels.linear_f32(x, self.dequantize(x.dtype)))


class LLMInt8Linear(Int8Linear):
    """bitsandbytes' Linear8bitLt (LLM.int8 with outlier threshold 6.0, as GPT-NeoX-20B's reference uses), from int8
    rows and their absmax scales."""

    def finish_loading(self) -> None:
        bnb = import_bitsandbytes()
        layer = bnb.nn.Linear8bitLt(self.in_features, self.out_features, bias=self.bias is not None,
                                    has_fp16_weights=False, threshold=6.0, device="meta")
        layer.weight = bnb.nn.Int8Params(self.weight, requires_grad=False, has_fp16_weights=False)
        layer.weight.CB, layer.weight.SCB = self.weight, (self.scales * 127).float()
        layer.state.CB, layer.state.SCB = layer.weight.CB, layer.weight.SCB
        if self.bias is not None:
            layer.bias = self.bias
        self.layer = layer

    def _apply(self, fn, recurse=True):
        self._modules.pop("layer", None)  # bitsandbytes' layer is made again from the stored tensors
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class Float8Linear(QuantLinear):
    """float8 e4m3 weights with a float32 scale per output row and `fp8_block` inputs (0: one per row), as FP8
    checkpoints store them (Qwen3-FP8's 128 x 128 blocks: each block's scale on each of its rows). Where the device
    multiplies float8 (CUDA compute capability 8.9+) and the scale is one per row, torch._scaled_mm multiplies them as
    FP8-dynamic means: each activation row quantized to e4m3 on the fly (scale max|x| / 448), float32 accumulation.
    Elsewhere the weight is dequantized into the matmul (compiled on a GPU: converted as it is read, one byte a
    weight)."""
    keep_dtype = ("weight", "scales")  # (float8 is a floating dtype: without this a load would cast it)

    def __init__(self, in_features, out_features, bias, fp8_block=0, **_) -> None:
        super().__init__(in_features, out_features, bias)
        self.fp8_block = fp8_block
        groups = -(-in_features // fp8_block) if fp8_block else 1
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("scales", torch.ones(out_features, groups))
        self.scaled_mm = False

    @staticmethod
    def stored(w, fp8_block=0, **_):
        return fp8_quantize(w, fp8_block)

    def finish_loading(self) -> None:
        self.scaled_mm = self.scales.shape[1] == 1 and scaled_mm_ready(self.weight.device) and \
            self.in_features % 16 == 0 and self.out_features % 16 == 0  # (_scaled_mm's shapes)

    def dequantize(self, dtype) -> torch.Tensor:
        scales = self.scales.repeat_interleave(self.fp8_block or self.in_features, dim=1)[:, :self.in_features]
        return (self.weight.float() * scales).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaled_mm:
            return self.add_bias(fp8_matmul(x, self.weight, self.scales))
        if self.fp8_block:
            return self.add_bias(F.linear(x, self.dequantize(x.dtype)))
        y = F.linear(x, self.weight.to(x.dtype)) * self.scales.reshape(-1)  # (one scale a row: after the product)
        return self.add_bias(y.to(x.dtype))


def scaled_mm_ready(device: torch.device) -> bool:
    """Whether torch._scaled_mm multiplies float8 on this device at speed (the CPU's runs, but as a slow reference)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ (weight [out, in] e4m3 * scales [out, 1]).T with each row of x quantized to e4m3 (per-token
    dynamic scales, max|x_row| / 448): torch._scaled_mm, whose rowwise scales give float32 sums of the products."""
    rows = x.reshape(-1, x.shape[-1]).float()
    x_scales = rows.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [rows, 1]
    q = (rows / x_scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype  # (CUDA's rowwise kernel writes bfloat16 only)
    y = torch._scaled_mm(q, weight.t(), scale_a=x_scales, scale_b=scales.reshape(1, -1), out_dtype=out_dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


LINEARS = {"int8": Int8Linear, "int4": Int4Linear, "nf4": NF4Linear, "llm.int8": LLMInt8Linear,
           "fp8": Float8Linear}  # (+ "gguf" below)


# ----------------------------------------------------------------------------------------------------------------
# GGUF blocks as the file stores them (`--quant gguf`, what `auto` picks for a K-quant file): each weight row is the
# file's row of blocks, every tensor in its own type (a Q4_K_M file mixes Q4_K and Q6_K, and Q5_0 / Q8_0 where a row
# is not a multiple of 256). kernels.cpp multiplies them as they are; elsewhere they are dequantized (as gguf does).

# GGUF type name: (ggml id, values, bytes) a block
GGUF_TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
              "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}


def kquant_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes [n, 12] -> the 8 sub-blocks' 6-bit scales and mins [n, 8]: bytes 0-3 and 4-7 hold the
    low 6 bits of scales 0-3 and mins 0-3 (their top 2 bits: the high bits of scales and mins 4-7), bytes 8-11 the
    low 4 bits of scales (low nibble) and mins (high nibble) 4-7."""
    p = packed.to(torch.int32)
    d, m, md = p[:, 0:4], p[:, 4:8], p[:, 8:12]
    scales = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=1)
    mins = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=1)
    return scales.float(), mins.float()


def gguf_dequantize(blocks: torch.Tensor, kind: str, cols: int) -> torch.Tensor:
    """Rows of blocks uint8 [N, bytes] -> float32 [N, cols], the values gguf's own dequantizer computes, bit for bit
    (the same float32 operations in the same order)."""
    _, _, size = GGUF_TYPES[kind]
    b = blocks.reshape(-1, size)
    n = b.shape[0]

    def half(at: int) -> torch.Tensor:
        return b[:, at:at + 2].contiguous().view(torch.float16).float()  # [n, 1]

    def bits(qh: torch.Tensor, step: int) -> torch.Tensor:  # [n, B] bytes -> [n, B, 8 / step] fields of `step` bits
        return (qh[..., None] >> torch.arange(0, 8, step, dtype=torch.uint8, device=b.device)) & ((1 << step) - 1)

    if kind == "Q8_0":
        w = b[:, 2:].contiguous().view(torch.int8).float() * half(0)
    elif kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        at = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[kind]
        q = b[:, at:at + 16]
        u = torch.cat((q & 15, q >> 4), dim=1)  # byte j: value j (low nibble), value j + 16 (high)
        if kind in ("Q5_0", "Q5_1"):  # bit j of the little-endian uint32 before the nibbles: value j's fifth bit
            u = u | (bits(b[:, at - 4:at], 1).reshape(n, 32) << 4)
        u = u.float()
        w = half(0) * (u - (8 if kind == "Q4_0" else 16)) if kind in ("Q4_0", "Q5_0") else half(0) * u + half(2)
    elif kind in ("Q4_K", "Q5_K"):  # 8 sub-blocks of 32: (d scale_j) u - (dmin min_j)
        scales, mins = kquant_scales(b[:, 4:16])
        q = b[:, 16:144] if kind == "Q4_K" else b[:, 48:176]
        q = q.reshape(n, 4, 1, 32)
        u = torch.cat((q & 15, q >> 4), dim=2).reshape(n, 8, 32)  # 32 bytes: sub-blocks 2g (low), 2g + 1 (high)
        if kind == "Q5_K":  # bit s of qh[l]: value l of sub-block s
            u = u | (bits(b[:, 16:48], 1).transpose(1, 2) << 4)
        w = (half(0) * scales)[..., None] * u.float() - (half(2) * mins)[..., None]
    else:  # Q6_K, 16 sub-blocks of 16: (d scale_j) (u - 32), u = 4 low bits from ql, 2 high bits from qh
        ql, qh = b[:, :128].reshape(n, 2, 1, 64), b[:, 128:192].reshape(n, 2, 32)
        low = torch.cat((ql & 15, ql >> 4), dim=2).reshape(n, 2, 128)  # half h: values 64k + l from nibble k
        high = bits(qh, 2).permute(0, 1, 3, 2).reshape(n, 2, 128)  # half h: values 32s + l from bits 2s
        u = (low | (high << 4)).reshape(n, 16, 16).float()
        scales = b[:, 192:208].contiguous().view(torch.int8).float()
        w = (half(208) * scales)[..., None] * (u - 32)
    return w.reshape(blocks.shape[0], cols)


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, kind: str, cols: int, float_x: bool = False) -> torch.Tensor:
    """x [.., cols] times a GGUF tensor's rows of blocks uint8 [rows, row bytes] (as stored) -> [.., rows]."""
    if blocks.device.type == "cpu" and x.dtype == torch.float32 and kernels.available():
        return torch.ops.dense_kernels.linear_gguf(x, blocks, GGUF_TYPES[kind][0], float_x)  # kernels.cpp
    # elsewhere: dequantize-and-matmul (torch.compile fuses the dequantizing into the weight loads)
    return F.linear(x, gguf_dequantize(blocks, kind, cols).to(x.dtype))


class GGUFLinear(QuantLinear):
    """A linear over a GGUF file's rows of blocks, as stored. A fused projection's parts may differ in type (Q4_K_M:
    q and k in Q4_K, v in Q6_K) or lie apart in the file: each is its own buffer (blocks0, blocks1, ...), and the
    outputs are joined, then put in the model's order where the file permuted rows (llama's q and k)."""

    def __init__(self, in_features, out_features, bias, parts: list[tuple[str, torch.Tensor]] = (),
                 order: torch.Tensor | None = None, **_) -> None:
        super().__init__(in_features, out_features, bias)
        self.kinds = [kind for kind, _ in parts]
        for i, (_, blocks) in enumerate(parts):
            self.register_buffer(f"blocks{i}", blocks, persistent=False)
        self.register_buffer("order", order, persistent=False)  # outputs in the model's order (None: as stored)
        # (the kernels, eagerly: each part writes its outputs into their columns, in order; stored row n -> column.
        # On the CPU, also while loading on the meta device: arange there runs PyTorch's Python reference, whose
        # imports take 0.4-0.5 s)
        columns = torch.empty(out_features, dtype=torch.long, device="cpu")
        columns[order.cpu() if order is not None else slice(None)] = torch.arange(out_features, device="cpu")
        self.columns = list(columns.split([blocks.shape[0] for _, blocks in parts])) if parts else []

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kinds={'+'.join(self.kinds)}"

    float_x = False  # x in float32 at every number of rows (GGUFHead), not as digits or rounded to 8 bits

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return gguf_linear(x, getattr(self, f"blocks{i}"), self.kinds[i], self.in_features, self.float_x)

    def dequantize(self, dtype) -> torch.Tensor:
        w = torch.cat([gguf_dequantize(getattr(self, f"blocks{i}"), kind, self.in_features)
                       for i, kind in enumerate(self.kinds)])
        return (w if self.order is None else w[self.order]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (len(self.kinds) > 1 or self.order is not None) and x.device.type == "cpu" and x.dtype == torch.float32 \
                and kernels.available() and not torch.compiler.is_compiling():
            y = x.new_empty(*x.shape[:-1], self.out_features)
            for i, kind in enumerate(self.kinds):
                torch.ops.dense_kernels.linear_gguf_into(x, getattr(self, f"blocks{i}"), GGUF_TYPES[kind][0], y,
                                                         self.columns[i])
            return self.add_bias(y)
        ys = [self.part(x, i) for i in range(len(self.kinds))]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return self.add_bias(y if self.order is None else y.index_select(-1, self.order))


class GGUFHead(GGUFLinear):
    """The output head in its GGUF file's own blocks beside int4-g32 block linears made from the file's Q4_0/Q4_1
    blocks (the default model: a tied head multiplying the embedding's Q8_0 blocks), so that every tensor is the
    file's own. head: the GGUF type; blocks0 is filled from the variant file or the GGUF (a persistent buffer). x
    stays float32 whatever the rows (a prompt's logprobs, a batch of 16): the logits are the float path's to float32's
    rounding (x as two int8 digits put them 2e-4 from it: the final hidden states have outlier channels), the same
    bits for a row whatever runs beside it."""
    float_x = True

    def __init__(self, in_features, out_features, bias, head: str = "Q8_0", **_) -> None:
        _, values, size = GGUF_TYPES[head]
        blocks = torch.empty(out_features, in_features // values * size, dtype=torch.uint8)
        super().__init__(in_features, out_features, bias, parts=[(head, blocks)])
        self.register_buffer("blocks0", self.blocks0)  # (persistent: load.load_tensors fills it by name)


LINEARS["gguf"] = GGUFHead


class GGUFEmbedding(nn.Module):
    """An embedding table kept as a GGUF file's blocks: a lookup dequantizes the rows it reads (exactly gguf's
    values), so a 128K-256K vocabulary never exists in float32. A tied head multiplies the same blocks (GGUFLinear)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, kind: str, blocks: torch.Tensor, dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.kind, self.dtype = num_embeddings, embedding_dim, kind, dtype
        self.register_buffer("blocks", blocks, persistent=False)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={self.kind}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids.reshape(-1))  # [B * T, bytes]
        if rows.device.type == "cpu" and kernels.available():
            w = torch.ops.dense_kernels.dequantize_gguf(rows, GGUF_TYPES[self.kind][0], self.embedding_dim, False)
        else:
            w = gguf_dequantize(rows, self.kind, self.embedding_dim)
        return w.to(self.dtype).reshape(*ids.shape, self.embedding_dim)


class GGUFExperts(layer_kinds.Experts):
    """A mixture whose experts are a GGUF file's blocks as stored (llama.cpp's ffn_gate_exps and ffn_up_exps
    [E, I, row bytes], ffn_down_exps [E, C, row bytes], uint8, each tensor in its own type), never copied to float.
    On the CPU kernels, each projection is one call over every (token, chosen expert) row: llama.cpp's mul_mat_id,
    each expert's blocks read once for the rows that chose it. The router, the shared expert and its gate are the
    layer's own modules (float, or GGUFLinear where the file stores them in blocks). kinds: {"gate" | "up" | "down":
    GGUF type}; the blocks (gate_blocks, up_blocks, down_blocks) are empty until load.load_blocks puts the file's in
    place."""

    def __init__(self, config, layer: int, kinds: dict[str, str]) -> None:
        super().__init__(config, layer)
        if self.spec.activation not in ("swiglu", "geglu"):
            raise CheckpointError(f"GGUF experts with the {self.spec.activation} activation are not supported")
        del self.experts_gate_up, self.experts_down  # (the blocks instead)
        self.kinds = kinds
        C, E, I = config.hidden_size, self.spec.count, self.spec.width
        for name, rows, cols in (("gate", I, C), ("up", I, C), ("down", C, I)):
            _, values, size = GGUF_TYPES[kinds[name]]
            self.register_buffer(f"{name}_blocks", torch.empty(E, rows, cols // values * size, dtype=torch.uint8),
                                 persistent=False)

    def extra_repr(self) -> str:
        return f"kinds={self.kinds['gate']}/{self.kinds['up']}/{self.kinds['down']}"

    @property
    def on_kernels(self) -> bool:
        return self.gate_blocks.device.type == "cpu" and kernels.available()

    @property
    def eager_prefill(self) -> bool:
        """Without the kernels, gathered loops over the tokens, which a prefill step's varying length cannot take."""
        return not self.on_kernels

    def mul_mat_id(self, x: torch.Tensor) -> bool:
        """Whether x's rows go through the kernels' mul_mat_id (float32 on the CPU kernels)."""
        return x.dtype == torch.float32 and self.on_kernels

    def gathered(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x [N, C]; chosen, weights [N, k]. Every (token, slot) row through its expert, a projection a call (the
        kernels' mul_mat_id); elsewhere a row at a time, N x k calls of fixed shapes (a compiled step's few tokens)."""
        N, k = chosen.shape
        if not self.mul_mat_id(x):
            y = torch.stack([self.expert(x[n:n + 1], chosen[n, j])[0] for n in range(N) for j in range(k)])
            return (y.view(N, k, -1) * weights.unsqueeze(-1)).sum(1)
        ids, rows = chosen.reshape(-1), x.repeat_interleave(k, dim=0)  # [N k], [N k, C]
        h = torch.cat([self.through(rows, "gate", ids), self.through(rows, "up", ids)], dim=-1)  # [N k, 2I]
        y = self.through(self.activate(h), "down", ids)  # [N k, C]
        return (y.view(N, k, -1) * weights.unsqueeze(-1)).sum(1)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The eager pass: the kernels' (gathered), or each chosen expert once over the tokens that chose it."""
        if self.mul_mat_id(x):
            return self.gathered(x, weights, chosen)
        y = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            token, slot = (chosen == e).nonzero(as_tuple=True)
            y.index_add_(0, token, self.expert(x[token], e) * weights[token, slot].unsqueeze(-1))
        return y

    def through(self, x: torch.Tensor, name: str, ids: torch.Tensor) -> torch.Tensor:
        """x [R, cols], each row through expert ids[r]'s rows of the named projection's blocks -> [R, rows]."""
        kind = self.kinds[name]
        return torch.ops.dense_kernels.linear_gguf_experts(x, getattr(self, f"{name}_blocks"), GGUF_TYPES[kind][0],
                                                           ids)

    def expert(self, x: torch.Tensor, e) -> torch.Tensor:
        """x [n, C] through expert e (an int, or a 0-d tensor in a compiled step) -> [n, C]."""
        C, I = x.shape[-1], self.spec.width
        h = torch.cat([gguf_linear(x, self.gate_blocks[e], self.kinds["gate"], C),
                       gguf_linear(x, self.up_blocks[e], self.kinds["up"], C)], dim=-1)  # [n, 2I]
        return gguf_linear(self.activate(h), self.down_blocks[e], self.kinds["down"], I)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise CheckpointError(f"unknown quantization mode {mode!r} (choose from {', '.join(MODES)})")


def head_mode(mode: str) -> str | None:
    """The head's mode: int8 beside 4-bit weights, the float weights beside fp8 (as FP8 checkpoints keep it)."""
    return {"int4": "int8", "nf4": "int8", "fp8": None}.get(mode, mode)


def layer_modes(model: DenseDecoder, mode: str, head: str | None = None,
                stored: frozenset[str] | None = None) -> dict[str, str | None]:
    """{model linear name: mode} for the layers a mode quantizes: block linears in the mode, the head in head_mode's
    (None: float; head: a GGUF type, the head in the file's own blocks, GGUFHead). stored: the checkpoint linears a
    folder that came quantized stores quantized (prequantized.stored_linears): a linear stacked from them in the mode,
    every other one (the head too) float, as the folder holds it."""
    chosen = {name: mode for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and MODEL_LINEAR.fullmatch(name)}
    if stored is not None:
        chosen = {name: mode if set(fused_parts(model, name)) <= stored else None for name in chosen}
    if model.lm_head is not None:  # (an MTP draft's predictor has none: the target's serves)
        chosen["lm_head"] = None if stored is not None else "gguf" if head else head_mode(mode)
    return chosen


def fused_parts(model: DenseDecoder, module_name: str) -> dict[str, int]:
    """{checkpoint prefix: rows} of the tensors a module is stacked from (itself alone for most modules): q/k/v (and
    the gate) into qkv_proj, gate and up into gate_up_proj, a Gated DeltaNet's in_proj_* into in_proj."""
    parent, _, leaf = module_name.rpartition(".")
    fused = leaf in ("qkv_proj", "gate_up_proj", "in_proj")
    parts = getattr(model.get_submodule(parent), "parts", None) if fused else None
    return {f"{parent}.{p}": rows for p, rows in parts.items()} if parts else {module_name: 0}


def stack_of(name: str) -> str:
    """The model linear a checkpoint linear is stacked into, as a name that is the same for each of its parts (a
    plain MLP's up_proj: a stack of one)."""
    m = STACKED_PART.fullmatch(name)
    if m is None:
        return name
    return f"{m[3]}.gate_up_proj" if m[3] else f"{m[1]}.qkv_proj" if m[2] else f"{m[1]}.in_proj"


def swap_linears(model: DenseDecoder, mode: str | None, params: dict) -> DenseDecoder:
    """Replace the model's nn.Linear layers by empty quantized ones (mode None: by kernels.Linear, whose CPU decode
    calls run kernels.cpp), built on the same device (meta while loading) and filled by load.load_tensors. params
    "stored": a folder that came quantized, in its own mode: only the linears it stores quantized are (layer_modes)."""
    chosen = layer_modes(model, mode, params.get("head"), params.get("stored")) if mode else \
        {name: None for name, m in model.named_modules() if type(m) is nn.Linear}
    for name, layer_mode in chosen.items():
        old = model.get_submodule(name)
        parent, _, attr = name.rpartition(".")
        with torch.device(old.weight.device):
            if layer_mode is None:
                new = kernels.Linear(old.in_features, old.out_features, old.bias is not None, dtype=old.weight.dtype)
                new.weight, new.bias = old.weight, old.bias
            else:
                new = LINEARS[layer_mode](old.in_features, old.out_features, old.bias is not None, **params)
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    return model


def quantize_model(model: DenseDecoder, mode: str, group_size: int = 32, double_quant: bool = False) -> DenseDecoder:
    """Quantize a loaded full-precision model in place (the weights are read from it). A fused projection is
    quantized whole: every layout is row-major, so that equals quantizing its parts and stacking them."""
    check_mode(mode)
    params, training = {"group_size": group_size}, model.training
    weights = {name: model.get_submodule(name) for name, chosen in layer_modes(model, mode).items() if chosen}
    swap_linears(model, mode, params)
    for name in list(weights):
        old = weights.pop(name)  # its float weight is freed once quantized: peak memory is the float model's, not 2x
        new = model.get_submodule(name)
        stored = new.stored(old.weight.detach(), **params)
        if "absmax_q" in stored:
            stored["absmax"] = double_quant_absmax(*(stored.pop(k) for k in DOUBLE_QUANT))
        for key, t in stored.items():
            new._buffers[key] = t.to(old.weight.device)
        if old.bias is not None:
            new.bias = nn.Parameter(old.bias.detach(), requires_grad=False)
        new.finish_loading()
    return model.train(training)  # the new layers (bitsandbytes' too) in the model's mode: eval computes differently
