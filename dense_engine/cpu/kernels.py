"""kernels.py: the CPU matmuls of a decode step (kernels.cpp), built once per machine, with PyTorch's kernels as the
fallback.

At M = 1 (one token) a linear layer is a matrix-vector product: every weight byte is read once and used once, so it
runs at the speed the weights stream from memory. PyTorch's CPU kernels reach less than half of that for a few rows
(measured in BENCHMARKS.md), so kernels.cpp has register-tiled kernels for up to 8 rows of x at a time: float32
with FMA (for a prefill, a GEMM that sums each output in the tiles' order); int8 weights with AVX-512 VNNI on
activations written as two int8 digits (16 bits of the row's range); int4 by integer products on x as a 16-bit
integer and a byte a value (a scale per 32: float32's precision), one tile at every number of rows; nf4 by integer
products on x's two digits and its 16 values as 15-bit integers (vpshufb lookups; kernels.h). The result is the
dequantized weights' product to float32's precision, or within 1/32258 of each row of x's largest value (llama.cpp
quantizes activations to 8 bits, which flips answers of the default model: measured). A GGUF file's own blocks
(K-quants, Q8_0, Q4_0/1, Q5_0/1) are multiplied as stored, by integer dot products (VNNI) on x rounded to 8 bits as
llama.cpp rounds it, at every number of rows in one order of sums (kernels.h).

The library is compiled on first use with the system C++ compiler against the installed torch (about 15 s) into
$XDG_CACHE_HOME/dense-engine/kernels/ (or ~/.cache/...), keyed by the source, torch version and CPU, and loaded
into later processes as is: kernels.cpp on a CPU with AVX-512 VNNI (Intel Cascade Lake, Ice Lake and later, AMD Zen 4
and later; AVX512-BF16's conversion where the CPU has it, the same bits by integer steps where not),
kernels_avx2.cpp on one with AVX2 and FMA only (AMD Zen 1-3, Intel's laptops and desktops since
Alder Lake): the same operators in 8-lane registers, int4 and nf4 as kernels.cpp's (the same bits), GGUF prefills by
integer products as kernels.cpp's. Without a compiler, or on an older CPU, everything runs on PyTorch's own kernels
(`DENSE_KERNELS=0` forces that; `DENSE_KERNELS=avx2` takes kernels_avx2.cpp on an AVX-512 CPU too, built without
AVX-512 as such a CPU runs it, `avx2-vnni` with AVX-512 VNNI's 256-bit vpdpbusd standing in for AVX-VNNI's;
`avx512` builds kernels.cpp with Cascade Lake's AVX-512 alone, no BF16, as an AVX-512 CPU without BF16 runs it:
.ci/kernels runs the kernel tests on each build a machine can run). The attention kernel reads runtime/caches.py's
CPU cache (keys in blocks of 16 slots).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from dense_engine.system.errors import first_line
from dense_engine.system.machine import cache_dir, compiler, intact, note, seal, temporary_folder, unwritable_cache

HERE = os.path.dirname(os.path.abspath(__file__))
# kernels.cpp for CPUs with AVX-512 (F, BW, VL, VNNI: Cascade Lake and later; BF16 taken where there, not needed);
# kernels_avx2.cpp, the same operators in 8-lane registers, for those with AVX2 only (AMD Zen 1-3, Intel's laptops
# and desktops since Alder Lake); both include kernels.h
SOURCES = {"kernels.cpp": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
           "kernels_avx2.cpp": {"avx2", "fma", "f16c"}}
# DENSE_KERNELS's builds other than this CPU's own: {value: (source, the compiler's flags past -march=native)}.
# avx2: kernels_avx2.cpp as a CPU without AVX-512 runs it (-mno-avx512f: no EVEX instruction, and so no VNNI unless
# the CPU has AVX-VNNI, which -march=native then enables and the file's int8 products use); avx2-vnni keeps AVX-512
# VNNI's 256-bit vpdpbusd (the same instruction and sums as AVX-VNNI's, EVEX-encoded), so an AVX-512 machine tests
# that path too; avx512: kernels.cpp with Cascade Lake's AVX-512 alone (F, CD, BW, DQ, VL, VNNI: no BF16, none of
# Ice Lake's or Zen 4's additions), as the least AVX-512 CPU it serves builds it (the later -march wins)
FORCED = {"avx2": ("kernels_avx2.cpp", ["-mno-avx512f"]), "avx2-vnni": ("kernels_avx2.cpp", []),
          "avx512": ("kernels.cpp", ["-march=cascadelake"])}
# float32 linears run kernels.cpp at every number of rows: up to 16 (AVX2: 24) the decoding tiles, beyond them a GEMM
# in the tiles' own order of sums (kernels.h's tile_gemm, 0.8-0.9x oneDNN's rate, which it replaced: oneDNN rounds a
# row's sums differently at 17 rows than at 1, so a prompt's logits depended on how it was cut). int8 takes x in two
# int8 digits a row and sums exact integers at every number of rows: the tiles up to 16 rows (AVX2: 12), past them a
# GEMM reaching the same integers (kernels.h's int8_gemm; past 32 a bfloat16 GEMM on the converted weight served
# before).
# nf4 likewise (one design on both ISAs, kernels.h): the tiles up to 16 rows, past them a GEMM in the tiles' order
# (tile_gemm on weights decoded once a call; bfloat16 GEMMs, AVX2 float32, served before). GGUF blocks take x in bytes
# at every number of rows (llama.cpp's Q8_K / Q8_0), the decoding tiles and the prefill's summing in one order
# (kernels.h); int4 runs its one tile at every number of rows: a row's bits whatever the batch.
GEMM_ROWS = 12  # (kernels.h's: where AVX2's GGUF blocks take the prefill's tiles)
_state: dict = {}


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def isa_flags(forced: str | None) -> list[str]:
    """The compiler's instruction-set flags past -march=native for DENSE_KERNELS=forced (FORCED; none for this CPU's
    own build)."""
    return list(FORCED.get(forced or "", ("", []))[1])


def build(source: str, target: str, flags: list[str] = ()) -> None:
    """Compile source into target (written to a temporary file, then renamed, then sealed: concurrent builds are
    safe, and a killed one leaves nothing that looks complete)."""
    import torch.utils.cpp_extension as ext

    include = ext.include_paths()
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".so")
    os.close(fd)
    cmd = [compiler() or "c++", "-O3", "-march=native", *flags, "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *(f"-I{p}" for p in include), source,
           "-o", tmp, f"-L{lib}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode:
            raise RuntimeError((result.stderr.strip().splitlines() or ["compiler failed"])[-1])
        os.replace(tmp, target)
        seal(target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def available() -> bool:
    """Whether the kernels are loaded; builds them the first time on a machine (a notice on stderr), again when the
    built library is damaged or incomplete (checked before it is loaded), in a temporary folder when the cache
    folder cannot be written."""
    if "ok" in _state:
        return _state["ok"]
    _state["ok"] = False
    flags, forced = cpu_flags().split(), os.environ.get("DENSE_KERNELS")
    names = [FORCED[forced][0]] if forced in FORCED else list(SOURCES)  # (avx2: on any CPU with AVX2)
    source = next((name for name in names if SOURCES[name] <= set(flags)), None)
    if forced == "0" or source is None:
        return False
    paths = [os.path.join(HERE, source), os.path.join(HERE, "kernels.h")]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:  # a copy installed without its package data
        note(f"CPU kernels unavailable ({missing[0]} is missing; reinstall the package); using PyTorch's")
        return False
    code = b"".join(pathlib.Path(p).read_bytes() for p in paths)
    extra = isa_flags(forced)
    key = hashlib.sha256(code + torch.__version__.encode() + " ".join(sorted(flags) + extra).encode()).hexdigest()[:16]
    folder = cache_dir() if unwritable_cache() is None else temporary_folder("dense-kernels-")
    target = os.path.join(folder, "kernels", key, "libdense_kernels.so")
    if not intact(target) and compiler() is None:  # nothing built to load (cli/flags.check_environment says so once)
        return False
    try:
        if not intact(target):
            if os.path.exists(target):
                note(f"{target} is damaged or incomplete; building it again")
            note(f"building the CPU kernels ({source}, once per machine, about 15 s)...")
            build(os.path.join(HERE, source), target, extra)
        torch.ops.load_library(target)
        _state["ok"], _state["source"], _state["key"], _state["path"] = True, source, key, target
        _state["build"] = forced if forced in FORCED else "native"
    except Exception as e:  # noqa: BLE001 (a failing compiler, an incompatible torch: PyTorch's kernels serve)
        note(f"CPU kernels unavailable ({first_line(e)}); using PyTorch's")
    return _state["ok"]


def build_key() -> str:
    """The loaded kernels' key (their source, torch's version, the CPU's flags; "" without kernels): what a cache's
    keys and values depend on beside the weights. Another build (AVX2 against AVX-512, an older source) computes
    them in other roundings."""
    return _state.get("key", "") if available() else ""


def build_name() -> str:
    """The loaded build in words ("" without kernels): its source, DENSE_KERNELS's build or the CPU's own (native),
    the flags past -march=native, and whether AVX512-BF16's conversion is in it (.ci/kernels prints it for each run)."""
    if not available():
        return ""
    source, build = _state["source"], _state["build"]
    extra = " ".join(isa_flags(build))
    bf16 = source == "kernels.cpp" and build == "native" and "avx512_bf16" in cpu_flags().split()
    return (f"{source} ({build}{', ' + extra if extra else ''}"
            f"{', with AVX512-BF16' if bf16 else ', without AVX512-BF16' if source == 'kernels.cpp' else ''})")


