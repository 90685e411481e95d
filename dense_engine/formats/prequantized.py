"""prequantized.py: Hugging Face folders that come quantized (config.json's quantization_config): GPTQ, AWQ,
compressed-tensors, fine-grained FP8 and bitsandbytes. Each quantized linear's stored tensors become its float weight,
read as the format's own tool means them, before a family's names are mapped (families.hf_weights); the loader then
runs them as any full-precision checkpoint (--quant quantizes them again). The traps that make a loader answer
garbage in silence, each handled where it is read: GPTQ's "v1" zero points stored minus one, its input channels in
act-order groups (g_idx), AWQ's eight codes a word in the order 0, 2, 4, 6, 1, 3, 5, 7, FP8's scale per block
(weight_scale_inv). An unknown method, format or bit width, and a linear missing a scale, are refused in one line.
Loaded in its own mode (--quant auto's pick, or that mode asked), a folder runs as stored: its quantized linears in the
mode, every tensor it holds in float (the head, embeddings, norms, a linear it left unquantized) float (stored_linears,
as_stored); another mode quantizes those too, and the first line says so (requantizing).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from dense_engine.cpu import quantized
from dense_engine.formats.checkpoint import read_json
from dense_engine.system.errors import CheckpointError
from dense_engine.system.machine import note

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column (of eight) that AWQ packs in each 4-bit slot of a word, low first


@dataclass(frozen=True)
class Scheme:
    """How a folder's linears are stored. method: gptq | awq | compressed-tensors | fp8 | bitsandbytes."""
    method: str
    bits: int = 4
    group: int = -1  # input channels per scale (-1: one per output channel)
    zeros_minus_one: bool = False  # GPTQ v1: each stored zero point is the zero point minus one
    block: tuple[int, int] = (128, 128)  # FP8's [rows, columns] per scale (0: the whole dimension)
    source: str = ""
    mode: str | None = None  # the engine's own quantization that holds these numbers exactly (quantized.py), if any

    def reason(self) -> str:
        return (f"the folder's {self.method} {self.mode} weights, which {self.mode} holds exactly; its float tensors "
                "(the head, embeddings, norms) as stored")


