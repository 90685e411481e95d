"""load.py: a checkpoint path -> a model ready to run, in one downward pass.

    from dense_engine.formats import load
    model = load.from_pretrained("path/to/ckpt", device="cpu", dtype=torch.float32, quant="auto")

plan a load (one LoadRecord: the checkpoint read once (convert.py: the native format and every foreign layout),
the quantization resolved with its reason, dtype, device, the cache's kind and length, compile) -> choose what to
load (a saved quantized variant, quantizing tensor by tensor as they load, or the full-precision weights) -> build
the model on the meta device -> swap in quantized linears (quantized.py) -> read each tensor (memory-mapped), check
it, cast it and move it to `device`, one at a time (load_tensors) -> place the weights for the CPU kernels. Also
here: the memory check before anything is allocated (check_fits), and the way back from a model to checkpoint
tensors (checkpoint_tensors). Stands on dense.py, kernels.py, quantized.py and convert.py; tp.py loads shards
through its `shard` hook.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import dense
import layer_kinds
from dense_engine.cpu import kernels, quantized
from dense_engine.formats import convert, gguf_import, prequantized, preread
from dense_engine.formats import lora as adapters
from dense_engine.formats.checkpoint import Checkpoint, current_names
from dense_engine.system import machine
from dense_engine.system.errors import CheckpointError, UsageError

KV_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")  # what a load may ask of its KV cache (caches.cache_for)


@dataclass(frozen=True)
class LoadRecord:
    """One load, decided once (from chat.py's and serve.py's flags, or dense_engine.load's keywords) and carried
    whole: to the loader, to the Session or server that sets up its cache and steps, and to the background compiler,
    which loads the same model again in another process. path None: a model made in memory (nothing to load again)."""
    path: str | None = None
    quant: str | None = None  # as resolved: None (full precision), "int8", "int4", "nf4", "llm.int8", "fp8" or "gguf"
    reason: str = "as stored"  # why that quantization: auto_mode's words, or the flag's
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    kv_dtype: str = "auto"  # the cache's numbers: one of KV_DTYPES
    max_seq_len: int | None = None  # the cache's length; None: the model's context, or what fits (fitting_cache)
    compile: bool = True  # compiled steps, saved for later processes
    lora: tuple[tuple[str, float, str], ...] = ()  # LoRA adapters (folder or file, scale, name): merged into
    #   full-precision weights, beside quantized ones; a named one beside any, on for the rows that pick it (lora.py)

    @property
    def weights(self) -> str:
        """What was loaded and why, as the programs' first line says it."""
        every = [e for e in self.lora if not e[2]]
        named = [e[2] for e in self.lora if e[2]]
        adapters = "" if not every else \
            f", {len(every)} LoRA adapter{'s' if len(every) > 1 else ''} {'beside' if self.quant else 'merged'}"
        adapters += f", LoRA adapters by name: {', '.join(named)}" if named else ""
        return f"{self.quant or 'full precision'} ({self.reason}){adapters}"


def default_dtype(device, declared: torch.dtype | None = None) -> torch.dtype:
    """The compute dtype when none is asked for, decided here only: bfloat16 on a GPU (its tensor cores' type); on
    the CPU `declared` (the checkpoint's torch_dtype: from_pretrained's default, as transformers loads it) or float32
    (the CPU kernels' type: what plan() gives the programs and dense_engine.load)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else declared or torch.float32


def plan(path: str, quant: str = "auto", device=None, dtype: torch.dtype | None = None, kv_dtype: str = "auto",
         max_seq_len: int | None = None, compile: bool = True, lora: tuple = ()) -> tuple[LoadRecord, Checkpoint]:
    """The record of a load and the checkpoint it reads (read once, here; from_pretrained takes it): "auto" resolved
    to what auto_mode picks, with its reason; device default cuda when there is one, else cpu; dtype default_dtype's.
    lora: adapters as lora.entry takes them ((folder or file, scale[, name])): merged, or beside quantized weights;
    a named one beside any weights (lora.py)."""
    if kv_dtype not in KV_DTYPES:
        raise UsageError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    lora = tuple(adapters.entry(a) for a in lora)
    checkpoint = read_with_adapters(path, lora)
    device = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if quant == "auto":
        mode, reason = auto_mode(checkpoint, device)
    else:
        mode, reason = (None if quant == "none" else quant), f"--quant {quant}"
        if mode is not None and checkpoint.scheme is not None:  # (a folder that came quantized: as stored, or not)
            reason += prequantized.requantizing(checkpoint.tensors, checkpoint.scheme, mode)
    if lora:  # (an adapter beside the weights: the family must keep the weight as it is)
        adapters.check_unmerged(checkpoint.tensors, checkpoint.adapters, mode)
    record = LoadRecord(checkpoint.path, mode, reason, dtype or default_dtype(device), device, kv_dtype, max_seq_len,
                        compile, lora)
    return record, checkpoint


def read_with_adapters(path, lora: tuple) -> Checkpoint:
    """The checkpoint at path with the LoRA adapters `lora` names (lora.entry's) on its weights."""
    def read(adapter: str, scale: float, name: str):  # (a llama.cpp adapter file, or a PEFT folder)
        got = gguf_import.read_lora(adapter, scale) if adapter.endswith(".gguf") and os.path.isfile(adapter) else \
            adapters.read_adapter(adapter, scale)
        return dataclasses.replace(got, name=name)
    # (a named adapter is read at scale 1: its scale is the rows' to set, the flag's by default: lora.switch)
    return convert.read_checkpoint(path, tuple(read(p, 1.0 if n else s, n) for p, s, n in map(adapters.entry, lora)))


def from_pretrained(path, device="cpu", dtype: torch.dtype | None = None, quant: str | None = None,
                    shard: Callable | None = None, lora: tuple = ()) -> dense.DenseDecoder:
    """A checkpoint folder or file (or the Checkpoint plan() read) as a DenseDecoder. dtype=None: default_dtype's
    (the checkpoint's declared dtype on the CPU).
    quant=None loads what is stored (the full-precision weights, or the only quantized variant of a folder that has no
    other); "int8" | "int4" | "nf4" | "llm.int8" | "fp8" loads that variant (saved by quantize.py, else quantized tensor
    by tensor as it loads); "auto" picks what auto_mode says; "none" forces full precision. shard: tensor parallel's
    hook (tp.py), (checkpoint, tensors, mode) -> one rank's config and tensor slices. lora: (adapter folder or file,
    scale[, name]), merged into full-precision weights, beside quantized ones, a named one beside any (lora.py)."""
    checkpoint = path if isinstance(path, Checkpoint) else read_with_adapters(path, lora)
    device = torch.device(device)
    dtype = dtype or default_dtype(device, checkpoint.dtype)
    mode, params, tensors = select(checkpoint, quant, device=device)
    served = tuple(a.name for a in checkpoint.adapters if a.name)
    if shard is not None and checkpoint.adapters and (mode is not None or served):
        raise UsageError("--lora beside the weights (quantized ones, or an adapter by name) is not split across "
                         "ranks yet (full-precision weights take an unnamed adapter merged: --quant none)")
    config = checkpoint.config
    if shard is not None and mode == "gguf":  # tensor parallel cuts float or int8/int4 weights, not GGUF blocks
        mode, tensors = None, checkpoint.tensors
    if shard is not None and params.pop("layout", None):  # tensor parallel cuts the pairs' rows and columns
        tensors = pairs_layout(tensors)
    if shard is not None:
        config, tensors = shard(checkpoint, tensors, mode)
    check_fits(config, dtype, torch.device(device), checkpoint.path, quantized.BYTES_PER_WEIGHT.get(mode),
               held=preread.held(checkpoint.path) if torch.device(device).type == "cpu" else 0)
    with torch.device("meta"), no_init():
        model = layer_kinds.Decoder(config)
    if mode == "gguf":
        tensors = load_blocks(model, checkpoint, tensors, device, dtype)
    quantized.swap_linears(model, None if mode == "gguf" else mode, params)  # the rest: quantized, or kernels.Linear
    load_tensors(model, tensors, device, dtype, source=checkpoint.path)
    if checkpoint.adapters and (mode is not None or served):  # beside the weights, unmerged (lora.py)
        adapters.attach(model, checkpoint.tensors, quantized.fused_parts, served, merged=mode is None)
    kernels.place_weights(model)  # huge pages for the weights a decode step streams (CPU)
    return model


def saved_variants(path) -> set[str]:
    """The quantized variants a checkpoint has saved beside its weights (quantize.py's, a conversion's exact int4)."""
    checkpoint = path if isinstance(path, Checkpoint) else convert.read_checkpoint(path)
    saved = checkpoint.record.get("quantization", {})
    return {mode for mode in saved if os.path.isfile(os.path.join(checkpoint.path, convert.variant_file(mode)))}


def pairs_layout(tensors: dict) -> dict:
    """A table of an int4 variant saved in the kernel's layout, each int4 linear's tensors read back as pairs."""
    int4 = convert.int4_names(tensors)

    def pairs(name, read):
        return lambda: kernels.int4_from_kernel(name.rpartition(".")[2], read())
    return {n: pairs(n, read) if n in int4 else read for n, read in tensors.items()}


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


def auto_mode(checkpoint, device="cpu") -> tuple[str | None, str]:
    """What `--quant auto` loads, and why: int4-g32 for weights that came from a GGUF's Q4_0/Q4_1 blocks (int4
    holds them exactly, and int4 is the fastest kernel: ours on CPU, tinygemm on CUDA, whose bfloat16 scales round
    the blocks' float16 ones); a GGUF file's other block types as the file stores them ("gguf": K-quants, Q8_0, ...;
    a mixture's experts in any block type); everything else as stored."""
    types = checkpoint.record.get("source_tensor_types", {}).get("blocks") or {}
    if checkpoint.source_types:  # a .gguf file itself
        types = {kind for name, kind in checkpoint.source_types.items() if quantized.BLOCK_LINEAR.fullmatch(name[:-7])}
    saved = checkpoint.record.get("quantization", {})
    if checkpoint.scheme is not None and checkpoint.scheme.mode == "fp8" and torch.device(device).type == "cpu":
        return None, (f"the folder's {checkpoint.scheme.method} float8 weights, dequantized to float (no float8 kernel "
                      "on the CPU; --quant fp8 holds them as stored, at a quarter of the memory)")
    if checkpoint.scheme is not None and checkpoint.scheme.mode:
        return checkpoint.scheme.mode, checkpoint.scheme.reason()
    exact = "int4" in saved or bool(checkpoint.exact)
    experts = any(n.endswith(".mlp.experts_down") for n in checkpoint.blocks)  # (a mixture's experts in blocks: as
    if types and set(types) <= set(quantized.EXACT_INT4_TYPES) and exact and not experts:  # stored, not in float)
        held = "exactly" if torch.device(device).type != "cuda" else "(on CUDA with bfloat16 scales)"
        return "int4", f"the weights are {'/'.join(sorted(types))} blocks from a GGUF, which int4-g32 holds {held}"
    if experts or any(quantized.BLOCK_LINEAR.fullmatch(n[:-7]) for n in checkpoint.blocks):
        kinds = sorted({checkpoint.blocks[n].kind for n in checkpoint.blocks})
        rest = sorted(set(types) - set(quantized.GGUF_TYPES))  # (Q3_K, IQ4_XS, ...: dequantized, float32)
        return "gguf", f"the file's {'/'.join(kinds)} blocks as stored" + (f"; {'/'.join(rest)} as float32" if rest
                                                                           else "")
    if not checkpoint.tensors and len(saved) == 1:
        return next(iter(saved)), "the only variant stored"
    what = f"{'/'.join(sorted(types))} weights from a GGUF" if types else "full-precision weights"
    return None, f"{what}: loaded as stored (--quant int4 for the fastest CPU decode)"


def select(checkpoint, quant: str | None, notice=machine.note, device="cpu") -> tuple[str | None, dict, dict]:
    """(mode, layer params, {checkpoint name: thunk}) for from_pretrained: the saved variant of `quant` when there is
    one, else the full-precision tensors quantized one by one as they load, on `device` (a GPU's minutes are a CPU's
    seconds). quant=None loads what is stored. A folder that came quantized, in its own mode (auto's pick, quant=None's,
    or asked), loads as stored: the linears it stores quantized in the mode, every other tensor (the head, a linear it
    left unquantized) float as it holds it (params "stored": the quantized linears, quantized.layer_modes)."""
    saved = checkpoint.record.get("quantization", {})
    if quant == "auto":
        quant = auto_mode(checkpoint, device)[0] or "none"
    if quant is None and checkpoint.scheme is not None and checkpoint.scheme.mode:  # (a folder that came quantized)
        quant = checkpoint.scheme.mode
    if quant is None:
        quant = next(iter(saved)) if not checkpoint.tensors and len(saved) == 1 else "none"
    if quant == "none":
        if not checkpoint.tensors:
            raise CheckpointError(f"{checkpoint.path}: holds only quantized variants ({', '.join(saved)}), no "
                                  "full-precision weights")
        return None, {}, checkpoint.tensors
    if checkpoint.adapters:  # the weights quantized as stored; their adapters stay apart (lora.attach)
        adapters.check_unmerged(checkpoint.tensors, checkpoint.adapters, quant)
        checkpoint = dataclasses.replace(checkpoint, tensors=adapters.unmerged(checkpoint.tensors))
    if quant == "gguf":
        if not checkpoint.blocks:
            raise CheckpointError(f"--quant gguf: {checkpoint.path} is not a GGUF file with quantized blocks "
                                  f"({', '.join(quantized.GGUF_TYPES)})")
        return "gguf", {}, checkpoint.tensors
    quantized.check_mode(quant)
    record = saved.get(quant, {})
    params = {"group_size": record.get("group_size") or 32}
    if record.get("head") in quantized.GGUF_TYPES:  # the head in its GGUF's own blocks (convert.exact_variant)
        params["head"] = record["head"]
    if record.get("fp8_block"):  # fp8 scales per row and this many inputs
        params["fp8_block"] = record["fp8_block"]
    if record.get("layout"):  # int4 saved in the CPU kernel's layout (Int4Linear reads it)
        params["layout"] = record["layout"]
    file = os.path.join(checkpoint.path, convert.variant_file(quant))
    if record and os.path.isfile(file):
        return quant, params, expand_double_quant(current_names(convert.open_safetensors(file)))
    if not checkpoint.tensors:
        raise CheckpointError(f"{checkpoint.path}: no saved {quant} variant and no full-precision weights to make one")
    exact, params = convert.exact_variant(checkpoint, quant, params["group_size"], device)
    if not exact:
        notice(f"{checkpoint.path}: no saved {quant} variant; quantizing at load time (python quantize.py --ckpt "
               f"{checkpoint.path} --mode {quant} saves one)")
    table = convert.quantized_table(checkpoint, quant, params, exact, device)
    if checkpoint.scheme is not None and quant == checkpoint.scheme.mode:  # a folder that came quantized, as stored
        params["stored"] = prequantized.stored_linears(checkpoint.tensors)
        table = prequantized.as_stored(table, checkpoint.tensors, params["stored"])
    return quant, params, table


def load_blocks(model: dense.DenseDecoder, checkpoint, tensors: dict, device, dtype) -> dict:
    """Put GGUF block layers (quantized.GGUFLinear, GGUFEmbedding) in a meta-device model where the file's tensors
    are blocks with a kernel (the tables too: the token table and Gemma 4's per-layer one, rows dequantized as they are
    looked up); returns the tensors still to load. The blocks are the file's bytes as they are stored
    (nothing converted): views of the memory-mapped file, or, for a run that decodes long on the CPU, of one mapping
    of huge pages they were read into (read_runs). Parts of a fused projection that lie one after another in the file,
    of one type, are one buffer, and a tensor two parts share (qwen35's per-head query and gate rows) is read once;
    rows in another order than the model's (llama's permuted q/k) stay as stored and the layer puts its outputs in
    order. A tied head multiplies the embedding's own blocks. A mixture's experts in blocks (all three of a layer's
    stacked tensors) make its layer a quantized.GGUFExperts, each tensor's blocks viewed as [E, rows, row bytes]."""
    blocks = checkpoint.blocks
    experts = {}  # module -> {"gate" | "up" | "down": its experts' Blocks}
    for name, module in list(model.named_modules()):
        parts = {p: blocks.get(f"{name}.experts_{p}") for p in ("gate", "up", "down")}
        if type(module) is layer_kinds.Experts and all(parts.values()):
            experts[name] = parts
            parent, _, attr = name.rpartition(".")
            with torch.device("meta"):  # (its router and shared expert: filled below and by load_tensors)
                new = quantized.GGUFExperts(model.config, int(name.split(".")[1]),
                                            {p: b.kind for p, b in parts.items()})
            setattr(model.get_submodule(parent), attr, new)
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    tables = ["embed_tokens"] + (["embed_per_layer"] if hasattr(model, "embed_per_layer") else [])  # (rows looked up)
    sources = {name: [f"{name}.weight"] for name in tables}  # module -> the checkpoint weights it is stacked from
    for name in linears:
        parts = [f"{prefix}.weight" for prefix in quantized.fused_parts(model, name)]
        sources[name] = ["embed_tokens.weight"] if name == "lm_head" and "lm_head.weight" not in tensors else parts
    sources = {m: parts for m, parts in sources.items() if all(p in blocks for p in parts)}
    stored = {}  # module -> the tensors its parts are rows of, each once (qwen35's q and gate: one tensor), in order
    for module_name, parts in list(sources.items()):
        stored[module_name] = list({(blocks[p].path, blocks[p].offset): blocks[p] for p in parts}.values())
        if sum(b.rows for b in stored[module_name]) != sum(blocks[p].native_rows for p in parts):
            del sources[module_name], stored[module_name]  # (its parts are not its tensors' rows: the float path)
    runs = {}  # module -> [(first tensor, rows)]: tensors adjacent in the file and of one type, one buffer
    for module_name, tensors_read in stored.items():
        runs[module_name] = []
        for b in tensors_read:
            last = runs[module_name][-1] if runs[module_name] else None
            if last and last[0].kind == b.kind and last[0].offset + last[1] * b.row_bytes == b.offset:
                runs[module_name][-1] = (last[0], last[1] + b.rows)
            else:
                runs[module_name].append((b, b.rows))
    runs.update({(name, p): [(b, b.rows)] for name, parts in experts.items() for p, b in parts.items()})
    unique = list({(first.path, first.offset): (first, rows) for module_runs in runs.values()
                   for first, rows in module_runs}.values())
    buffers = read_runs(unique, device)
    for name, parts in experts.items():
        module = model.get_submodule(name)
        for p, b in parts.items():
            view = buffers[b.path, b.offset].view(module.spec.count, -1, b.row_bytes)  # [E, rows, row bytes]
            view.placed = True
            setattr(module, f"{p}_blocks", view)
    for module_name, parts in sources.items():
        views = [(first.kind, buffers[first.path, first.offset]) for first, _ in runs[module_name]]
        parent, _, attr = module_name.rpartition(".")
        old = model.get_submodule(module_name)
        if module_name in tables:
            new = quantized.GGUFEmbedding(old.num_embeddings, old.embedding_dim, views[0][0], views[0][1], dtype)
        else:
            new = quantized.GGUFLinear(old.in_features, old.out_features, old.bias is not None, parts=views,
                                       order=stored_order([blocks[p] for p in parts], stored[module_name]))
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    read = {p for parts in sources.values() for p in parts}
    read |= {f"{name}.experts_{p}" for name in experts for p in ("gate_up", "down")}
    return {name: thunk for name, thunk in tensors.items() if name not in read}


def stored_order(parts: list, tensors: list) -> torch.Tensor | None:
    """Output j of a layer made of `parts` (gguf_import.Blocks) is output order[j] of its `tensors`' stored rows, one
    after another (each part's own order: llama's permuted q/k rows, a fused tensor's share); None: as stored."""
    first, starts = 0, {}
    for b in tensors:
        starts[b.path, b.offset] = first
        first += b.rows
    order = torch.cat([starts[b.path, b.offset] + (torch.arange(b.rows) if b.order is None else b.order)
                       for b in parts])
    return None if torch.equal(order, torch.arange(len(order))) else order


def read_runs(runs: list, device) -> dict:
    """{(path, offset): uint8 [rows, row_bytes]} for runs of rows of a GGUF file: on CPU views of the file read into
    huge pages (preread: a run that decodes long asked for it), else views of the file's own pages (a copy-on-write
    map: writable for torch, never written; nothing copied, so a one-shot's first token comes sooner), moved to
    `device`."""
    early = {}
    if torch.device(device).type == "cpu":  # (another device: an early read is dropped unread)
        early = {path: preread.taken(path) for path in {first.path for first, _ in runs}}
    out, mapped = {}, {}
    for first, rows in runs:
        if early.get(first.path) is not None:
            read = early[first.path]
            buffer = torch.frombuffer(read.mapping, dtype=torch.uint8, count=rows * first.row_bytes,
                                      offset=read.start + first.offset)
        else:
            if first.path not in mapped:
                mapped[first.path] = torch.from_numpy(np.memmap(first.path, dtype=np.uint8, mode="c"))
            buffer = mapped[first.path][first.offset:first.offset + rows * first.row_bytes].to(device)
        buffer = buffer.view(rows, first.row_bytes)
        buffer.placed = True  # (kernels.place_weights leaves it where it is)
        out[first.path, first.offset] = buffer
    return out


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


# ----------------------------------------------------------------------------------------------------------------
# Filling a model from checkpoint tensors, and back


def checkpoint_tensors(model: dense.DenseDecoder) -> dict[str, torch.Tensor]:
    """The model's tensors under checkpoint names (fused projections split back into their parts; a tied head left
    out): what convert.write_native saves and load_tensors reads."""
    tensors = {}
    for name, t in model.state_dict().items():
        module_name, _, attr = name.rpartition(".")
        parts = quantized.fused_parts(model, module_name)
        if name == "lm_head.weight" and model.config.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):
            continue
        rows = list(parts.values())
        pieces = t.split([t.shape[0] * r // sum(rows) for r in rows]) if len(parts) > 1 else [t]
        tensors.update({f"{prefix}.{attr}": piece for prefix, piece in zip(parts, pieces)})
    return tensors


# Tables only looked up (a row a token, never multiplied whole): kept as stored when narrower than the model's dtype,
# the rows widened as they are read. Gemma 4's per-layer table: 9.4 GB in float32 at E2B's shape, 4.7 in its bfloat16.
ROWS_ONLY = {"embed_per_layer.weight"}


def load_tensors(model: dense.DenseDecoder, tensors: dict[str, Callable[[], torch.Tensor]], device, dtype,
                 source: str) -> dense.DenseDecoder:
    """Fill a meta-device model from {checkpoint name: thunk returning the tensor}, one tensor at a time. A fused
    projection's tensor is its parts' tensors stacked by rows (for quantized layers too: every stored layout is
    row-major per output row)."""
    tied = model.config.tie_word_embeddings and isinstance(model.lm_head, nn.Linear)  # a quantized head has its own
    expected = dict(model.state_dict(keep_vars=True))
    if tied:
        expected.pop("lm_head.weight")
    sources = {}  # model tensor name -> {checkpoint name: expected shape}
    for name, param in expected.items():
        module_name, _, attr = name.rpartition(".")
        parts = quantized.fused_parts(model, module_name)
        total = sum(parts.values())
        sources[name] = {f"{prefix}.{attr}": (param.shape[0] * rows // total, *param.shape[1:]) if total else
                         tuple(param.shape) for prefix, rows in parts.items()}
    wanted = [n for s in sources.values() for n in s]
    missing = [n for n in wanted if n not in tensors]
    unexpected = [n for n in tensors if n not in set(wanted)]
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}" + more(missing))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r}" + more(unexpected))
    for name, parts in sources.items():
        pieces = []
        for part, shape in parts.items():
            t = tensors[part]()
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{source}: tensor {part!r} has shape {list(t.shape)}, expected {list(shape)}")
            pieces.append(t)
        t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        keep = attr in getattr(module, "keep_dtype", ())  # quantization scales load as stored
        keep |= name in ROWS_ONLY and t.is_floating_point() and t.dtype.itemsize < dtype.itemsize
        t = t.to(device=device, dtype=dtype if t.is_floating_point() and not keep else t.dtype)
        if attr in module._buffers:
            module._buffers[attr] = t
        else:
            setattr(module, attr, nn.Parameter(t, requires_grad=False))
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    for module in model.modules():  # quantized linears repack for this device's kernels
        if hasattr(module, "finish_loading"):
            module.finish_loading()
    return model.eval()


def more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def check_fits(config: dense.DenseConfig, dtype: torch.dtype, device: torch.device, source: str,
               bytes_per_weight: float | None = None, held: int = 0) -> None:
    """Refuse, before allocating anything, a config whose weights would not fit the device's available memory,
    naming its largest term (a config from the internet must not make us allocate hundreds of GB).
    bytes_per_weight: of the quantized layers (all but the embedding), when they are quantized. held: bytes of the
    weights already in memory (a GGUF file read while torch was imported: preread), available to them."""
    elem = torch.empty((), dtype=dtype).element_size()
    embedding = config.vocab_size * config.hidden_size
    need = embedding * elem + (num_parameters(config) - embedding) * (bytes_per_weight or elem)
    have = machine.available_memory(device) + held
    if need <= have:
        return
    C, L = config.hidden_size, config.num_hidden_layers
    terms = {f"vocab_size {config.vocab_size} x hidden_size {C}": config.vocab_size * C,
             f"num_hidden_layers {L} x (intermediate_size {config.ffn_width(0)} x hidden_size {C})":
                 L * config.ffn_width(0) * C,
             f"num_hidden_layers {L} x (attention heads {config.heads(0)} x head_dim {config.head_dim} x hidden_size "
             f"{C})": L * config.heads(0) * config.head_dim * C}
    raise CheckpointError(f"{source}: the config describes {num_parameters(config) / 1e9:.1f}B parameters, "
                          f"{need / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}, mostly "
                          f"{max(terms, key=terms.get)}; {device.type} has {have / 2**30:.1f} GiB available")


def num_parameters(config: dense.DenseConfig) -> int:
    """Parameters a config describes (norm gains and biases included), without building the model."""
    C, total = config.hidden_size, config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    experts = config.extras.get("experts")
    mixed = [i for i in range(config.num_hidden_layers) if experts and i not in experts.dense_layers]
    for layer in range(config.num_hidden_layers):
        q, kv = config.heads(layer) * config.head_dim, config.kv_heads(layer) * config.head_dim
        w = config.ffn_width(layer) if layer not in mixed or experts.beside_mlp else 0
        total += C * (q + 2 * kv) + q * C + (C * q if config.attn_output_gate else 0)  # (LFM3's head gate: small)
        total += C * w * (2 if config.mlp == "gelu" else 3) + 4 * C
    if mixed:  # every expert of every mixture layer (held, though a token reads only its chosen few), its router
        matrices = 2 if experts.activation == "relu2" else 3
        total += len(mixed) * C * ((experts.count * experts.width + experts.shared_width) * matrices + experts.count)
    return total + 2 * C