def library() -> str:
    """The loaded build's shared library ("" without kernels)."""
    return _state.get("path", "") if available() else ""


def avx2_only() -> bool:
    """Whether the kernels are kernels_avx2.cpp's (a CPU without AVX-512, or DENSE_KERNELS=avx2)."""
    return available() and _state.get("source") == "kernels_avx2.cpp"


def huge_pages(tensors: list[torch.Tensor], zeros: bool = False, advise: bool = True) -> list[torch.Tensor]:
    """Copies of CPU tensors in one anonymous mapping advised for transparent huge pages (Linux; elsewhere the
    tensors as they are). A decode step streams every weight once: with 4 KB pages the TLB misses cost about a fifth
    of the memory bandwidth (25 vs 30 GB/s here, measured), and weights read from a memory-mapped file are in 4 KB
    pages of the page cache. zeros=True: the tensors are all zeros (a new cache), so nothing is copied and pages
    are only committed as they are written (advise=False: in 4 KB pages, for a long cache used at its start only).
    Each copy keeps the mapping alive; it is unmapped with the last one."""
    import ctypes
    import mmap

    align, total = 64, 0
    offsets = []
    for t in tensors:
        offsets.append(total)
        total += (t.numel() * t.element_size() + align - 1) // align * align
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = mmap.mmap(-1, total + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        start = (base + (2 << 20) - 1) & ~((2 << 20) - 1)  # 2 MiB aligned
        if advise and libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(total), 14) != 0:  # MADV_HUGEPAGE
            return tensors
    except (OSError, AttributeError, ValueError):
        return tensors
    out = []
    for t, offset in zip(tensors, offsets):
        view = torch.frombuffer(buf, dtype=torch.uint8, count=t.numel() * t.element_size(),
                                offset=start - base + offset).view(t.dtype).view(t.shape)
        out.append(view if zeros else view.copy_(t))
        out[-1].placed = True  # (place_weights leaves it where it is)
    return out