def read_scheme(raw: dict, source: str) -> Scheme | None:
    """A config's quantization_config as a Scheme (None: not quantized); what this engine cannot read is refused in
    one line naming the field."""
    q = raw.get("quantization_config")
    if q is None:
        return None

    def refuse(key: str, value, why: str):
        raise CheckpointError(f"{source}: quantization_config.{key} {value!r} is not supported ({why})")

    if not isinstance(q, dict):
        refuse("", q, "an object")
    method = q.get("quant_method")
    if method == "gptq":
        bits, form = int(q.get("bits", 4)), q.get("checkpoint_format", "gptq")
        if bits not in (4, 8):
            refuse("bits", bits, "GPTQ with 4 or 8 bits")
        if form not in ("gptq", "gptq_v2"):
            refuse("checkpoint_format", form, "gptq or gptq_v2")
        group = int(q.get("group_size", 128))
        exact = bits == 4 and not q.get("desc_act") and (group % 32 == 0 or group == -1)
        return Scheme("gptq", bits, group, form == "gptq", source=source, mode="int4" if exact else None)
    if method == "awq":
        bits, version = int(q.get("bits", q.get("w_bit", 4))), str(q.get("version", "gemm")).lower()
        if bits != 4:
            refuse("bits", bits, "AWQ with 4 bits")
        if version != "gemm":
            refuse("version", version, "AWQ's gemm layout")
        if not q.get("zero_point", True):
            refuse("zero_point", False, "AWQ with zero points")
        group = int(q.get("group_size", q.get("q_group_size", 128)))
        return Scheme("awq", 4, group, source=source, mode="int4" if group % 32 == 0 or group == -1 else None)
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            refuse("fmt", q.get("fmt"), "e4m3")
        block = q.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            refuse("weight_block_size", block, "[rows, columns]")
        return Scheme("fp8", 8, block=tuple(block) if block else (0, 0), source=source, mode="fp8")
    if method == "bitsandbytes":  # (nf4 in blocks of 64 is quantized.py's nf4; int8 rows are its int8: loaded so,
        # they quantize again to the codes stored)
        four = bool(q.get("load_in_4bit") or q.get("_load_in_4bit"))
        kind = q.get("bnb_4bit_quant_type", "nf4") if four else "int8"
        return Scheme("bitsandbytes", 4 if four else 8, source=source, mode=kind if kind in ("nf4", "int8") else None)
    if method == "compressed-tensors":  # (each linear's strategy, channel, group or block, read from its scale's
        # shape; its activations' scheme is the matmul's, not the weights')
        form = q.get("format")
        if form not in ("pack-quantized", "float-quantized", "int-quantized", "naive-quantized"):
            refuse("format", form, "pack-quantized, float-quantized, int-quantized or naive-quantized")
        weights = [(g or {}).get("weights") or {} for g in (q.get("config_groups") or {}).values()]
        kinds = {(w.get("num_bits", 8), w.get("type", "int"), tuple(w.get("block_structure") or (0, 0)))
                 for w in weights}
        if len(kinds) != 1:
            refuse("config_groups", "...", "one weight scheme for every group")
        (bits, kind, block), = kinds
        if (kind, bits) not in (("int", 4), ("int", 8), ("float", 8)):
            refuse("config_groups.weights", f"{kind}{bits}", "int4, int8 or float8 weights")
        if (form == "float-quantized") != (kind == "float"):
            refuse("format", form, f"{kind} weights in their own format")
        group = {int(w.get("group_size") or -1) for w in weights}.pop()
        columns = block[1] or max(group, 0)  # (fp8's inputs per scale: 0, one scale a row or the tensor)
        return Scheme("compressed-tensors", bits, group, block=(block[0], columns), source=source,
                      mode="fp8" if kind == "float" else None)
    refuse("quant_method", method, "gptq, awq, compressed-tensors, fp8 or bitsandbytes")


def exact_tensors(table: dict, scheme: Scheme | None) -> tuple[dict, Scheme | None]:
    """({native linear name: thunk of its stored tensors in scheme.mode}, the scheme) for a family's table whose
    weights the engine's own mode holds exactly (Checkpoint.exact): GPTQ / AWQ's codes in int4-g32, FP8 values and
    scales in fp8; a scheme whose linears the family changed on the way (split, scaled) loads as float instead."""
    if scheme is None or scheme.mode not in ("int4", "fp8"):
        return {}, scheme
    stored = {name: getattr(thunk, "base", thunk) for name, thunk in table.items()}  # (under a LoRA's lora.Merged)
    exact = {name.removesuffix(".weight"): getattr(thunk, scheme.mode) for name, thunk in stored.items()
             if isinstance(thunk, Dequantized)}
    return exact, scheme if exact else dataclasses.replace(scheme, mode=None)


def is_quantized(thunk) -> bool:
    """Whether a table's weight thunk is a linear the folder stores quantized (under a LoRA's lora.Merged too)."""
    return isinstance(getattr(thunk, "base", thunk), Dequantized)


def block_linears(table: dict) -> set[str]:
    """The names of a table's decoder-block linears (quantized.BLOCK_LINEAR), each with its weight."""
    names = {n.removesuffix(".weight") for n in table if n.endswith(".weight")}
    return {n for n in names if quantized.BLOCK_LINEAR.fullmatch(n)}


