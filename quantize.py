"""quantize.py: weight-only int8, int4 and nf4 (and bitsandbytes' LLM.int8) variants of a checkpoint.

    python quantize.py --ckpt DIR --mode int8|int4|nf4|llm.int8 [--group-size 32] [--double-quant] [--out DIR]

writes DIR/model.MODE.safetensors and records the mode in DIR/config.json ("quantization"), never touching
model.safetensors. DenseDecoder.from_pretrained(DIR, quant=MODE) then loads the variant directly.

Which layers: every linear of the decoder blocks; the output head in int8 for the 4-bit modes (it is the most
sensitive layer) and in the mode itself for int8; the embedding table stays in the model's dtype.

| mode     | stored per linear                                   | value                          |
| -------- | --------------------------------------------------- | ------------------------------ |
| int8     | weight int8 [out, in], scales [out]                 | scale[o] * q                   |
| int4     | qweight uint8 [out, in/2], scales, mins [out, in/g] | min + scale * q, q in 0..15    |
| nf4      | weight uint8 [out*in/2, 1], absmax [out*in/64]      | absmax * NF4[q] (bitsandbytes) |
|          | --double-quant: absmax_q uint8, absmax_scales, ...  | absmax 8-bit, blocks of 256    |
| llm.int8 | as int8 (bitsandbytes' CB and SCB / 127)            | bitsandbytes Linear8bitLt      |

int4's grid is llama.cpp's Q4_1 grid (min + scale * q per group), so a Q4_1 GGUF re-quantizes to int4-g32 without
loss. nf4 is bitsandbytes' layout bit for bit: blocks of 64 over the flattened weight, absmax per block, two codes
per byte with the first in the high nibble.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
import torch.nn.functional as F
from torch import nn

from dense import CheckpointError, DenseDecoder, read_json

MODES = ("int8", "int4", "nf4", "llm.int8")
# bitsandbytes' NF4 code (float32), in increasing order.
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])
def import_bitsandbytes():
    """bitsandbytes, without its import-time warning about an optional CPU kernel fetched from the Hugging Face hub
    (`kernels` package), which this project does not use."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes

    return bitsandbytes


BLOCK_LINEAR = re.compile(r"layers\.\d+\.(attn\.(q|k|v|gate|o)_proj|mlp\.(gate|up|down)_proj)")


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
    q = q.reshape(out, inp)
    return {"qweight": q[:, 0::2] | (q[:, 1::2] << 4), "scales": scales, "mins": mins}


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
        """Repack for this device's kernel, once the stored tensors are in place."""

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

    def finish_loading(self) -> None:
        if self.weight.data_ptr() % 64:  # memory-mapped from safetensors at any 8-byte offset; the CPU kernel
            self.weight = self.weight.clone()  # crashes on weights that are not 64-byte aligned (PyTorch 2.13)
        # the CPU kernel wants bfloat16 scales; cast once here (a cast inside the graph trips Inductor's lowering)
        self.register_buffer("scales_bf16", self.scales.to(torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            # PyTorch's int8 weight-only CPU kernel. It is fast with bfloat16 activations only (4-20x slower with
            # float32 ones on AVX-512 machines), so activations enter it in bfloat16: +0.1% perplexity, measured.
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16), self.weight,
                                                   self.scales_bf16)
            return self.add_bias(y.to(x.dtype).reshape(*x.shape[:-1], self.out_features))
        # elsewhere torch.compile fuses the int8 -> x.dtype conversion into the matmul's weight loads
        return self.add_bias(F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype))


