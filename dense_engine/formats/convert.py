"""convert.py: any supported checkpoint, read as a Checkpoint (families/, gguf_import.py, or the native format),
and native folders written from it: config.json + model.safetensors, the tokenizer files, quantized variants.

    python convert.py SRC DST [--force] [--dtype float32|float16|bfloat16]

Stands on checkpoint.py, families/, gguf_import.py, vocab.py (a GGUF's tokenizer files) and quantized.py; load.py
reads checkpoints through it, and quantize.py's command line writes variants with it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import glob
import json
import os
import shutil
import sys

import torch

from dense import DenseConfig
from dense_engine.cpu import kernels, quantized
from dense_engine.formats import families, gguf_import, lora, prequantized, vocab
from dense_engine.formats.checkpoint import (
    Checkpoint,
    atomic_write,
    config_from_dict,
    current_names,
    locked,
    open_safetensors,
    read_json,
    torch_dtype,
    write_text,
)
from dense_engine.system.errors import CheckpointError, run_program

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def read_checkpoint(path, lora_adapters: tuple = ()) -> Checkpoint:
    """Any supported checkpoint, native or foreign, as a Checkpoint; lora_adapters (lora.Adapter) on its weights
    (lora.Merged thunks)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or folder")
    with lora.applying(tuple(lora_adapters), path):
        checkpoint = mtp_apart(read_any(path))
    return dataclasses.replace(checkpoint, adapters=tuple(lora_adapters)) if lora_adapters else checkpoint


def mtp_apart(checkpoint: Checkpoint) -> Checkpoint:
    """The multi-token prediction layers' tensors (mtp.*, as families and gguf_import name them) moved out of the
    model's into Checkpoint.mtp: the model does not hold them; a draft does (speculative.mtp_draft)."""
    if not any(name.startswith("mtp.") for name in checkpoint.tensors):
        return checkpoint

    def model_only(table: dict) -> dict:
        return {name: value for name, value in table.items() if not name.startswith("mtp.")}
    mtp = {name[len("mtp."):]: thunk for name, thunk in checkpoint.tensors.items() if name.startswith("mtp.")}
    return dataclasses.replace(checkpoint, tensors=model_only(checkpoint.tensors), blocks=model_only(checkpoint.blocks),
                               source_types=model_only(checkpoint.source_types),
                               exact=model_only(checkpoint.exact), mtp=mtp)


def read_any(path: str) -> Checkpoint:
    config_file = os.path.join(path, "config.json")
    if os.path.isdir(path) and os.path.isfile(config_file):
        raw = read_json(config_file)
        if raw.get("model_type", "dense") == "dense" and "dim" not in raw:  # native (the ShellElastic release's) format
            config = config_from_dict(raw, config_file)
            weights = os.path.join(path, "model.safetensors")
            if not os.path.isfile(weights) and not raw.get("quantization"):
                raise CheckpointError(f"{path}: no model.safetensors beside config.json")
            tensors = current_names(open_safetensors(weights)) if os.path.isfile(weights) else {}
            tensors = lora.merged(tensors, path, lora.native_names) if tensors else tensors
            return Checkpoint(path, config, tensors, torch_dtype(raw.get("torch_dtype")), raw)
    return read_foreign(path)


# ----------------------------------------------------------------------------------------------------------------
# Dispatch