def stored_linears(table: dict) -> frozenset[str]:
    """The block linears a folder stores quantized, which its own mode runs quantized (quantized.layer_modes' stored):
    all the parts the model stacks into one linear (q/k/v, gate/up) or none, so that a part the folder left in float
    (an ignore list's, modules_to_not_convert) keeps its stack float (its quantized parts dequantized: the same
    numbers). The head is never among them: the folder's float head runs float (a quantized one, dequantized)."""
    names = block_linears(table)
    stored = {n for n in names if is_quantized(table[f"{n}.weight"])}
    float_stacks = {quantized.stack_of(n) for n in names - stored}
    return frozenset(n for n in stored if quantized.stack_of(n) not in float_stacks)


def as_stored(table: dict, tensors: dict, stored: frozenset[str]) -> dict:
    """A quantized table (convert.quantized_table's, of a folder that came quantized, in its own mode) with every
    linear but `stored` (the head too) back to the folder's own tensors: float, as the folder holds them."""
    kept = (block_linears(tensors) | {"lm_head"}) - stored
    out = {name: thunk for name, thunk in table.items() if name.rpartition(".")[0] not in kept}
    return out | {name: thunk for name, thunk in tensors.items() if name.rpartition(".")[0] in kept}


def requantizing(tensors: dict, scheme: Scheme, mode: str) -> str:
    """What `--quant mode` does to a folder that came quantized, for the first line's reason: its own mode runs it as
    stored (the float tensors float); another mode quantizes its float head (head_mode's: int8 beside 4 bits) and
    float linears, and its quantized weights again."""
    if mode == scheme.mode:
        return f": {scheme.reason()}"
    if mode not in quantized.MODES:
        return ""
    names = block_linears(tensors)
    floats = len([n for n in names if not is_quantized(tensors[f"{n}.weight"])])
    head = quantized.head_mode(mode)
    what = [f"float head to {head}"] if head and not is_quantized(tensors.get("lm_head.weight")) else []
    what += [f"{floats} float linear{'s' if floats > 1 else ''} to {mode}"] if floats else []
    what += [f"{scheme.method} weights again to {mode}"]
    what = [what[0]] + [f"its {w}" for w in what[1:]]
    listed = f"{', '.join(what[:-1])} and {what[-1]}" if len(what) > 1 else what[0]
    return f", which quantizes the folder's {listed}; --quant auto runs it as stored"


def dequantized_weights(table: dict, folder: str) -> dict:
    """{name: thunk} of a folder's tensors, each quantized linear's stored tensors replaced by its float32 weight
    (name.weight); as it was where the folder is not quantized."""
    config = os.path.join(folder, "config.json")
    scheme = read_scheme(read_json(config), config) if os.path.isfile(config) else None
    if scheme is None:
        return table
    read = {"gptq": gptq_codes, "awq": awq_codes, "fp8": fp8_weight, "bitsandbytes": bnb_weight,
            "compressed-tensors": compressed_weight}[scheme.method]
    marks = {"gptq": ".qweight", "awq": ".qweight", "fp8": ".weight_scale_inv", "bitsandbytes": ".weight",
             "compressed-tensors": ".weight_scale"}
    linears = {name.removesuffix(marks[scheme.method]) for name, thunk in table.items()
               if name.endswith(marks[scheme.method])}
    if scheme.method == "bitsandbytes":  # (its quantized weights are the ones with a quant state or row scales)
        linears = {p for p in linears if f"{p}.weight.absmax" in table or f"{p}.SCB" in table}
    out = {name: unscaled_check(thunk, name, scheme, marks[scheme.method]) for name, thunk in table.items()
           if not any(name.startswith(p + ".") for p in linears)}
    for prefix in sorted(linears):
        parts = {name[len(prefix) + 1:]: thunk for name, thunk in table.items() if name.startswith(prefix + ".")}
        out[prefix + ".weight"] = Dequantized(read, parts, scheme, prefix)
        if "bias" in parts:
            out[prefix + ".bias"] = parts["bias"]
    if scheme.mode is None:
        note(f"{folder}: {scheme.method} weights ({len(linears)} linears) dequantized as they load: they run as "
             "full-precision weights (--quant int4 quantizes them again)")
    return out