class Int4Linear(QuantLinear):
    keep_dtype = ("scales", "mins")

    def __init__(self, in_features, out_features, bias, group_size=32, **_) -> None:
        super().__init__(in_features, out_features, bias)
        self.group_size = group_size
        groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.float16))
        self.register_buffer("mins", torch.zeros(out_features, groups, dtype=torch.float16))
        self.packed = self.scales_and_zeros = None

    @staticmethod
    def stored(w, group_size=32, **_):
        return int4_quantize(w, group_size)

    def codes(self) -> torch.Tensor:
        """q in 0..15, [out, in]."""
        low, high = self.qweight & 15, self.qweight >> 4
        return torch.stack((low, high), dim=-1).reshape(self.out_features, self.in_features)

    def finish_loading(self) -> None:
        if self.qweight.device.type == "cpu":  # PyTorch's packed int4 CPU kernel: w = (q - 8) * scale + zero
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes().to(torch.int32), 1)
            zeros = self.mins.float() + 8 * self.scales.float()
            self.scales_and_zeros = torch.stack((self.scales.float().t(), zeros.t()), dim=-1).to(torch.bfloat16)

    def dequantize(self, dtype) -> torch.Tensor:
        g = self.codes().reshape(self.out_features, -1, self.group_size).to(torch.float32)
        w = self.mins.float()[..., None] + self.scales.float()[..., None] * g
        return w.reshape(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:  # the CPU kernel, fast with bfloat16 activations (+0.2% perplexity, measured)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features).to(torch.bfloat16),
                                                          self.packed, self.group_size, self.scales_and_zeros)
            return self.add_bias(y.to(x.dtype).reshape(*x.shape[:-1], self.out_features))
        return self.add_bias(F.linear(x, self.dequantize(x.dtype)))