def place_weights(model) -> None:
    """Move a CPU model's large tensors (weights and their kernel layouts) into huge pages (see huge_pages)."""
    if model.device.type != "cpu" or not sys.platform.startswith("linux"):
        return
    chosen = []
    # an embedding's lookup reads a row a token: its table stays where it was loaded, unless the head multiplies it
    head_is_table = getattr(model.config, "tie_word_embeddings", False) and isinstance(model.lm_head, nn.Linear)
    for module in model.modules():
        if module is model.embed_tokens and not head_is_table:
            continue
        # a quantized layer's stored codes stay where they were loaded (a saved variant's: in the file's pages); its
        # kernel reads a layout of its own (or the stored tensors themselves, saved in that layout)
        kernel = {id(t) for name, t in module._buffers.items() if name.startswith("kernel_")}
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if (t is not None and t.device.type == "cpu" and t.numel() * t.element_size() >= 1 << 18
                        and not getattr(t, "placed", False) and (id(t) in kernel or not kernel)):
                    chosen.append((store, name, t))
    unique = {}
    for store, name, t in chosen:
        unique.setdefault(id(t), t)
    placed = dict(zip(unique, huge_pages(list(unique.values()))))
    for store, name, t in chosen:
        new = placed[id(t)]
        store[name] = nn.Parameter(new, requires_grad=False) if isinstance(t, nn.Parameter) else new
    if head_is_table:
        model.lm_head.weight = model.embed_tokens.weight


