"""This engine against llama.cpp on the CPU, side by side: the same GGUF weights in every row, the same prompt ids,
greedy decoding, batch 1, each engine in its own process (llama.cpp through llama-cpp-python, never a dependency).

    python bench/llamacpp.py --llama-python /path/to/venv/bin/python [--model smollm2|tinyllama|both] [--rounds 3]
    python bench/llamacpp.py --llama-python ... --prefill 128,512      # prompt processing instead of decoding

The machine's speed drifts between minutes, so each row runs the two engines in alternation, --rounds times (each
time a new process per engine, which runs first alternating too): an engine's figure is the median over its
processes, the ratio the median of the rounds' ratios.

llama-cpp-python is built from source in a side virtualenv, for this machine's instruction set:

    python3 -m venv ~/llamavenv
    ~/llamavenv/bin/pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/sdist
    CMAKE_ARGS="-DGGML_NATIVE=ON" ~/llamavenv/bin/pip install /tmp/sdist/llama_cpp_python-*.tar.gz numpy

An AVX2 machine's rows on an AVX-512 one: llama.cpp in a second venv built with CMAKE_ARGS="-DGGML_NATIVE=OFF
-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF", and
this engine run as `DENSE_KERNELS=avx2 python bench/llamacpp.py --llama-python AVX2VENV/bin/python ...`.

Models: "smollm2" is the default model's own Q4_1 GGUF (SmolLM2-135M-Instruct); "tinyllama" is a 1.1B Llama of
TinyLlama's shape (22 layers, 2048 wide, GQA 32/4, FFN 5632; SmolLM2's vocabulary), "llama-3.2-1b" one of Llama 3.2
1B's (16 layers, 2048 wide, GQA 32/8, FFN 8192, its 128256-token vocabulary, tied head, Llama 3's rope_freqs), and
"qwen2.5-0.5b" a qwen2 architecture of Qwen2.5-0.5B's shape (24 layers, 896 wide, GQA 14/2, FFN 4864, q/k/v biases,
151936-token vocabulary, tied head), each with random weights, written here with gguf's writer. Precisions, each from
the same weights: F32 and F16 (the source dequantized with the `gguf` package), Q8_0 (llama.cpp's own quantizer), Q4_1
(the SmolLM2 original; for tinyllama, llama.cpp's quantizer). This engine reads the F32 file for float32, the Q8_0 file
for int8 (requantized per channel), and the Q4_1 file for int4-g32 and nf4 (`--quant auto` loads Q4_1 as int4-g32 bit
for bit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dense-engine", "bench")
# Random-weight models of published shapes (SmolLM2's vocabulary, padded with reserved tokens to the shape's size)
SHAPES = {
    "tinyllama": {"arch": "llama", "layers": 22, "hidden": 2048, "heads": 32, "kv_heads": 4, "ffn": 5632,
                  "context": 2048, "vocab": None, "theta": 10000.0, "eps": 1e-5, "tied": False},
    "llama-3.2-1b": {"arch": "llama", "layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192,
                     "context": 131072, "vocab": 128256, "theta": 500000.0, "eps": 1e-5, "tied": True,
                     "llama3": {"factor": 32.0, "low": 1.0, "high": 4.0, "original": 8192}},
    "llama-3.1-8b": {"arch": "llama", "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336,
                     "context": 131072, "vocab": 128256, "theta": 500000.0, "eps": 1e-5, "tied": False, "half": True,
                     "llama3": {"factor": 8.0, "low": 1.0, "high": 4.0, "original": 8192}},
    "qwen2.5-0.5b": {"arch": "qwen2", "layers": 24, "hidden": 896, "heads": 14, "kv_heads": 2, "ffn": 4864,
                     "context": 32768, "vocab": 151936, "theta": 1e6, "eps": 1e-6, "tied": True, "bias": True},
    # Qwen3.5: three Gated DeltaNet layers (linear: key heads, value heads, head size) and one gated attention layer
    # (head size 256, a quarter rotary) in every four. 0.8B: its config.json; 2B: 2048 wide, the rest assumed alike
    "qwen3.5-0.8b": {"arch": "qwen35", "layers": 24, "hidden": 1024, "heads": 8, "kv_heads": 2, "head_dim": 256,
                     "ffn": 3584, "context": 262144, "vocab": 248320, "theta": 1e7, "eps": 1e-6, "tied": True,
                     "linear": (16, 16, 128), "conv": 4},
    "qwen3.5-2b": {"arch": "qwen35", "layers": 24, "hidden": 2048, "heads": 8, "kv_heads": 2, "head_dim": 256,
                   "ffn": 6144, "context": 262144, "vocab": 248320, "theta": 1e7, "eps": 1e-6, "tied": True,
                   "linear": (16, 16, 128), "conv": 4},
    # Granite 4.0 H: Mamba2 layers (mamba: heads, channels per head, groups, state size) with an attention layer
    # without rope as every tenth; a 1B-class shape, assumed (its config.json was not at hand): 1536 wide, 40 layers
    "granite-4.0-h-1b": {"arch": "granitehybrid", "layers": 40, "hidden": 1536, "heads": 12, "kv_heads": 4, "ffn": 4096,
                         "context": 131072, "vocab": 100352, "theta": 1e4, "eps": 1e-5, "tied": True,
                         "mamba": (48, 64, 1, 128), "conv": 4},
    # EXAONE 4.0 1.2B, assumed (its config.json was not at hand): OLMo 2's norms (after each branch only) with q/k
    # norms shared by the heads, every layer full attention with rope (the 32B alone slides)
    "exaone-4.0-1.2b": {"arch": "exaone4", "layers": 30, "hidden": 2048, "heads": 32, "kv_heads": 8, "ffn": 4096,
                        "context": 65536, "vocab": 102400, "theta": 1e6, "eps": 1e-5, "tied": True, "post_norms": True,
                        "qk_norm": True},
    # Gemma 4's small models, assumed (their config.json was not at hand): sliding layers (head size 256, a window of
    # 512) with a full layer every `full` (head size 512, a quarter of it rotated: proportional rope), per-layer
    # embeddings of 256 a layer (the table: vocab x layers x 256), the last kv_shared layers reading earlier layers'
    # keys and values with MLPs twice as wide; a tied head, a final soft-cap of 30
    "gemma-4-e2b": {"arch": "gemma4", "layers": 35, "hidden": 1536, "heads": 8, "kv_heads": 1, "head_dim": 256,
                    "global_head_dim": 512, "ffn": 6144, "context": 131072, "vocab": 262144, "theta": 1e6,
                    "theta_swa": 1e4, "eps": 1e-6, "tied": True, "per_layer": 256, "kv_shared": 20, "window": 512,
                    "full": 5, "half": True},
    "gemma-4-e4b": {"arch": "gemma4", "layers": 42, "hidden": 2560, "heads": 8, "kv_heads": 2, "head_dim": 256,
                    "global_head_dim": 512, "ffn": 10240, "context": 131072, "vocab": 262144, "theta": 1e6,
                    "theta_swa": 1e4, "eps": 1e-6, "tied": True, "per_layer": 256, "kv_shared": 18, "window": 512,
                    "full": 6, "half": True},
    # Qwen3-30B-A3B's layers (its config.json): 128 experts of width 768, 8 chosen a token (renormalized), q/k norms,
    # head size 128; the first 4 of its 48 layers (the bench keeps fewer: each layer's experts are 1.2 GB in F16)
    "qwen3-30b-a3b": {"arch": "qwen3moe", "layers": 4, "hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128,
                      "ffn": 6144, "context": 40960, "vocab": 151936, "theta": 1e6, "eps": 1e-6, "tied": False,
                      "qk_norm": True, "half": True, "experts": (128, 8, 768)},
}


# ----------------------------------------------------------------------------------------------------------------
# Workers: one engine, one file, one process; print one JSON line


def timed_runs(prefill_and_decode, runs: int) -> dict:
    """prefill_and_decode() -> (ttft_s, total_s, tokens); a warm-up run first, then medians."""
    prefill_and_decode()
    rows = [prefill_and_decode() for _ in range(runs)]
    decode = [(n - 1) / (total - ttft) for ttft, total, n in rows if n > 1]
    return {"decode_tok_s": statistics.median(decode) if decode else None, "decode_tok_s_all": decode,
            "ttft_s": statistics.median(r[0] for r in rows), "tokens": rows[0][2]}


def worker_llama(args) -> dict:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(model_path=args.gguf, n_ctx=args.ctx, n_threads=args.threads, n_threads_batch=args.threads,
                n_batch=512, verbose=False)
    loaded = time.perf_counter() - start
    ids = json.loads(args.ids)
    out = []

    def next_token() -> int:  # the last position's logits (llm.scores stays zero unless logits_all=True)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        return int(np.argmax(logits))

    def run():
        llm.reset()
        out.clear()
        start = time.perf_counter()
        llm.eval(ids)
        token = next_token()
        ttft = time.perf_counter() - start
        out.append(token)
        for _ in range(args.gen - 1):
            llm.eval([token])
            token = next_token()
            out.append(token)
        return ttft, time.perf_counter() - start, len(out)

    result = timed_runs(run, args.runs)
    return {**result, "ids": list(out), "peak_rss_gib": peak_rss_gib(), "load_s": loaded}


def peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def worker_dense(args) -> dict:
    import torch

    from dense_engine.formats.load import from_pretrained
    from dense_engine.runtime import caches, generate
    from dense_engine.runtime.steps import Steps

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model = from_pretrained(args.gguf, quant=args.quant)  # int8: per channel, from the Q8_0 file
    loaded = time.perf_counter() - start
    caches.setup_cache(model, 1, args.ctx)  # llama.cpp's n_ctx
    ids = torch.tensor([json.loads(args.ids)])
    out = []
    steps = Steps(model)

    def run():
        out.clear()
        start = time.perf_counter()
        tokens = generate.generate_tokens(model, ids, args.gen, steps=steps)
        out.append(int(next(tokens)))
        ttft = time.perf_counter() - start
        out.extend(int(t) for t in tokens)
        return ttft, time.perf_counter() - start, len(out)

    result = timed_runs(run, args.runs)
    return {**result, "ids": list(out), "peak_rss_gib": peak_rss_gib(), "load_s": loaded}


# ----------------------------------------------------------------------------------------------------------------
# Files: every precision from the same weights


def copy_metadata(reader, writer, arch_overrides: dict | None = None) -> None:
    import gguf

    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.file_type",
            "general.quantization_version"}
    for name, field in reader.fields.items():
        if name in skip or name in (arch_overrides or {}):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for name, (value, vtype) in (arch_overrides or {}).items():
        writer.add_key_value(name, value, vtype)


def write_float_gguf(src: str, dst: str, float_type: str) -> None:
    """The source GGUF with every tensor dequantized to F32 (or F16; 1-D tensors stay F32, as llama.cpp keeps them)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst + ".tmp", "llama")
    copy_metadata(reader, writer)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if float_type == "F32" else gguf.LlamaFileType.MOSTLY_F16)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
        if float_type == "F16" and values.ndim == 2:
            values = values.astype(np.float16)
        writer.add_tensor(t.name, np.ascontiguousarray(values, dtype=values.dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(dst + ".tmp", dst)


CONTROL_PADDING = 256  # (an earlier version made all 79-103K padded tokens control tokens: 0.25 s more a start)


def padded_as_now(path: str) -> bool:
    """Whether a random-shape file's padded tokens are typed as write_random types them now."""
    import gguf

    types = gguf.GGUFReader(path).fields["tokenizer.ggml.token_type"].contents()
    return list(types[-CONTROL_PADDING - 1:]) == [1] + [3] * CONTROL_PADDING


def write_random(template: str, dst: str, name: str) -> None:
    """An F32 GGUF of a published shape with random weights (N(0, 0.02), norms 1, biases 0.01), the template's
    tokenizer (its token list padded to the shape's vocabulary as the real files' are: normal tokens, the last
    CONTROL_PADDING of them control tokens, as Llama 3's 256 reserved special tokens; a tokenizer loads each control
    token as an added token, 2-3 us apiece)."""
    import math

    import gguf
    import numpy as np

    shape = SHAPES[name]
    reader = gguf.GGUFReader(template)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    vocab = shape["vocab"] or len(tokens)
    padding = vocab - len(tokens)
    writer = gguf.GGUFWriter(dst + ".tmp", shape["arch"])
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            value = field.contents()
            if key == "tokenizer.ggml.tokens":
                value = value + [f"<|reserved_{i}|>" for i in range(padding)]
            elif key == "tokenizer.ggml.token_type":
                control = min(padding, CONTROL_PADDING)
                value = value + [1] * (padding - control) + [3] * control
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY
                                 else None)
    writer.add_name(f"random {name} shape")
    writer.add_block_count(shape["layers"])
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(shape["hidden"])
    if shape["arch"] != "gemma4":  # (gemma4: a width a layer)
        writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    if shape["arch"] != "granitehybrid":
        writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_freq_base(shape["theta"])
    writer.add_layer_norm_rms_eps(shape["eps"])
    D = shape.get("head_dim") or shape["hidden"] // shape["heads"]
    qwen35, granite = shape["arch"] == "qwen35", shape["arch"] == "granitehybrid"
    attention = [not granite or i % 10 == 9 for i in range(shape["layers"])]
    if granite:  # the metadata llama.cpp's converter writes for Granite 4.0 H: head_count_kv 0 on a Mamba2 layer
        heads, dim, groups, state = shape["mamba"]
        writer.add_head_count_kv([shape["kv_heads"] if a else 0 for a in attention])
        writer.add_ssm_conv_kernel(shape["conv"])
        writer.add_ssm_state_size(state)
        writer.add_ssm_group_count(groups)
        writer.add_ssm_time_step_rank(heads)
        writer.add_ssm_inner_size(heads * dim)
        writer.add_rope_scaling_finetuned(False)  # (no rope)
        writer.add_embedding_scale(12.0)
        writer.add_residual_scale(0.22)
        writer.add_attention_scale(1 / 64)
        writer.add_logit_scale(6.0)
    if shape["arch"] == "gemma4":
        gemma4_metadata(writer, shape)
    writer.add_rope_dimension_count(D // 4 if qwen35 else shape.get("global_head_dim") or D)
    if shape.get("experts"):  # (qwen3moe: the converter's expert counts and width, the head size apart from C / H)
        count, used, width = shape["experts"]
        writer.add_expert_count(count)
        writer.add_expert_used_count(used)
        writer.add_expert_feed_forward_length(width)
        writer.add_key_length(D)
        writer.add_value_length(D)
    if qwen35:  # the metadata llama.cpp's converter writes for Qwen3.5 (no MTP layer here)
        k_heads, v_heads, dim = shape["linear"]
        writer.add_key_length(D)
        writer.add_value_length(D)
        writer.add_ssm_conv_kernel(shape["conv"])
        writer.add_ssm_state_size(dim)
        writer.add_ssm_group_count(k_heads)
        writer.add_ssm_time_step_rank(v_heads)
        writer.add_ssm_inner_size(v_heads * dim)
        writer.add_full_attention_interval(4)
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    half = shape.get("half", False)  # (an 8B shape's source in float16: 16 GB on disk instead of 32)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if half else gguf.LlamaFileType.ALL_F32)
    rng = np.random.default_rng(0)
    C = shape["hidden"]
    tensors = []  # (name, shape, make): written one at a time, so an 8B shape never sits in memory whole

    def w(name, rows, cols):
        tensors.append((name, (rows, cols), lambda: (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)
                        .astype(np.float16 if half else np.float32)))

    def vector(name, values):
        tensors.append((name, values.shape, lambda: values))

    def experts(name, count, rows, cols):  # [count, rows, cols], written an expert at a time
        tensors.append((name, (count, rows, cols), lambda: np.stack([
            rng.standard_normal((rows, cols), dtype=np.float32) * 0.02 for _ in range(count)]).astype(
                np.float16 if half else np.float32)))

    w("token_embd.weight", vocab, C)
    vector("output_norm.weight", np.ones(C, dtype=np.float32))
    if not shape["tied"]:
        w("output.weight", vocab, C)
    if shape.get("llama3"):  # Llama 3.x: the divisor of each rotary frequency, as llama.cpp's converter writes it
        r = shape["llama3"]
        factors = []
        for i in range(0, D, 2):
            wavelen = 2 * math.pi * shape["theta"] ** (i / D)
            smooth = (r["original"] / wavelen - r["low"]) / (r["high"] - r["low"])
            factors.append(1.0 if wavelen < r["original"] / r["high"] else r["factor"] if wavelen > r["original"] /
                           r["low"] else 1 / ((1 - smooth) / r["factor"] + smooth))
        vector("rope_freqs.weight", np.array(factors, dtype=np.float32))
    if shape["arch"] == "gemma4":
        gemma4_tensors(shape, C, w, vector)
    for i in range(0 if shape["arch"] != "gemma4" else shape["layers"], shape["layers"]):
        b = f"blk.{i}."  # (EXAONE 4: a norm after each branch, none before)
        vector(b + ("post_attention_norm" if shape.get("post_norms") else "attn_norm") + ".weight",
               np.ones(C, dtype=np.float32))
        if qwen35:
            qwen35_layer(b, i % 4 == 3, shape, C, D, w, vector)
            continue
        if granite and not attention[i]:
            vector(b + "ffn_norm.weight", np.ones(C, dtype=np.float32))
            mamba_layer(b, shape, C, w, vector)
            continue
        vector(b + ("post_ffw_norm" if shape.get("post_norms") else "ffn_norm") + ".weight",
               np.ones(C, dtype=np.float32))
        if shape.get("qk_norm"):
            vector(b + "attn_q_norm.weight", np.ones(D, dtype=np.float32))
            vector(b + "attn_k_norm.weight", np.ones(D, dtype=np.float32))
        w(b + "attn_q.weight", shape["heads"] * D, C)
        w(b + "attn_k.weight", shape["kv_heads"] * D, C)
        w(b + "attn_v.weight", shape["kv_heads"] * D, C)
        if shape.get("bias"):
            for part, heads in (("q", shape["heads"]), ("k", shape["kv_heads"]), ("v", shape["kv_heads"])):
                vector(b + f"attn_{part}.bias", np.full(heads * D, 0.01, dtype=np.float32))
        w(b + "attn_output.weight", C, shape["heads"] * D)
        if shape.get("experts"):  # the router in float32 (as the converter keeps it), the experts stacked
            count, _, width = shape["experts"]
            vector(b + "ffn_gate_inp.weight", rng.standard_normal((count, C), dtype=np.float32) * 0.02)
            for part, rows, cols in (("gate", width, C), ("up", width, C), ("down", C, width)):
                experts(b + f"ffn_{part}_exps.weight", count, rows, cols)
            continue
        w(b + "ffn_gate.weight", shape["ffn"], C)
        w(b + "ffn_up.weight", shape["ffn"], C)
        w(b + "ffn_down.weight", C, shape["ffn"])
    for tensor, dims, _ in tensors:
        dtype = np.dtype(np.float16 if half and len(dims) >= 2 and not tensor.endswith("ffn_gate_inp.weight")
                         else np.float32)
        writer.add_tensor_info(tensor, dims, dtype, math.prod(dims) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, make in tensors:
        writer.write_tensor_data(make())
    writer.close()
    os.replace(dst + ".tmp", dst)


def gemma4_layers(shape: dict) -> tuple[list[bool], list[int]]:
    """Which layers are full (every shape["full"]-th, the last one too), and each layer's FFN width (twice as wide
    where it reads an earlier layer's keys and values)."""
    L, shared = shape["layers"], shape["layers"] - shape["kv_shared"]
    full = [(i + 1) % shape["full"] == 0 for i in range(L)]
    return full, [shape["ffn"] * (2 if i >= shared else 1) for i in range(L)]


def gemma4_metadata(writer, shape: dict) -> None:
    """The gemma4 keys llama.cpp's converter writes (tests/fixtures/converted_gguf/gemma4.gguf: one it wrote)."""
    import gguf

    U32, F32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    full, widths = gemma4_layers(shape)
    writer.add_feed_forward_length(widths)
    writer.add_key_length(shape["global_head_dim"])
    writer.add_value_length(shape["global_head_dim"])
    writer.add_key_value("gemma4.attention.key_length_swa", shape["head_dim"], U32)
    writer.add_key_value("gemma4.attention.value_length_swa", shape["head_dim"], U32)
    writer.add_key_value("gemma4.rope.dimension_count_swa", shape["head_dim"], U32)
    writer.add_key_value("gemma4.rope.freq_base_swa", shape["theta_swa"], F32)
    writer.add_key_value("gemma4.final_logit_softcapping", 30.0, F32)
    writer.add_key_value("gemma4.attention.sliding_window", shape["window"], U32)
    writer.add_key_value("gemma4.attention.shared_kv_layers", shape["kv_shared"], U32)
    writer.add_key_value("gemma4.embedding_length_per_layer_input", shape["per_layer"], U32)
    writer.add_key_value("gemma4.attention.sliding_window_pattern", [not f for f in full], gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.BOOL)


def gemma4_tensors(shape: dict, C: int, w, vector) -> None:
    """The per-layer table and its projection, proportional rope's factors (1 on the rotated quarter of a full
    layer's pairs, 1e30 on the rest), and each layer's tensors as the converter names them; norms and layer scales
    stored as the model multiplies them (1)."""
    import numpy as np

    full, widths = gemma4_layers(shape)
    L, P, G, D = shape["layers"], shape["per_layer"], shape["global_head_dim"], shape["head_dim"]
    vector("rope_freqs.weight", np.array([1.0] * (G // 8) + [1e30] * (G // 2 - G // 8), dtype=np.float32))
    w("per_layer_token_embd.weight", shape["vocab"], L * P)
    w("per_layer_model_proj.weight", L * P, C)
    vector("per_layer_proj_norm.weight", np.ones(P, dtype=np.float32))
    for i in range(L):
        b, d = f"blk.{i}.", G if full[i] else D
        for norm in ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm", "post_norm"):
            vector(b + norm + ".weight", np.ones(C, dtype=np.float32))
        vector(b + "layer_output_scale.weight", np.ones(1, dtype=np.float32))
        w(b + "attn_q.weight", shape["heads"] * d, C)
        vector(b + "attn_q_norm.weight", np.ones(d, dtype=np.float32))
        if i < L - shape["kv_shared"]:  # (the shared layers have no keys and values of their own)
            w(b + "attn_k.weight", shape["kv_heads"] * d, C)
            w(b + "attn_v.weight", shape["kv_heads"] * d, C)
            vector(b + "attn_k_norm.weight", np.ones(d, dtype=np.float32))
        w(b + "attn_output.weight", C, shape["heads"] * d)
        w(b + "inp_gate.weight", P, C)
        w(b + "proj.weight", C, P)
        w(b + "ffn_gate.weight", widths[i], C)
        w(b + "ffn_up.weight", widths[i], C)
        w(b + "ffn_down.weight", C, widths[i])


def qwen35_layer(b: str, full: bool, shape: dict, C: int, D: int, w, vector) -> None:
    """One qwen35 block's tensors as llama.cpp's converter names them: a gated attention layer (q rows with their
    gate rows, q/k norms) or a Gated DeltaNet layer (the conv kernel [channels, W], ssm_a = -exp(A_log) < 0); norms
    stored as 1 + the checkpoint's offset, here 1."""
    import numpy as np

    ones = lambda n: np.ones(n, dtype=np.float32)
    vector(b + "post_attention_norm.weight", ones(C))
    w(b + "ffn_gate.weight", shape["ffn"], C)
    w(b + "ffn_up.weight", shape["ffn"], C)
    w(b + "ffn_down.weight", C, shape["ffn"])
    if full:
        w(b + "attn_q.weight", 2 * shape["heads"] * D, C)
        w(b + "attn_k.weight", shape["kv_heads"] * D, C)
        w(b + "attn_v.weight", shape["kv_heads"] * D, C)
        w(b + "attn_output.weight", C, shape["heads"] * D)
        vector(b + "attn_q_norm.weight", ones(D))
        vector(b + "attn_k_norm.weight", ones(D))
        return
    k_heads, v_heads, dim = shape["linear"]
    channels = 2 * k_heads * dim + v_heads * dim
    w(b + "attn_qkv.weight", channels, C)
    w(b + "attn_gate.weight", v_heads * dim, C)
    w(b + "ssm_beta.weight", v_heads, C)
    w(b + "ssm_alpha.weight", v_heads, C)
    vector(b + "ssm_conv1d.weight", np.random.default_rng(1).standard_normal((channels, shape["conv"]),
                                                                             dtype=np.float32) * 0.3)
    vector(b + "ssm_dt.bias", np.zeros(v_heads, dtype=np.float32))
    vector(b + "ssm_a", -np.geomspace(0.02, 0.5, v_heads).astype(np.float32))
    vector(b + "ssm_norm.weight", ones(dim))
    w(b + "ssm_out.weight", C, v_heads * dim)


def mamba_layer(b: str, shape: dict, C: int, w, vector) -> None:
    """A granitehybrid Mamba2 block's tensors as llama.cpp's converter names them (ssm_in: z | x B C | dt rows; the conv
    kernel [channels, W]; ssm_a = -exp(A_log) and ssm_d [heads, 1]; ssm_norm [groups, channels]), and its MLP."""
    import numpy as np

    heads, dim, groups, state = shape["mamba"]
    inner, channels = heads * dim, heads * dim + 2 * groups * state
    w(b + "ssm_in.weight", inner + channels + heads, C)
    vector(b + "ssm_conv1d.weight", np.random.default_rng(1).standard_normal((channels, shape["conv"]),
                                                                             dtype=np.float32) * 0.3)
    vector(b + "ssm_conv1d.bias", np.zeros(channels, dtype=np.float32))
    vector(b + "ssm_dt.bias", np.zeros(heads, dtype=np.float32))
    vector(b + "ssm_a", -np.geomspace(0.02, 0.5, heads).astype(np.float32)[:, None])
    vector(b + "ssm_d", np.ones((heads, 1), dtype=np.float32))
    vector(b + "ssm_norm.weight", np.ones((groups, inner // groups), dtype=np.float32))
    w(b + "ssm_out.weight", C, inner)
    w(b + "ffn_gate.weight", shape["ffn"], C)
    w(b + "ffn_up.weight", shape["ffn"], C)
    w(b + "ffn_down.weight", C, shape["ffn"])


def llama_quantize(llama_python: str, src: str, dst: str, ftype: str) -> None:
    """llama.cpp's own quantizer (llama_model_quantize), run in the llama-cpp-python interpreter."""
    code = ("import sys, llama_cpp; p = llama_cpp.llama_model_quantize_default_params(); "
            f"p.ftype = llama_cpp.LLAMA_FTYPE_{ftype}; p.nthread = 2; "
            "rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p); sys.exit(rc)")
    subprocess.run([llama_python, "-c", code, src, dst + ".tmp"], check=True, capture_output=True)
    os.replace(dst + ".tmp", dst)


FLOAT_FILES = ("F32", "F16", "Q8_0", "Q4_1")
KQUANT_FILES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")  # what people download (--kquants)


def model_files(name: str, llama_python: str, log, precisions=FLOAT_FILES) -> dict[str, str]:
    """{precision: gguf path} of one model (F32, F16, Q8_0, Q4_1, Q4_K_M, Q5_K_M, Q6_K, ...), made once under the cache
    folder: the F32 file first (random weights of the shape, or SmolLM2's own dequantized), then llama.cpp's own
    quantizer from it."""
    os.makedirs(WORK, exist_ok=True)
    import tempfile

    from dense_engine.formats import default_model

    files = {p: os.path.join(WORK, f"{name}-{p}.gguf") for p in ("F32", *precisions)}
    smollm2 = default_model.fetch_default_gguf(tempfile.mkdtemp(prefix="dense-bench-"))
    if name == "smollm2":
        files["Q4_1"] = smollm2
        for p in ("F32", "F16"):
            if not os.path.isfile(files[p]):
                log(f"writing {files[p]}")
                write_float_gguf(smollm2, files[p], p)
    elif all(os.path.isfile(files[p]) for p in precisions if p != "F32") and not os.path.isfile(files["F32"]):
        return {p: files[p] for p in precisions}  # (the source deleted to save disk: its quantized files kept)
    elif not os.path.isfile(files["F32"]) or not padded_as_now(files["F32"]):
        log(f"writing {files['F32']} (random weights)")
        write_random(smollm2, files["F32"], name)
    for p in precisions:  # (a random shape's again where its F32 file is newer)
        if not os.path.isfile(files[p]) or (name != "smollm2" and os.path.getmtime(files[p]) <
                                            os.path.getmtime(files["F32"])):
            log(f"writing {files[p]} with llama.cpp's quantizer")
            llama_quantize(llama_python, files["F32"], files[p], "MOSTLY_" + p)
    return {p: files[p] for p in precisions}


# ----------------------------------------------------------------------------------------------------------------
# The table


ROWS = [  # (label, llama.cpp file, this engine's file, this engine's quant)
    ("float32", "F32", "F32", "none"),
    ("float16 (llama.cpp only)", "F16", None, None),
    ("8-bit", "Q8_0", "Q8_0", "int8"),
    ("4-bit", "Q4_1", "Q4_1", "auto"),
    ("nf4 (this engine only)", None, "Q4_1", "nf4"),
]


KQUANT_ROWS = [(p, p, p, "auto") for p in KQUANT_FILES]  # (--kquants) each file as both engines load it by default


def run_worker(python: str, engine: str, gguf: str, quant: str | None, ids: list[int], args) -> dict:
    cmd = [python, os.path.abspath(__file__), "--worker", engine, "--gguf", gguf, "--ids", json.dumps(ids),
           "--gen", str(args.gen), "--runs", str(args.runs), "--threads", str(args.threads), "--ctx", str(args.ctx)]
    if quant:
        cmd += ["--quant", quant]
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1]}
    return {**json.loads(lines[-1]), "wall_s": time.perf_counter() - start}


def summarize(runs: list[dict]) -> dict:
    """One engine's processes in one row: medians over them (the first error if any failed)."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    return {"decode_tok_s": statistics.median(r["decode_tok_s"] or 0 for r in runs),
            "ttft_s": statistics.median(r["ttft_s"] for r in runs),
            **{k: statistics.median(r[k] for r in runs) for k in ("peak_rss_gib", "load_s", "wall_s")},
            "decode_tok_s_by_process": [r["decode_tok_s"] for r in runs], "ids": runs[0]["ids"]}


def prompt_ids(gguf: str) -> list[int]:
    from tokenizers import Tokenizer

    from dense_engine.formats import vocab

    tok = Tokenizer.from_str(vocab.gguf_side_files(gguf)["tokenizer.json"])
    text = ("Write a short story about a lighthouse keeper who discovers that the light has been guiding something "
            "other than ships. Keep it under two hundred words.")
    return tok.encode(text, add_special_tokens=False).ids


def alternating_rounds(args, files: dict, row: tuple, ids: list[int], console, what: str) -> dict:
    """Each engine that has a file for the row (label, llama.cpp's file, ours, our quant): args.rounds worker results,
    the engines' order alternating per round. {engine: [result, ...]}"""
    _, theirs, ours, quant = row
    workers = {"llama.cpp": (args.llama_python, "llama", theirs and files[theirs], None),
               "dense": (sys.executable, "dense", ours and files[ours], quant)}
    rounds = {engine: [] for engine, (_, _, gguf, _) in workers.items() if gguf}
    for r in range(args.rounds):
        for engine in (list(rounds) if r % 2 == 0 else list(rounds)[::-1]):
            python, kind, gguf, q = workers[engine]
            with console.status(f"{what}: {engine}, round {r + 1} of {args.rounds}"):
                rounds[engine].append(run_worker(python, kind, gguf, q, ids, args))
    return rounds


def prefill_tables(args, names: list[str], console) -> int:
    """--prefill: prompt tokens per second (prompt length / time to the first token), the engines alternating per
    round as for decoding; the ratio is the median of the rounds' ratios."""
    from rich.table import Table

    lengths = [int(n) for n in args.prefill.split(",")]
    args.gen = 1
    results = []
    for name in names:
        files = model_files(name, args.llama_python, lambda s: console.print(f"[dim]{s}[/dim]"), args.precisions)
        text_ids = prompt_ids(next(iter(files.values())))
        table = Table(title=f"{name}: prefill, batch 1, {args.threads} threads, {args.rounds} alternating rounds of "
                            f"{args.runs} runs")
        for col in ("precision", "prompt", "llama.cpp tok/s", "this engine tok/s", "ratio"):
            table.add_column(col)
        for label, theirs, ours, quant in [r for r in args.rows if r[2]]:  # (nf4: this engine only)
            for n in lengths:
                ids = (text_ids * (n // len(text_ids) + 1))[:n]
                rounds = alternating_rounds(args, files, (label, theirs, ours, quant), ids, console,
                                            f"{name} {label} {n} tokens")
                rates = {e: [n / x["ttft_s"] for x in runs if "ttft_s" in x] for e, runs in rounds.items()}
                errors = [x["error"] for runs in rounds.values() for x in runs if "error" in x]
                ratio = statistics.median(d / l for l, d in zip(rates["llama.cpp"], rates["dense"])) \
                    if theirs and not errors else None
                row = {"model": name, "precision": label, "prompt": n, "ratio": ratio, "error": errors[:1] or None,
                       **{f"{e}_prefill_tok_s": statistics.median(v) if v else None for e, v in rates.items()}}
                results.append(row)
                table.add_row(label, str(n), *(f"{row[f'{e}_prefill_tok_s']:.0f}" if rates.get(e) else
                                               (errors[0] if errors else "-") for e in ("llama.cpp", "dense")),
                              f"{ratio:.2f}" if ratio else "-")
        console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-python", help="python of a virtualenv with llama-cpp-python built from source")
    p.add_argument("--model", default="both", help="smollm2, tinyllama, llama-3.2-1b, qwen2.5-0.5b, qwen3.5-0.8b, "
                   "qwen3.5-2b, granite-4.0-h-1b, exaone-4.0-1.2b, gemma-4-e2b, gemma-4-e4b, qwen3-30b-a3b, a comma "
                   "list, or both (smollm2 and tinyllama)")
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--runs", type=int, default=2, help="timed generations per process (after one warm-up)")
    p.add_argument("--rounds", type=int, default=3, help="processes per engine and row, the engines alternating")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--position", type=int, help="decode after a prompt of this many tokens (raise --ctx with it)")
    p.add_argument("--prefill", metavar="N[,N]", help="prompt processing instead of decoding: prompts of N tokens "
                   "(e.g. 128,512), one new token; rows float32, 8-bit, 4-bit")
    p.add_argument("--kquants", action="store_true", help="the files people download instead: Q4_K_M, Q5_K_M, "
                   "Q6_K and Q8_0 (llama.cpp's quantizer), each loaded by both engines as they load it by default "
                   "(--quant auto here: the file's own blocks)")
    p.add_argument("--only", metavar="P[,P]", help="only these files' rows (e.g. Q4_K_M,Q8_0 with --kquants)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the table as a bar chart (one per model: "
                   "FILE-smollm2.png ...); needs matplotlib")
    p.add_argument("--worker", choices=("llama", "dense"), help=argparse.SUPPRESS)
    p.add_argument("--gguf", help=argparse.SUPPRESS)
    p.add_argument("--quant", default="none", help=argparse.SUPPRESS)
    p.add_argument("--ids", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.rows, args.precisions = (KQUANT_ROWS, KQUANT_FILES) if args.kquants else (ROWS, FLOAT_FILES)
    if args.only:
        only = args.only.split(",")
        args.rows = [r for r in args.rows if r[1] in only or r[2] in only]
        args.precisions = tuple(p for p in args.precisions if p in only)
    if args.worker:
        print(json.dumps((worker_llama if args.worker == "llama" else worker_dense)(args)))
        return 0
    if not args.llama_python:
        sys.exit("bench/llamacpp.py needs --llama-python: a virtualenv with llama-cpp-python built from source "
                 "(see the top of this file for the three commands)")
    from rich.console import Console
    from rich.table import Table

    console = Console()
    results = []
    names = ["smollm2", "tinyllama"] if args.model == "both" else args.model.split(",")
    unknown = [n for n in names if n != "smollm2" and n not in SHAPES]
    if unknown:
        sys.exit(f"--model {unknown[0]}: not one of smollm2, {', '.join(SHAPES)}")
    if args.prefill:
        return prefill_tables(args, names, console)
    for name in names:
        files = model_files(name, args.llama_python, lambda s: console.print(f"[dim]{s}[/dim]"), args.precisions)
        ids = prompt_ids(next(iter(files.values())))
        if args.position:  # the prompt repeated to that length: decoding from there (a state's size stays, a cache's
            ids = (ids * (args.position // len(ids) + 1))[:args.position]  # grows)
        table = Table(title=f"{name}: {len(ids)}-token prompt, {args.gen} greedy tokens, batch 1, {args.threads} "
                            f"threads, {args.rounds} alternating rounds of {args.runs} runs")
        for col in ("precision", "llama.cpp tok/s", "this engine tok/s", "ratio", "TTFT llama.cpp / this (ms)",
                    "peak RSS llama.cpp / this (GiB)", "load llama.cpp / this (s)", "same tokens"):
            table.add_column(col)
        for label, theirs, ours, quant in args.rows:
            row = {"model": name, "precision": label}
            rounds = alternating_rounds(args, files, (label, theirs, ours, quant), ids, console, f"{name} {label}")
            for engine, results_of in rounds.items():
                row[engine] = summarize(results_of)
            results.append(row)
            a, b = row.get("llama.cpp", {}), row.get("dense", {})
            ratio = None
            if "decode_tok_s" in a and "decode_tok_s" in b:  # per round, then the median
                ratio = statistics.median(d["decode_tok_s"] / l["decode_tok_s"]
                                          for l, d in zip(rounds["llama.cpp"], rounds["dense"]))
                row["ratio"] = ratio
            same = None
            if "ids" in a and "ids" in b:  # greedy tokens both engines agree on, from the first (rounding differs)
                same = next((i for i, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y), len(b["ids"]))
                row["same_tokens"] = same
            table.add_row(label, f"{a['decode_tok_s']:.1f}" if "decode_tok_s" in a else a.get("error", "-"),
                          f"{b['decode_tok_s']:.1f}" if "decode_tok_s" in b else b.get("error", "-"),
                          f"{ratio:.2f}" if ratio else "-",
                          f"{a.get('ttft_s', 0) * 1000:.0f} / {b.get('ttft_s', 0) * 1000:.0f}",
                          f"{a.get('peak_rss_gib', 0):.2f} / {b.get('peak_rss_gib', 0):.2f}",
                          f"{a.get('load_s', 0):.2f} / {b.get('load_s', 0):.2f}",
                          f"{same} of {len(b['ids'])}" if same is not None else "-")
        console.print(table)
        if args.plot:
            from dense_engine.cli import benchmark

            rows = [r for r in results if r["model"] == name]
            rate = lambda r, key: r.get(key, {}).get("decode_tok_s")
            benchmark.bar_chart(args.plot.removesuffix(".png") + f"-{name}.png", [r["precision"] for r in rows],
                                {"llama.cpp": [rate(r, "llama.cpp") for r in rows],
                                 "this engine": [rate(r, "dense") for r in rows]},
                                f"{name}: decode, batch 1, {args.threads} threads", "tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