def unscaled_check(thunk, name: str, scheme: Scheme, mark: str):
    """thunk, refusing in one line a float8 tensor that came without its scale (read as is, it would be garbage)."""
    def read() -> torch.Tensor:
        t = thunk()
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise CheckpointError(f"{scheme.source}: {name.removesuffix('.weight')}{mark} is missing ({name} is "
                                  f"stored as {t.dtype} and needs its scale)")
        return t
    return read


def needed(parts: dict, names: tuple[str, ...], scheme: Scheme, prefix: str) -> list[torch.Tensor]:
    missing = [n for n in names if n not in parts]
    if missing:
        raise CheckpointError(f"{scheme.source}: {prefix}.{missing[0]} is missing ({scheme.method} needs "
                              f"{', '.join(names)} for each quantized linear)")
    return [parts[n]() for n in names]


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits codes each, lowest bits first, unpacked along dim (0: rows, 1: columns)."""
    packed = packed.long() & 0xFFFFFFFF  # (as unsigned words)
    shifts = torch.arange(0, 32, bits)
    mask = (1 << bits) - 1
    if dim == 0:  # [R, C] -> [R * per, C]
        return ((packed[:, None, :] >> shifts[None, :, None]) & mask).flatten(0, 1)
    return ((packed[:, :, None] >> shifts[None, None, :]) & mask).flatten(1, 2)  # [R, C] -> [R, C * per]


@dataclass
class Codes:
    """A linear's codes with zero points: q [in, out] (0 .. 2^bits - 1), zeros and scales [groups, out], each input
    channel's group [in]. W[o, i] = scales[g_i, o] * (q[i, o] - zeros[g_i, o])."""
    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    groups: torch.Tensor

    def weight(self) -> torch.Tensor:
        g = self.groups
        return (self.scales.float()[g] * (self.q - self.zeros[g]).float()).t().contiguous()

    def int4(self) -> dict:
        """Int4Linear's tensors ([out, in / 2] pairs, scales and mins [out, in / 32]) holding these numbers exactly:
        each 32 inputs in one group, min = -scale * zero in float32 (a float16 scale times a 4-bit integer: exact),
        so min + scale * q is W, to the bit."""
        starts = self.groups[::32]
        if self.q.shape[0] % 32 or not torch.equal(self.groups, starts.repeat_interleave(32)):
            raise CheckpointError("int4: the groups of these codes are not whole 32s of inputs in order")
        codes = self.q.t().to(torch.uint8)  # [out, in]
        scales = self.scales.float()[starts].t().contiguous()  # [out, in / 32]
        return {"qweight": codes[:, 0::2] | (codes[:, 1::2] << 4), "scales": scales,
                "mins": -(scales * self.zeros[starts].t().float())}


@dataclass
class Float8:
    """A linear's float8 e4m3 values q [out, in] and the scales they are multiplied by, one per block of
    block = (rows, columns) (0: the whole dimension): scales [ceil(out / rows), ceil(in / columns)]."""
    q: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]

    def weight(self) -> torch.Tensor:
        return blocks_times(self.q.float(), self.scales.float(), self.block)

    def fp8(self, columns: int, source: str, prefix: str) -> dict:
        """Float8Linear's tensors holding these numbers exactly: the values as stored, and each block's scale on each
        of its rows (scales [out, ceil(in / columns)]; columns 0: one a row)."""
        (out, inputs), (rows, cols) = self.q.shape, self.block
        if (cols or inputs) != (columns or inputs):
            raise CheckpointError(f"{source}: {prefix}'s scales cover {cols or inputs} inputs each, where the "
                                  f"folder's scheme says {columns or 'a whole row'}")
        scales = self.scales.float().reshape(1, 1) if self.scales.numel() == 1 else self.scales.float()
        return {"weight": self.q, "scales": scales.repeat_interleave(rows or out, dim=0)[:out]}