def register_shapes() -> None:
    """Output shapes for tracing (torch.export and torch.compile run these on fake tensors). Registered before the
    first trace, not at load: registering imports PyTorch's symbolic shapes (0.4-0.5 s), which a start that only
    runs saved steps never needs."""
    if not available() or _state.get("shapes"):
        return
    _state["shapes"] = True

    def out(x, n):
        return x.new_empty(*x.shape[:-1], n)

    torch.library.register_fake("dense_kernels::linear_f32")(lambda x, w: out(x, w.shape[0]))
    torch.library.register_fake("dense_kernels::linear_int8")(lambda x, w, s: out(x, w.shape[0]))
    torch.library.register_fake("dense_kernels::linear_int4")(lambda x, q, d, m: out(x, q.shape[0]))
    torch.library.register_fake("dense_kernels::attention")(lambda q, k, v, pos, start, rows, scale, window, cap,
                                                            k_scale=None, v_scale=None:
                                                             torch.empty_like(q, memory_format=torch.contiguous_format))
    for name in ("dequantize_int4", "dequantize_nf4"):
        torch.library.register_fake(f"dense_kernels::{name}")(lambda q, *_: q.new_empty(
            q.shape[0], q.shape[1] * 2, dtype=torch.bfloat16))
    torch.library.register_fake("dense_kernels::linear_nf4")(lambda x, q, a, c: out(x, q.shape[0]))
    torch.library.register_fake("dense_kernels::linear_gguf")(lambda x, blocks, kind, float_x=False: out(
        x, blocks.shape[0]))
    torch.library.register_fake("dense_kernels::linear_gguf_into")(lambda x, blocks, kind, y, columns: None)
    torch.library.register_fake("dense_kernels::linear_gguf_experts")(lambda x, blocks, kind, ids: out(
        x, blocks.shape[1]))
    torch.library.register_fake("dense_kernels::dequantize_gguf")(lambda blocks, kind, k, bf16: blocks.new_empty(
        blocks.shape[0], k, dtype=torch.bfloat16 if bf16 else torch.float32))


def use_kernel(x: torch.Tensor) -> bool:
    """Whether x goes to a kernel of kernels.cpp: at any number of rows, each kernel choosing its own path for many
    (so a graph whose row count is dynamic, generate.py's prefill step, depends on no number it does not know)."""
    return x.device.type == "cpu" and x.dtype == torch.float32


# ----------------------------------------------------------------------------------------------------------------
# float32


class Linear(nn.Linear):
    """nn.Linear whose float32 CPU calls run kernels.cpp's linear_f32 at every number of rows (quantize.swap_linears
    puts it in): a row's bits whatever the rows beside it, the tiles' order of sums (a prompt's logits whole, in chunks
    or beside another's, bit for bit). With autograd on, F.linear (the op has no backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        y = linear_f32(x, self.weight)
        return y if self.bias is None else y + self.bias


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x w^T by kernels.cpp's float32 tiles where they serve (a row's bits whatever the rows beside it), else
    F.linear: a float Linear's, and a quantized layer's whose shape its kernel does not take (dequantized)."""
    if w.dtype == torch.float32 and use_kernel(x) and w.is_contiguous() and available():
        return torch.ops.dense_kernels.linear_f32(x, w)
    return F.linear(x, w)


# ----------------------------------------------------------------------------------------------------------------
# int8 and int4: pack_* returns the tensors a layer keeps for its CPU kernel (registered as buffers by the layer)