def read_foreign(path: str) -> Checkpoint:
    """A non-native checkpoint as a Checkpoint (no record)."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return gguf_import.read_gguf(path, families.GGUF_FAMILIES)
    if os.path.isfile(path):
        return families.read_torch_file(path, None)
    if glob.glob(os.path.join(path, "global_step*")):
        config, table = families.neox_original(path)
        return Checkpoint(path, config, table)
    config_file = os.path.join(path, "config.json")
    if os.path.isfile(config_file):
        raw = read_json(config_file)
        declared = torch_dtype(raw.get("torch_dtype") or raw.get("dtype"))
        model_type = raw.get("model_type")
        families.refuse_moe(raw, config_file)
        scheme = prequantized.read_scheme(raw, config_file)  # (hf_weights reads its tensors so)
        raw = {key: value for key, value in raw.items() if key != "quantization_config"}
        if model_type in families.HF_FAMILIES:
            config, table = families.HF_FAMILIES[model_type](path, raw, config_file)
            exact, scheme = prequantized.exact_tensors(table, scheme)
            return Checkpoint(path, config, table, declared, exact=exact, scheme=scheme)
        if model_type is None and "dim" in raw:  # a Sprout state dict beside its config.json
            weights = [os.path.join(path, n) for n in ("model.safetensors", "model.pt", "ckpt.pt", "pytorch_model.bin")]
            weights = [w for w in weights if os.path.isfile(w)]
            if not weights:
                raise CheckpointError(f"{path}: no model.safetensors or model.pt beside config.json")
            return families.read_torch_file(weights[0], raw)
        raise CheckpointError(f"{config_file}: unknown model_type {model_type!r} (supported: "
                              f"{', '.join(families.HF_FAMILIES)}, or a native dense config)")
    for name in ("ckpt.pt", "checkpoint.pt"):
        if os.path.isfile(os.path.join(path, name)):
            return families.read_torch_file(os.path.join(path, name), None)
    ggufs = glob.glob(os.path.join(path, "*.gguf"))
    if len(ggufs) == 1:
        return read_foreign(ggufs[0])
    raise CheckpointError(f"{path}: not a checkpoint folder (no config.json, ckpt.pt, checkpoint.pt or .gguf)")


# ----------------------------------------------------------------------------------------------------------------
# Writing a native folder

def tokenizer_sources(src: str) -> dict[str, str]:
    """{native file name: source path} for the tokenizer files that travel with a checkpoint."""
    folder = src if os.path.isdir(src) else os.path.dirname(src)
    found = {n: os.path.join(folder, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))}
    neox = os.path.join(folder, "20B_tokenizer.json")
    if "tokenizer.json" not in found and os.path.isfile(neox):
        found["tokenizer.json"] = neox
    return found


def side_files(src: str) -> dict:
    """{file name: writer(path)} for the tokenizer and generation files that travel with a checkpoint: copied from
    beside SRC, or, for a GGUF, rebuilt from its metadata (tokenizer.json, tokenizer_config.json, ...)."""
    writers = {name: (lambda p, s=path: shutil.copyfile(s, p)) for name, path in tokenizer_sources(src).items()}
    if os.path.isfile(src) and src.endswith(".gguf"):
        writers.update({name: (lambda p, t=text: write_text(p, t))
                        for name, text in vocab.gguf_side_files(src).items()})
    return writers


def convert(src: str, dst: str, force: bool = False, dtype: torch.dtype | None = None, progress=None) -> None:
    """Write DST/config.json + DST/model.safetensors (+ tokenizer files) from any supported SRC. A GGUF source's
    tensor types are recorded in config.json, and its Q4_0 / Q4_1 blocks also become DST/model.int4.safetensors, bit
    for bit (what `--quant auto` loads)."""
    checkpoint = read_checkpoint(src)
    dtype = dtype or checkpoint.dtype
    extra = side_files(src)
    os.makedirs(dst, exist_ok=True)
    clash = [n for n in ("config.json", "model.safetensors", *extra) if os.path.exists(os.path.join(dst, n))]
    if clash and not force:
        raise CheckpointError(f"{dst}: {clash[0]} already exists (use --force to overwrite)")
    tensors = {}
    for i, (name, read) in enumerate(checkpoint.tensors.items()):
        t = read()
        tensors[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
        if progress:
            progress(i + 1, len(checkpoint.tensors))
    write_native(dst, checkpoint.config, tensors, dtype, source_record(checkpoint))
    del tensors
    for name, write in extra.items():
        atomic_write(os.path.join(dst, name), write)
    blocks = {n.removesuffix(".weight") for n in checkpoint.source_types if quantized.BLOCK_LINEAR.fullmatch(n[:-7])}
    if blocks and blocks <= set(checkpoint.exact):
        exact, params = exact_variant(checkpoint, "int4", 32)
        write_variant(read_checkpoint(dst), "int4", dst, params, exact=exact)


def exact_variant(checkpoint: Checkpoint, mode: str, group_size: int, device="cpu") -> tuple[dict | None, dict]:
    """(exact tensors, layer params) for making `mode` from what a checkpoint stores: int4-g32 holds a GGUF's Q4_0/Q4_1
    block linears exactly (and GPTQ / AWQ's codes), fp8 an FP8 folder's values and scales; a GGUF's head keeps the
    file's own blocks (a tied head: the embedding's), multiplied as stored (quantized.GGUFHead; on the CPU, where a
    kernel does it). (None, params): nothing exact to keep."""
    params = {"group_size": group_size}
    held = checkpoint.scheme.mode if checkpoint.scheme is not None else "int4"  # (a GGUF's exact tensors: int4)
    if mode != held or (mode == "int4" and group_size != 32) or not checkpoint.exact:
        return None, params
    exact = dict(checkpoint.exact)
    if mode == "fp8":
        return exact, {**params, "fp8_block": checkpoint.scheme.block[1]}
    head = checkpoint.blocks.get("lm_head.weight" if "lm_head.weight" in checkpoint.tensors else "embed_tokens.weight")
    if head is not None and torch.device(device).type == "cpu":
        exact["lm_head"] = lambda: {"blocks0": head.read()}
        params["head"] = head.kind
    return exact, params


def source_record(checkpoint: Checkpoint) -> dict:
    """{"source_format", "source_tensor_types": {"blocks": {type: count}, "other": {type: count}}} for a GGUF."""
    if not checkpoint.source_types:
        return {}
    kinds = {"blocks": collections.Counter(), "other": collections.Counter()}
    for name, kind in checkpoint.source_types.items():
        kinds["blocks" if quantized.BLOCK_LINEAR.fullmatch(name.removesuffix(".weight")) else "other"][kind] += 1
    return {"source_format": "gguf", "source_tensor_types": {k: dict(v) for k, v in kinds.items()}}


def write_native(dst: str, config: DenseConfig, tensors: dict[str, torch.Tensor], dtype=None,
                 record: dict | None = None) -> None:
    """DST/model.safetensors and DST/config.json, each written to a temporary file and renamed into place."""
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    atomic_write(os.path.join(dst, "model.safetensors"), lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    values = {**dataclasses.asdict(config), **(record or {})}
    if dtype is not None:
        values["torch_dtype"] = str(dtype).removeprefix("torch.")
    atomic_write(os.path.join(dst, "config.json"), lambda p: write_text(p, json.dumps(values, indent=2) + "\n"))


# ----------------------------------------------------------------------------------------------------------------
# Quantized variants: model.MODE.safetensors beside a native checkpoint


def variant_file(mode: str) -> str:
    return f"model.{mode}.safetensors"


def quantized_table(checkpoint, mode: str, params: dict, exact: dict | None = None, device="cpu") -> dict:
    """The checkpoint's table with each quantized linear's weight replaced by its stored tensors, computed lazily
    (one linear at a time, when loading reaches it, on `device`). exact: {linear name: thunk of its stored tensors} to
    use as they are (a GGUF's Q4_1 blocks)."""
    table = dict(checkpoint.tensors)
    names = [n.removesuffix(".weight") for n in table
             if n.endswith(".weight") and quantized.BLOCK_LINEAR.fullmatch(n[:-7])]
    modes = {name: mode for name in names}
    head = "gguf" if params.get("head") else quantized.head_mode(mode)  # (gguf: from exact)
    if head:
        modes["lm_head"] = head
    if head and "lm_head.weight" not in table:  # tied: the head gets its own quantized copy of the embedding
        table["lm_head.weight"] = table["embed_tokens.weight"]
    exact = exact or {}

    @functools.lru_cache(maxsize=8)  # a fused layer reads each stored tensor of its parts in turn
    def stored(name: str) -> dict:
        if name in exact:
            return exact[name]()
        result = quantized.LINEARS[modes[name]].stored(table_weights[name]().to(device), **params)
        if "absmax_q" in result:
            result["absmax"] = quantized.double_quant_absmax(*(result.pop(k) for k in quantized.DOUBLE_QUANT))
        return result

    table_weights = {name: table.pop(f"{name}.weight") for name in modes}
    for name, layer_mode in modes.items():
        keys = {"int8": ("weight", "scales"), "llm.int8": ("weight", "scales"), "int4": INT4_KEYS,
                "nf4": ("weight", "absmax"), "gguf": ("blocks0",), "fp8": ("weight", "scales")}[layer_mode]
        for key in keys:
            table[f"{name}.{key}"] = lambda name=name, key=key: stored(name)[key]
    return table


INT4_KEYS = ("qweight", "scales", "mins")  # an int4 linear's stored tensors (its bias stays as it is)


def int4_names(names) -> set[str]:
    """Which of a table's names are an int4 linear's stored tensors (INT4_KEYS beside a qweight)."""
    linears = {n.removesuffix(".qweight") for n in names if n.endswith(".qweight")}
    return {n for n in names if n.rpartition(".")[0] in linears and n.rpartition(".")[2] in INT4_KEYS}


def kernel_layout(stored: dict) -> str | None:
    """kernels.INT4_LAYOUT where the int4 tensors can be saved in it: every linear's rows a multiple of 16, so that a
    fused projection's layout is its parts' stacked (a group of 16 rows never spans two parts)."""
    rows = [t.shape[0] for k, t in stored.items() if k.endswith(".qweight")]
    return kernels.INT4_LAYOUT if rows and all(n % 16 == 0 for n in rows) else None


def write_variant(checkpoint, mode: str, dst: str, params: dict, progress=None, exact: dict | None = None) -> str:
    """model.MODE.safetensors and the config record in dst; side files too when dst is not the source folder."""
    from safetensors.torch import save_file

    double_quant = params.get("double_quant", False)
    os.makedirs(dst, exist_ok=True)
    table = quantized_table(checkpoint, mode, params, exact)
    if double_quant:  # the file keeps the 8-bit block scales: quantize again without expanding them
        for name in [n for n in table if n.endswith(".absmax")]:
            prefix = name.removesuffix(".absmax")
            table.pop(name)
            weights = checkpoint.tensors.get(f"{prefix}.weight") or checkpoint.tensors["embed_tokens.weight"]
            dq = functools.lru_cache(maxsize=1)(lambda w=weights: quantized.nf4_quantize(w(), double_quant=True))
            for key in quantized.DOUBLE_QUANT:
                table[f"{prefix}.{key}"] = lambda dq=dq, key=key: dq()[key]
    stored = {}
    for i, (key, read) in enumerate(table.items()):
        stored[key] = read().contiguous()
        if progress:
            progress(i + 1, len(table))
    layout = kernel_layout(stored) if mode == "int4" and params["group_size"] == 32 else None
    if layout:  # the CPU kernel's layout, which a load then maps and uses as stored (another device undoes it)
        int4 = int4_names(stored)
        stored = {k: kernels.int4_to_kernel(k.rpartition(".")[2], t) if k in int4 else t for k, t in stored.items()}
    target = os.path.join(dst, variant_file(mode))
    atomic_write(target, lambda p: save_file(stored, p, metadata={"format": "pt", "quantization": mode}))
    config_path = os.path.join(dst, "config.json")
    with locked(config_path):  # another process may be recording another variant
        if os.path.isfile(config_path):
            values = read_json(config_path)  # keep the release's own config.json, adding the record
        else:
            declared = checkpoint.dtype
            values = {**dataclasses.asdict(checkpoint.config), **({"torch_dtype": str(declared).removeprefix("torch.")}
                                                         if declared else {})}
        values.setdefault("quantization", {})[mode] = {"file": variant_file(mode), "group_size": params["group_size"]
                                                       if mode == "int4" else None, "double_quant": double_quant,
                                                       **({"fp8_block": params.get("fp8_block", 0)} if mode == "fp8"
                                                          else {}),
                                                       "head": params.get("head") or quantized.head_mode(mode),
                                                       **({"layout": layout} if layout else {})}
        atomic_write(config_path, lambda p: write_text(p, json.dumps(values, indent=2) + "\n"))
    if os.path.abspath(dst) != os.path.abspath(checkpoint.path):  # tokenizer files travel; existing ones stay
        for name, write in side_files(checkpoint.path).items():
            if not os.path.exists(os.path.join(dst, name)):
                atomic_write(os.path.join(dst, name), write)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Convert a checkpoint of any supported family to the native format.")
    parser.add_argument("src", help="checkpoint folder or file (.pt, .gguf, ...)")
    parser.add_argument("dst", help="output folder (config.json + model.safetensors + tokenizer files)")
    parser.add_argument("--force", action="store_true", help="overwrite files that already exist in DST")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="cast the weights")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)

    def work() -> int:
        convert(args.src, args.dst, args.force, torch_dtype(args.dtype))
        print(f"wrote {args.dst}")
        return 0

    return run_program(work, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