class NF4Linear(QuantLinear):
    keep_dtype = ("absmax", "absmax_scales", "absmax_code", "absmax_offset")

    def __init__(self, in_features, out_features, bias, double_quant=False, **_) -> None:
        super().__init__(in_features, out_features, bias)
        self.double_quant = double_quant
        blocks = out_features * in_features // 64
        self.register_buffer("weight", torch.zeros(out_features * in_features // 2, 1, dtype=torch.uint8))
        if double_quant:  # absmax = code[absmax_q] * absmax_scales[block of 256] + absmax_offset
            self.register_buffer("absmax_q", torch.zeros(blocks, dtype=torch.uint8))
            self.register_buffer("absmax_scales", torch.ones((blocks + 255) // 256))
            self.register_buffer("absmax_code", torch.zeros(256))
            self.register_buffer("absmax_offset", torch.zeros(1))
        else:
            self.register_buffer("absmax", torch.ones(blocks))
        self.register_buffer("code", NF4.clone(), persistent=False)
        self.bnb_state = None  # bitsandbytes' QuantState, set by finish_loading where its kernel is used

    @staticmethod
    def stored(w, double_quant=False, **_):
        return nf4_quantize(w, double_quant=double_quant)

    def block_absmax(self) -> torch.Tensor:
        """The absmax of every 64-block, float32 [blocks]."""
        if not self.double_quant:
            return self.absmax
        scales = self.absmax_scales.repeat_interleave(256)[: self.absmax_q.numel()]
        return self.absmax_code[self.absmax_q.long()] * scales + self.absmax_offset

    def finish_loading(self) -> None:
        if self.double_quant:  # expanded once: double quantization saves file size, not compute
            self.register_buffer("absmax", self.block_absmax(), persistent=False)
        # On CPU bitsandbytes' own kernel is the faster one (BENCHMARKS.md); its CPU dequantizer mishandles rows
        # that are not a whole number of 64-blocks, so those keep the fused path.
        if self.weight.device.type == "cpu" and self.in_features % 64 == 0:
            bnb = import_bitsandbytes()
            self.bnb_state = bnb.functional.QuantState(
                absmax=self.absmax, shape=torch.Size([self.out_features, self.in_features]), code=NF4.clone(),
                blocksize=64, quant_type="nf4", dtype=torch.float32)

    def dequantize(self, dtype) -> torch.Tensor:
        packed = self.weight.reshape(-1)
        q = torch.stack((packed >> 4, packed & 15), dim=-1).reshape(-1, 64).long()
        w = self.code.to(self.absmax.device)[q] * self.absmax[:, None]
        return w.reshape(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bnb_state is not None and x.dtype == torch.float32:
            import bitsandbytes as bnb  # imported (and quieted) by finish_loading already

            return self.add_bias(bnb.matmul_4bit(x, self.weight.t(), quant_state=self.bnb_state))
        # dequantize-and-matmul: torch.compile fuses the table lookup into the weight loads
        return self.add_bias(F.linear(x, self.dequantize(x.dtype)))


class LLMInt8Linear(Int8Linear):
    """bitsandbytes' Linear8bitLt (LLM.int8 with outlier threshold 6.0, as seed 004 uses), from int8 rows and their
    absmax scales."""

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


LINEARS = {"int8": Int8Linear, "int4": Int4Linear, "nf4": NF4Linear, "llm.int8": LLMInt8Linear}


def layer_modes(model: DenseDecoder, mode: str) -> dict[str, str]:
    """{linear name: mode} for the layers a mode quantizes: block linears in the mode, the head in int8."""
    chosen = {name: mode for name, m in model.named_modules() if isinstance(m, nn.Linear) and BLOCK_LINEAR.fullmatch(name)}
    chosen["lm_head"] = "int8" if mode in ("int4", "nf4") else mode
    return chosen


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise CheckpointError(f"unknown quantization mode {mode!r} (choose from {', '.join(MODES)})")


def saved_variants(path: str) -> dict:
    """The "quantization" record of a native folder's config.json: {mode: {file, group_size, ...}}."""
    config_file = os.path.join(path, "config.json")
    return read_json(config_file).get("quantization", {}) if os.path.isfile(config_file) else {}


def swap_linears(model: DenseDecoder, mode: str, params: dict, quantize_weights: bool = False) -> DenseDecoder:
    """Replace the chosen nn.Linear layers by quantized ones: empty (to be loaded), or quantized from the layers'
    own weights when quantize_weights."""
    if model.config.tie_word_embeddings:  # the head gets its own quantized copy; the embedding stays as it is
        model.config.tie_word_embeddings = False
    for name, layer_mode in layer_modes(model, mode).items():
        old = model.get_submodule(name)
        parent, _, attr = name.rpartition(".")
        new = LINEARS[layer_mode](old.in_features, old.out_features, old.bias is not None, **params)
        if quantize_weights:
            device = old.weight.device
            for key, t in new.stored(old.weight.detach(), **params).items():
                new._buffers[key] = t.to(device)
            if old.bias is not None:
                new.bias = nn.Parameter(old.bias.detach(), requires_grad=False)
            new.finish_loading()
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    return model


# ----------------------------------------------------------------------------------------------------------------
# Saving and loading variants


def variant_file(mode: str) -> str:
    return f"model.{mode}.safetensors"


def quantize_model(model: DenseDecoder, mode: str, group_size: int = 32, double_quant: bool = False) -> DenseDecoder:
    """Quantize a loaded full-precision model in place (the weights are read from it)."""
    check_mode(mode)
    return swap_linears(model, mode, {"group_size": group_size, "double_quant": double_quant}, quantize_weights=True)


def notice_stderr(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def load_quantized(path: str, mode: str, device, dtype, notice=notice_stderr) -> DenseDecoder:
    """from_pretrained(path, quant=mode): the saved variant when there is one, else quantize at load time."""
    from dense import open_safetensors, read_checkpoint

    check_mode(mode)
    record = saved_variants(path)
    saved = os.path.join(path, variant_file(mode))
    if mode not in record or not os.path.isfile(saved):
        notice(f"{path}: no saved {mode} variant; quantizing at load time (python quantize.py --ckpt {path} "
               f"--mode {mode} saves one)")
        model = DenseDecoder.from_pretrained(path, device=device, dtype=dtype)
        return quantize_model(model, mode, record.get(mode, {}).get("group_size") or 32)
    config, _, declared = read_checkpoint(path, weights=False)
    dtype = dtype or declared or torch.float32
    with torch.device("meta"):
        model = DenseDecoder(config)
    swap_linears(model, mode, {"group_size": record[mode].get("group_size") or 32,
                               "double_quant": bool(record[mode].get("double_quant"))})
    model.load_tensors(open_safetensors(saved), device, dtype, source=saved)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.finish_loading()
    return model


def quantize_checkpoint(src: str, mode: str, out: str | None = None, group_size: int = 32, progress=None,
                        double_quant: bool = False) -> str:
    """Write model.MODE.safetensors (+ the config record) beside a native checkpoint, or into `out` with the config
    and tokenizer files, from any checkpoint from_pretrained reads. Returns the written file."""
    import convert
    from dense import read_checkpoint
    from safetensors.torch import save_file

    check_mode(mode)
    src_config = os.path.join(src, "config.json")
    raw = read_json(src_config) if os.path.isdir(src) and os.path.isfile(src_config) else {}
    native = bool(raw) and raw.get("model_type", "dense") == "dense"
    if native and not os.path.isfile(os.path.join(src, "model.safetensors")):
        raise CheckpointError(f"{src}: already quantized (no full-precision model.safetensors to quantize from)")
    if not native and out is None:
        raise CheckpointError(f"{src}: not a native checkpoint; pass --out DIR for the quantized folder")
    if double_quant and mode != "nf4":
        raise CheckpointError("--double-quant applies to --mode nf4 only")
    if mode == "int4" and group_size not in (32, 64, 128):
        raise CheckpointError(f"--group-size must be 32, 64 or 128, got {group_size}")
    config, table, declared = read_checkpoint(src)
    dst = out or src
    os.makedirs(dst, exist_ok=True)
    with torch.device("meta"):
        names = layer_modes(DenseDecoder(config), mode)
    stored, keys = {}, [k for k in table if not (config.tie_word_embeddings and k == "lm_head.weight")]
    for i, key in enumerate(keys):
        t = table[key]()
        layer = key.removesuffix(".weight")
        if key.endswith(".weight") and layer in names:
            for part, value in LINEARS[names[layer]].stored(t, group_size=group_size, double_quant=double_quant).items():
                stored[f"{layer}.{part}"] = value.contiguous()
        else:
            stored[key] = t.contiguous()
        if progress:
            progress(i + 1, len(keys))
    if config.tie_word_embeddings:  # the head is quantized from the shared embedding
        for part, value in LINEARS[names["lm_head"]].stored(stored["embed_tokens.weight"]).items():
            stored[f"lm_head.{part}"] = value.contiguous()
    target = os.path.join(dst, variant_file(mode))
    convert.atomic_write(target, lambda p: save_file(stored, p, metadata={"format": "pt", "quantization": mode}))
    config_path = os.path.join(dst, "config.json")
    if native:  # keep the release's own config.json, adding the record
        values = raw
    else:
        values = {**config.to_dict(), **({"torch_dtype": str(declared).removeprefix("torch.")} if declared else {})}
    values.setdefault("quantization", {})[mode] = {"file": variant_file(mode), "group_size": group_size if mode == "int4"
                                                   else None, "double_quant": double_quant, "head": names["lm_head"]}
    convert.atomic_write(config_path, lambda p: open(p, "w").write(json.dumps(values, indent=2) + "\n"))
    if out is not None:  # the tokenizer files travel too; files already in `out` stay as they are
        for name, write in convert.side_files(src).items():
            if not os.path.exists(os.path.join(dst, name)):
                convert.atomic_write(os.path.join(dst, name), write)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Write an int8 / int4 / nf4 / llm.int8 variant of a checkpoint.")
    parser.add_argument("--ckpt", required=True, help="checkpoint folder or file")
    parser.add_argument("--mode", required=True, choices=MODES)
    parser.add_argument("--group-size", type=int, default=32, help="int4 group size: 32, 64 or 128")
    parser.add_argument("--double-quant", action="store_true", help="nf4: quantize the absmax values too "
                        "(bitsandbytes' compress_statistics; 0.4 fewer bits a weight on disk)")
    parser.add_argument("--out", help="write into this folder (with config and tokenizer) instead of beside --ckpt")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    from rich.progress import Progress

    import convert

    written = []

    def run():
        with Progress(transient=True) as bar:
            task = bar.add_task(f"Quantizing to {args.mode}", total=None)
            written.append(quantize_checkpoint(args.ckpt, args.mode, args.out, args.group_size,
                                               progress=lambda done, total: bar.update(task, completed=done, total=total),
                                               double_quant=args.double_quant))

    status = convert.report_errors(run, args.debug)
    if status == 0:
        print(f"wrote {written[0]} ({os.path.getsize(written[0]) / 2**20:.1f} MiB)")
    return status


if __name__ == "__main__":
    sys.exit(main())