def pack_int8(weight: torch.Tensor, scales: torch.Tensor) -> dict:
    """{} where the layer's own dequantize-and-matmul serves (CUDA: see quantized.Int8Linear.forward)."""
    if weight.device.type != "cpu":
        return {}
    if weight.shape[1] % 64 == 0 and available():  # ours: unsigned bytes (int8 + 128), float32 scales
        return {"kernel_weight": (weight.to(torch.int16) + 128).to(torch.uint8), "kernel_scales": scales.float()}
    if weight.shape[1] % 16:  # (PyTorch's kernel below computes garbage, or crashes, past a multiple of 16 inputs)
        return {}
    # PyTorch's int8 weight-only kernel wants bfloat16 scales, and crashes on weights that are not 64-byte aligned
    # (as memory-mapped safetensors give them); it is fast with bfloat16 activations only
    return {"kernel_weight": weight.clone(), "kernel_scales": scales.to(torch.bfloat16)}


def linear_int8(x: torch.Tensor, packed_weight: torch.Tensor, packed_scales: torch.Tensor) -> torch.Tensor:
    if packed_scales.dtype == torch.float32:  # ours: every number of rows (kernels.h's int8_gemm past a few)
        if use_kernel(x):
            return torch.ops.dense_kernels.linear_int8(x, packed_weight, packed_scales)
        w = (packed_weight.to(torch.int16) - 128).to(torch.float32)  # (x not float32: another dtype's matmul)
        return (F.linear(x.float(), w) * packed_scales).to(x.dtype)
    y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), packed_weight, packed_scales)
    return y.to(x.dtype).reshape(*x.shape[:-1], packed_weight.shape[0])