class Dequantized:
    """A quantized linear's weight thunk: called, its float32 weight; int4() (GPTQ, AWQ) and fp8() (FP8 folders), its
    tensors in the engine's mode that holds them exactly (Codes.int4, Float8.fp8), which convert.exact_variant uses as
    they are."""

    def __init__(self, read, parts: dict, scheme: Scheme, prefix: str) -> None:
        self.read, self.parts, self.scheme, self.prefix = read, parts, scheme, prefix

    def __call__(self) -> torch.Tensor:
        made = self.read(self.parts, self.scheme, self.prefix)
        return made.weight() if isinstance(made, (Codes, Float8)) else made

    def int4(self) -> dict:
        return self.read(self.parts, self.scheme, self.prefix).int4()

    def fp8(self) -> dict:
        return self.read(self.parts, self.scheme, self.prefix).fp8(self.scheme.block[1], self.scheme.source,
                                                                   self.prefix)


def gptq_codes(parts: dict, scheme: Scheme, prefix: str) -> Codes:
    """GPTQ: qweight [in * bits / 32, out] packs input rows; qzeros [groups, out * bits / 32] packs columns (v1: each
    the zero point minus one); scales [groups, out]; g_idx [in] each input channel's group (act-order: not in order)."""
    qweight, qzeros, scales = needed(parts, ("qweight", "qzeros", "scales"), scheme, prefix)
    bits = scheme.bits
    codes = unpack(qweight, bits, 0)  # [in, out]
    if scheme.zeros_minus_one:  # one added to each, word by word as GPTQModel's reader adds it (a stored -1, zero 0,
        # borrowed from the next: the carry gives it back)
        qzeros = qzeros.long() + sum(1 << shift for shift in range(0, 32, bits))
    zeros = unpack(qzeros, bits, 1)[:, :codes.shape[1]]  # [groups, out]
    rows = codes.shape[0]
    if "g_idx" in parts:
        groups = parts["g_idx"]().long()
    else:
        groups = torch.arange(rows) // (scheme.group if scheme.group > 0 else rows)
    if groups.shape != (rows,) or int(groups.max()) >= scales.shape[0]:
        raise CheckpointError(f"{scheme.source}: {prefix}.g_idx does not give each of {rows} input channels one of "
                              f"its {scales.shape[0]} groups")
    return Codes(codes, zeros, scales, groups)


