"""load.py: a checkpoint path -> a model ready to run, in one downward pass.

    import load
    model = load.from_pretrained("path/to/ckpt", device="cpu", dtype=torch.float32, quant="auto")

read the checkpoint (convert.py: the native format and every foreign layout) -> choose what to load (a saved
quantized variant, quantizing tensor by tensor as they load, or the full-precision weights) -> build the model on the
meta device -> swap in quantized linears (quantized.py) -> read each tensor (memory-mapped), check it, cast it and
move it to `device`, one at a time (dense.DenseDecoder.load_tensors) -> place the weights for the CPU kernels.
Stands on dense.py, kernels.py, quantized.py and convert.py; tp.py loads shards through its `shard` hook.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch

import convert
import dense
import kernels
import quantized
from dense import CheckpointError


def from_pretrained(path, device="cpu", dtype: torch.dtype | None = None, quant: str | None = None,
                    shard: Callable | None = None) -> dense.DenseDecoder:
    """A checkpoint folder (or file) as a DenseDecoder. dtype=None: the checkpoint's declared torch_dtype, else
    float32 (bfloat16 on a GPU, whatever the checkpoint declares: its tensor cores' type). quant=None loads what is
    stored (the full-precision weights, or the only quantized variant of a folder that has no other); "int8" | "int4"
    | "nf4" | "llm.int8" loads that variant (saved by quantize.py, else quantized tensor by tensor as it loads);
    "auto" picks what auto_mode says; "none" forces full precision. shard: tensor parallel's hook (tp.py),
    (checkpoint, tensors, mode) -> one rank's config and tensor slices."""
    checkpoint = convert.read_checkpoint(path)
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else checkpoint.dtype or torch.float32)
    mode, params, tensors = select(checkpoint, quant, device=device)
    config = checkpoint.config
    if shard is not None:
        config, tensors = shard(checkpoint, tensors, mode)
    dense.check_fits(config, dtype, torch.device(device), checkpoint.path, quantized.BYTES_PER_WEIGHT.get(mode))
    with torch.device("meta"), no_init():
        model = dense.DenseDecoder(config)
    quantized.swap_linears(model, mode, params)  # quantized linears, or kernels.Linear for full precision
    model.load_tensors(tensors, device, dtype, source=checkpoint.path)
    kernels.place_weights(model)  # huge pages for the weights a decode step streams (CPU)
    # how to load it again (background.py compiles its steps in another process from this)
    model.source = {"ckpt": checkpoint.path, "quant": mode, "dtype": dtype, "device": str(device)}
    return model


class no_init:
    """Skip the random initialization of layers built on the meta device: their values are never used (the checkpoint
    fills them), and each init op there costs ~2 ms of Python (1.5 s for a 30-layer model, measured)."""
    NAMES = ("kaiming_uniform_", "uniform_", "normal_", "zeros_", "ones_", "trunc_normal_")

    def __enter__(self):
        self.saved = {name: getattr(torch.nn.init, name) for name in self.NAMES}
        for name in self.NAMES:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(torch.nn.init, name, fn)


# ----------------------------------------------------------------------------------------------------------------
# Choosing what to load: a saved variant, quantizing as the tensors load, or the full-precision weights


def notice_stderr(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def auto_mode(checkpoint, device="cpu") -> tuple[str | None, str]:
    """What `--quant auto` loads, and why: int4-g32 for weights that came from a GGUF's Q4_0/Q4_1 blocks (int4
    holds them exactly, and int4 is the fastest kernel: ours on CPU, tinygemm on CUDA, whose bfloat16 scales round
    the blocks' float16 ones); everything else as stored."""
    types = checkpoint.record.get("source_tensor_types", {}).get("blocks") or {}
    if checkpoint.source_types:  # a .gguf file itself
        types = {kind for name, kind in checkpoint.source_types.items() if quantized.BLOCK_LINEAR.fullmatch(name[:-7])}
    saved = checkpoint.record.get("quantization", {})
    exact = "int4" in saved or bool(checkpoint.exact_int4)
    if types and set(types) <= set(quantized.EXACT_INT4_TYPES) and exact:
        held = "exactly" if torch.device(device).type != "cuda" else "(on CUDA with bfloat16 scales)"
        return "int4", f"the weights are {'/'.join(sorted(types))} blocks from a GGUF, which int4-g32 holds {held}"
    if not checkpoint.tensors and len(saved) == 1:
        return next(iter(saved)), "the only variant stored"
    what = f"{'/'.join(sorted(types))} weights from a GGUF" if types else "full-precision weights"
    return None, f"{what}: loaded as stored (--quant int4 for the fastest CPU decode)"


def select(checkpoint, quant: str | None, notice=notice_stderr, device="cpu") -> tuple[str | None, dict, dict]:
    """(mode, layer params, {checkpoint name: thunk}) for from_pretrained: the saved variant of `quant` when there is
    one, else the full-precision tensors quantized one by one as they load, on `device` (a GPU's minutes are a CPU's
    seconds). quant=None loads what is stored."""
    saved = checkpoint.record.get("quantization", {})
    if quant == "auto":
        quant = auto_mode(checkpoint, device)[0] or "none"
    if quant is None:
        quant = next(iter(saved)) if not checkpoint.tensors and len(saved) == 1 else "none"
    if quant == "none":
        if not checkpoint.tensors:
            raise CheckpointError(f"{checkpoint.path}: holds only quantized variants ({', '.join(saved)}), no "
                                  "full-precision weights")
        return None, {}, checkpoint.tensors
    quantized.check_mode(quant)
    record = saved.get(quant, {})
    params = {"group_size": record.get("group_size") or 32}
    file = os.path.join(checkpoint.path, convert.variant_file(quant))
    if record and os.path.isfile(file):
        return quant, params, expand_double_quant(convert.open_safetensors(file))
    if not checkpoint.tensors:
        raise CheckpointError(f"{checkpoint.path}: no saved {quant} variant and no full-precision weights to make one")
    exact = checkpoint.exact_int4 if quant == "int4" and params["group_size"] == 32 else None
    if not exact:
        notice(f"{checkpoint.path}: no saved {quant} variant; quantizing at load time (python quantize.py --ckpt "
               f"{checkpoint.path} --mode {quant} saves one)")
    return quant, params, convert.quantized_table(checkpoint, quant, params, exact, device)


def expand_double_quant(table: dict) -> dict:
    """nf4 --double-quant stores 8-bit block scales; the model holds them expanded (double quantization saves file
    size, not compute)."""
    table = dict(table)
    for name in [n for n in table if n.endswith(".absmax_q")]:
        prefix = name.removesuffix(".absmax_q")
        parts = [table.pop(f"{prefix}.{k}") for k in quantized.DOUBLE_QUANT if f"{prefix}.{k}" in table]
        if len(parts) == len(quantized.DOUBLE_QUANT):
            table[f"{prefix}.absmax"] = lambda parts=parts: quantized.double_quant_absmax(*(p() for p in parts))
    return table