def pack_int4(pairs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> dict:
    """pairs [N, K / 2] uint8: codes 0..15 two to a byte, the even input in the low nibble (Int4Linear.qweight);
    scales, mins [N, K / group] float16. {} where no kernel serves: dequantize instead."""
    N, K = pairs.shape[0], pairs.shape[1] * 2
    if pairs.device.type == "cuda":  # tinygemm (gpt-fast's int4): its own tiled layout, (q - 8) * scale + zero
        inner = next((t for t in (8, 4, 2) if K % (16 * t) == 0), None)
        if N % 8 or inner is None or group_size not in (32, 64, 128, 256):
            return {}
        try:  # (its pairs have the even input high)
            packed = torch.ops.aten._convert_weight_to_int4pack((pairs >> 4 | pairs << 4).contiguous(), inner)
        except (RuntimeError, NotImplementedError):  # (tinygemm needs an Ampere or later GPU)
            return {}
        return {"kernel_weight": packed, "kernel_scales": int4_scales_and_zeros(scales, mins), "kernel_mins":
                torch.empty(0, device=pairs.device)}
    if group_size == 32 and available():  # ours: groups of 16 rows, lanes over the rows (kernels.h)
        return pack_int4_groups(pairs, scales, mins)
    # PyTorch's int4 CPU kernel computes (q - 8) * scale + zero; fast with bfloat16 activations only
    codes = torch.stack((pairs & 15, pairs >> 4), dim=-1).reshape(N, K)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    return {"kernel_weight": packed, "kernel_scales": int4_scales_and_zeros(scales, mins), "kernel_mins":
            torch.empty(0)}


def pack_int4_groups(pairs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> dict:
    """kernels.h's layout: rows in groups of 16 (the last of N % 16 rows), a group's codes [K / 8][rows][4 bytes] with
    codes 8c + 2p, 8c + 2p + 1 in bits 4p and 16 + 4p of a dword (p = 0..3), its scales and mins [K / 32][rows]. The
    tensors keep their shapes ([N, K / 2], [N, K / 32])."""
    return {f"kernel_{key}": int4_to_kernel(key, t) for key, t in
            (("weight", pairs), ("scales", scales), ("mins", mins))}


INT4_LAYOUT = "groups16"  # pack_int4_groups' layout, as a saved int4 variant's record names it (convert.write_variant)
# A dword of pairs holds codes 0..7 of 8 in nibbles 0..7; the kernel's dword holds 0, 2, 4, 6, 1, 3, 5, 7: two swaps
# of bit fields (nibbles 1 <-> 2 and 5 <-> 6, then bytes 1 <-> 2), undone in the other order
CODE_SWAPS = ((4, 0x00F000F0), (8, 0x0000FF00))


def int4_to_kernel(key: str, t: torch.Tensor) -> torch.Tensor:
    """One of Int4Linear's stored tensors (key "weight" or "qweight": its pairs; "scales", "mins") in
    pack_int4_groups' layout, same shape; scales and mins as float32, which the kernel reads."""
    if key not in ("weight", "qweight"):
        return row_groups(t.float())
    x = t.contiguous()
    x = (x.clone() if x.storage_offset() % 4 else x).view(torch.int32)  # [N, K / 8]
    for shift, mask in CODE_SWAPS:
        swapped = ((x >> shift) ^ x) & mask
        x = x ^ swapped ^ (swapped << shift)
    return row_groups(x).view(torch.uint8).reshape(t.shape)


def int4_from_kernel(key: str, t: torch.Tensor) -> torch.Tensor:
    """int4_to_kernel undone: the stored pairs, or float16 scales and mins (exact: they were float16)."""
    if key not in ("weight", "qweight"):
        return row_groups(t, inverse=True).to(torch.float16)
    x = row_groups(t.contiguous().view(torch.int32), inverse=True)
    for shift, mask in reversed(CODE_SWAPS):
        swapped = ((x >> shift) ^ x) & mask
        x = x ^ swapped ^ (swapped << shift)
    return x.view(torch.uint8).reshape(t.shape)


def row_groups(t: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """[N, C] with its rows in groups of 16 (the last of N % 16 rows), each group stored [C][rows]; inverse: back."""
    N = t.shape[0]
    whole = N // 16 * 16
    parts = []
    for start, rows in ((0, whole), (whole, N - whole)):
        if rows:
            lanes = min(16, rows)
            shape = (rows // lanes, -1, lanes) if inverse else (rows // lanes, lanes, -1)
            parts.append(t[start:start + rows].reshape(shape).transpose(1, 2).reshape(rows, -1))
    return torch.cat(parts)


def int4_scales_and_zeros(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """torch's int4 kernels compute (q - 8) * scale + zero: our min + q * scale with zero = min + 8 * scale,
    [K / group, N, 2] bfloat16 (rounded: bfloat16 keeps 8 bits of float16's 11)."""
    zeros = mins.float() + 8 * scales.float()
    return torch.stack((scales.float().t(), zeros.t()), dim=-1).to(torch.bfloat16).contiguous()


def linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, n: int,
                group_size: int) -> torch.Tensor:
    if mins.numel():
        if use_kernel(x):  # (every number of rows: one tile, one order of sums)
            return torch.ops.dense_kernels.linear_int4(x, packed, scales, mins)
        w = torch.ops.dense_kernels.dequantize_int4(packed, scales, mins)
        return F.linear(x.to(torch.bfloat16), w).to(x.dtype)
    aten = torch.ops.aten
    op = aten._weight_int4pack_mm if packed.device.type == "cuda" else aten._weight_int4pack_mm_for_cpu
    y = op(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), packed, group_size, scales)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


# ----------------------------------------------------------------------------------------------------------------
# nf4: files keep bitsandbytes' layout; for our kernel each row's blocks of 64 are repacked (code j in the low nibble
# of byte j, code j + 32 in its high nibble). bitsandbytes' own fused CPU kernel (AVX512-BF16, its packed layout)
# measured slower: BENCHMARKS.md.


def pack_nf4(weight: torch.Tensor, absmax: torch.Tensor, n: int, k: int) -> dict | None:
    """None where our kernel cannot serve (no kernels, or K % 64: blocks would straddle rows): dequantize instead."""
    if weight.device.type != "cpu" or k % 64 or not available():
        return None
    packed = weight.reshape(-1)
    codes = torch.stack((packed >> 4, packed & 15), dim=-1).reshape(n, k // 64, 64)  # bitsandbytes: first code high
    return {"kernel_weight": (codes[..., :32] | (codes[..., 32:] << 4)).reshape(n, k // 2).contiguous(),
            "kernel_absmax": absmax.float().reshape(n, k // 64).contiguous()}


def linear_nf4(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    if use_kernel(x):  # (every number of rows: past a few a GEMM in the tiles' order)
        return torch.ops.dense_kernels.linear_nf4(x, packed, absmax, code)
    w = torch.ops.dense_kernels.dequantize_nf4(packed, absmax, code)
    return F.linear(x.to(torch.bfloat16), w).to(x.dtype)