def awq_codes(parts: dict, scheme: Scheme, prefix: str) -> Codes:
    """AWQ (gemm): qweight [in, out / 8] and qzeros [in / group, out / 8] pack eight columns a word in AWQ_ORDER;
    scales [in / group, out]."""
    qweight, qzeros, scales = needed(parts, ("qweight", "qzeros", "scales"), scheme, prefix)
    out = qweight.shape[1] * 8
    order = torch.tensor(AWQ_ORDER).argsort()  # slot of each column within its eight
    columns = torch.arange(out) // 8 * 8 + order.repeat(out // 8)  # [out]: the slot that holds each column
    codes = unpack(qweight, 4, 1)[:, columns]  # [in, out]
    zeros = unpack(qzeros, 4, 1)[:, columns]  # [groups, out]
    group = scheme.group if scheme.group > 0 else codes.shape[0]
    return Codes(codes, zeros, scales, torch.arange(codes.shape[0]) // group)


def fp8_weight(parts: dict, scheme: Scheme, prefix: str) -> Float8:
    """Fine-grained FP8: weight e4m3 [out, in] and weight_scale_inv [ceil(out / rows), ceil(in / columns)], the
    scale each block's values are multiplied by (despite its name)."""
    weight, scale = needed(parts, ("weight", "weight_scale_inv"), scheme, prefix)
    return Float8(weight, scale, scheme.block)


def blocks_times(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [out, in] times a scale per [rows, columns] block (scale [ceil(out / rows), ceil(in / columns)]; 0: the
    whole dimension)."""
    rows, cols = block[0] or w.shape[0], block[1] or w.shape[1]
    scale = scale.reshape(1, 1) if scale.numel() == 1 else scale
    expanded = scale.repeat_interleave(rows, 0)[:w.shape[0]].repeat_interleave(cols, 1)[:, :w.shape[1]]
    return w * expanded


def bnb_weight(parts: dict, scheme: Scheme, prefix: str) -> torch.Tensor:
    """bitsandbytes: 4-bit (nf4, fp4) as its QuantState describes it (absmax per block, nested or not; the state's
    JSON, no pickle), dequantized by bitsandbytes itself; 8-bit: int8 rows times SCB / 127."""
    if "SCB" in parts:
        weight, scb = needed(parts, ("weight", "SCB"), scheme, prefix)
        return weight.float() * (scb.float()[:, None] / 127)
    from bitsandbytes.functional import QuantState, dequantize_4bit

    quant_state = {name.removeprefix("weight."): thunk() for name, thunk in parts.items() if name.startswith("weight.")}
    if not any(name.startswith("quant_state.") for name in quant_state):
        raise CheckpointError(f"{scheme.source}: {prefix}.weight.quant_state.* is missing (bitsandbytes 4-bit "
                              "weights need their quant state)")
    weight = parts["weight"]()
    return dequantize_4bit(weight, QuantState.from_dict(quant_state, device=weight.device)).float()


def compressed_weight(parts: dict, scheme: Scheme, prefix: str) -> torch.Tensor:
    """compressed-tensors: pack-quantized (weight_packed int32 [out, in * bits / 32], each code + 2^(bits - 1) packed
    along the inputs, lowest bits first; an asymmetric scheme's weight_zero_point packed so along the outputs,
    [out * bits / 32, groups]), int- or naive-quantized (int8 weight as is), float-quantized (float8 e4m3 weight).
    W = (q - zero) * scale, the scale [1] (tensor), [out, 1] (channel), [out, groups] (group: the inputs' order, or
    weight_g_idx's) or [out / rows, in / columns] (block)."""
    (scale,) = needed(parts, ("weight_scale",), scheme, prefix)
    scale = scale.float()
    if "weight_packed" in parts:
        packed, shape = needed(parts, ("weight_packed", "weight_shape"), scheme, prefix)
        out, inputs = (int(n) for n in shape)
        offset = 1 << (scheme.bits - 1)
        q = unpack(packed, scheme.bits, 1)[:out, :inputs] - offset
        zero = None
        if "weight_zero_point" in parts:
            zero = unpack(parts["weight_zero_point"](), scheme.bits, 0)[:out] - offset
    else:
        (q,) = needed(parts, ("weight",), scheme, prefix)
        zero = parts["weight_zero_point"]() if "weight_zero_point" in parts else None
        out, inputs = q.shape
    if scheme.mode == "fp8":  # float-quantized: by tensor, channel, group or block, as the scale's shape says
        channel = scale.dim() == 2 and scale.shape[0] == out
        return Float8(q, scale, (1 if channel else scheme.block[0], scheme.block[1]) if scale.numel() > 1 else (0, 0))
    q = q.float()
    if scale.dim() == 2 and scheme.block[0] and scale.shape != (out, 1):
        return blocks_times(q, scale, scheme.block)
    if scale.numel() == 1:
        return q * scale.reshape(())
    groups = parts["weight_g_idx"]().long() if "weight_g_idx" in parts else \
        torch.arange(inputs) // (inputs // scale.shape[1])  # each input channel's group
    if scale.shape[0] != out or int(groups.max()) >= scale.shape[1]:
        raise CheckpointError(f"{scheme.source}: {prefix}.weight_scale {list(scale.shape)} does not fit a weight of "
                              f"[{out}, {inputs}]")
    zero = 0.0 if zero is None else zero.float().reshape(out, -1)[:, groups]
    return (q - zero) * scale[:, groups]
