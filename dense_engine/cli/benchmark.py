"""benchmark.py: tokens/s of prefill and decode, as `python chat.py --bench` reports them.

    python chat.py --bench --shape smollm2-135m --compile --json
    python chat.py --bench --ckpt DIR --quant int4 --prompt-len 512 --gen-len 128

Warm-up first (its extra time over a measured run is reported as compile_s), then --runs measured runs of one
prefill of --prompt-len tokens and --gen-len decode steps at --batch-size; medians with min..max spread.
Bytes per token counts the weights one decode step reads (every linear and norm, the head; not the embedding table,
of which a step reads one row); bandwidth = bytes per token x decode steps per second, as gpt-fast reports it.
Stands on flags.py (loading as chat.py does), caches.py and generate.py.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time

import torch

import dense
import layer_kinds
from dense_engine.cli import flags
from dense_engine.cpu import quantized
from dense_engine.formats import checkpoint, families, load
from dense_engine.formats import vocab as vocab_module
from dense_engine.formats.checkpoint import atomic_write, make_config
from dense_engine.runtime import caches, generate, speculative, tp
from dense_engine.runtime.steps import steps_for

IMPORTED = time.perf_counter()

# Published shapes, for measuring without downloads (random weights).
SHAPES = {
    "smollm2-135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True},
    "pythia-1.4b": {"vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                    "num_attention_heads": 16, "head_dim": 128, "rotary_dim": 32, "max_position_embeddings": 2048,
                    "norm": "layernorm", "mlp": "gelu", "bias": True, "parallel_residual": True},
    "openelm-1.1b": "openelm",
    "llama-2-7b": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "head_dim": 128, "max_position_embeddings": 4096, "norm_eps": 1e-5},
    "tiny": {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
             "max_position_embeddings": 2048},  # (dry runs: bench/gpu.py)
    "shellelastic": checkpoint.NATIVE_DEFAULTS,  # the native format's defaults: the ShellElastic model
    "llama-3.2-1b": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     "tie_word_embeddings": True},
    "qwen2.5-0.5b": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64,
                     "max_position_embeddings": 32768, "rope_theta": 1e6, "norm_eps": 1e-6, "qkv_bias": True,
                     "tie_word_embeddings": True},
    "qwen3-0.6b": {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 40960, "rope_theta": 1e6, "norm_eps": 1e-6, "qk_norm": "shared",
                   "tie_word_embeddings": True},
    "gemma-3-1b": {"vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
                   "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                   "max_position_embeddings": 32768, "rope_theta": 1e6, "rope_local_theta": 1e4, "sliding_window": 512,
                   "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(26)],
                   "attn_scale": 256 ** -0.5, "norm_eps": 1e-6, "norm_unit_offset": True, "qk_norm": "shared",
                   "mlp": "geglu", "post_norms": True, "embed_scale": 1152 ** 0.5, "tie_word_embeddings": True},
    "phi-4-mini": {"vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
                   "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 96,
                   "max_position_embeddings": 131072, "rope_scaling": {
                       "rope_type": "longrope", "short_factor": [1.0] * 48,
                       "long_factor": [1.0 + i / 8 for i in range(48)], "original_max_position_embeddings": 4096},
                   "tie_word_embeddings": True},
}
PEAK_BANDWIDTH_GBS = {"H200": 4800, "H100": 3350, "A100": 2039, "L4": 300, "RTX 4090": 1008}


def shape_config(name: str) -> dense.DenseConfig:
    spec = SHAPES[name]
    if spec == "openelm":  # OpenELM-1_1B's per-layer widths, derived as its config does
        raw = {"num_transformer_layers": 28, "model_dim": 2048, "head_dim": 64, "num_gqa_groups": 4,
               "ffn_multipliers": (0.5, 4.0), "qkv_multipliers": (0.5, 1.0), "ffn_dim_divisor": 256}
        heads, kv, ffn = families.openelm_widths(raw, name)
        return make_config(name, vocab_size=32000, hidden_size=2048, num_hidden_layers=28, num_attention_heads=heads,
                                 num_key_value_heads=kv, head_dim=64, intermediate_size=ffn, norm_eps=1e-6,
                                 qk_norm="shared", tie_word_embeddings=True)
    return make_config(name, **spec)


def random_model(name: str, device, dtype, layers: int | None = None, vocab: int | None = None) -> dense.DenseDecoder:
    """A model of a published shape with random weights, built directly in dtype on device (no float32 copy).
    layers: keep only the first this many layers (the same widths: bench/gpu.py's checks compile faster); vocab:
    another vocabulary size (a test tokenizer's)."""
    config = shape_config(name)
    if layers is not None:
        config.num_hidden_layers = layers
    if vocab is not None:
        config.vocab_size = vocab
    with torch.device("meta"):
        model = layer_kinds.Decoder(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:  # to_empty gives every module its own tensor: share the embedding again
        model.lm_head.weight = model.embed_tokens.weight
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            elif pname.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0, 0.02, generator=generator)
    return quantized.swap_linears(model, None, {}).eval()  # full precision through kernels.py, as from_pretrained


def weight_bytes(model: dense.DenseDecoder) -> int:
    """Bytes of weights one decode step reads (the embedding table excluded unless the head is that very tensor: a
    quantized head of a tied model is a copy, and the float table then serves only the one-row lookup)."""
    embedding = model.embed_tokens
    table = embedding.weight if hasattr(embedding, "weight") else embedding.blocks  # (GGUF blocks: the file's own)
    shared = any(t.data_ptr() == table.data_ptr() for t in (*model.lm_head.parameters(), *model.lm_head.buffers()))
    seen, total = set() if shared else {table.data_ptr()}, 0
    for t in weight_tensors(model).values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def weight_tensors(model: dense.DenseDecoder) -> dict[str, torch.Tensor]:
    """The model's state dict and its GGUF layers' blocks (buffers read from the file, not saved with the model)."""
    tensors = dict(model.state_dict())
    for name, m in model.named_modules():
        if isinstance(m, (quantized.GGUFLinear, quantized.GGUFEmbedding)):
            tensors.update({f"{name}.{b}": t for b, t in m.named_buffers(recurse=False)})
    return tensors


def stored_bytes(model: dense.DenseDecoder) -> int:
    """Bytes of every tensor the model holds (each shared tensor once): what a process keeps resident."""
    unique = {t.data_ptr(): t for t in weight_tensors(model).values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "cpu"
    return f"{model} ({torch.get_num_threads()} threads)"


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def process_age() -> float:
    """Seconds since this process started (Linux: /proc), else since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - IMPORTED


def prompts(model, batch: int, lengths: tuple[int, int], seed: int, given: list[int] | None = None):
    """Random prompt ids: [batch, T] when every prompt has the same length, else a ragged list (or `given` ids)."""
    if given is not None:
        return torch.tensor([given] * batch, device=model.device)
    generator = torch.Generator().manual_seed(seed)
    lo, hi = lengths
    if lo == hi:
        return torch.randint(0, model.config.vocab_size, (batch, lo), generator=generator).to(model.device)
    sizes = torch.randint(lo, hi + 1, (batch,), generator=generator).tolist()
    return [torch.randint(0, model.config.vocab_size, (n,), generator=generator).to(model.device) for n in sizes]


def attended(model, last: int, compile: bool) -> int:
    """Cache slots the last decode step attended over: its bucket, or the slots in use (eager steps, and the CPU
    cache whose attention reads only those)."""
    if not compile or isinstance(caches.kv_memory(model), caches.CPUKVCache):
        return last
    return generate.attend_width(model, last)


def one_run(model, steps, batch: int, lengths: tuple[int, int], gen_len: int, seed: int, given=None, draft=None,
            speculate_k: int = 4) -> dict:
    prompt = prompts(model, batch, lengths, seed, given)
    device = model.device
    stats = {}
    sync(device)
    start = time.perf_counter()
    tokens = (generate.generate_tokens(model, prompt, gen_len, steps=steps) if draft is None else
              speculative.generate_tokens(model, prompt, gen_len, draft, steps=steps, speculate_k=speculate_k,
                                          stats=stats))
    first = next(tokens)
    first.cpu()
    ttft = time.perf_counter() - start
    for _ in tokens:
        pass
    sync(device)
    total = time.perf_counter() - start
    decode = total - ttft
    prompt_tokens = prompt.numel() if isinstance(prompt, torch.Tensor) else sum(p.numel() for p in prompt)
    return {"ttft_s": ttft, "prefill_tok_s": prompt_tokens / ttft, "total_s": total,
            "decode_tok_s": batch * (gen_len - 1) / decode if gen_len > 1 else None,
            "ms_per_step": 1000 * decode / (gen_len - 1) if gen_len > 1 else None, **stats}


def run_benchmark(model, *, batch: int, prompt_len: int | tuple[int, int], gen_len: int, compile: bool, runs: int,
                  peak_bw: float | None, quant: str, cache_len: int | None = None, progress=None,
                  prompt_ids: list[int] | None = None, draft=None, speculate_k: int = 4,
                  kv_dtype: str = "auto") -> dict:
    """Warm up (load or compile the steps), then `runs` measured runs. cache_len: the KV cache's length (default:
    the model's context, as chat.py uses it; a batch gets what it needs, rounded up to a power of two), kv_dtype its
    numbers (caches.cache_for). prompt_ids: a real prompt instead of random ids; draft: speculative decoding
    (speculative.py) with speculate_k."""
    device = model.device
    if prompt_ids is not None:
        prompt_len = len(prompt_ids)
    if draft is not None and batch != 1:
        raise ValueError("speculative decoding runs at batch 1 (--batch-size 1)")
    lengths = prompt_len if isinstance(prompt_len, tuple) else (prompt_len, prompt_len)
    needed = lengths[1] + gen_len
    context = model.config.max_position_embeddings
    if needed > context:
        raise ValueError(f"--prompt-len {lengths[1]} + --gen-len {gen_len} exceed the context of {context}")
    cache_len = (caches.fitting_cache(model, 1, cache_len, kv_dtype) if batch == 1 else
                 cache_len or generate.cache_length(needed, context))
    if cache_len < needed:
        raise ValueError(f"--max-seq-len {cache_len} is shorter than --prompt-len + --gen-len ({needed})")
    caches.setup_cache(model, batch, cache_len, kv_dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps = steps_for(model) if compile else None  # (shared with a later --plot run)
    if steps is not None:
        steps.status = progress
    if progress:
        progress("warming up" + (" (loading or compiling the steps)" if compile else ""))
    run = {"given": prompt_ids, "draft": draft, "speculate_k": speculate_k}
    one_run(model, steps, batch, lengths, min(gen_len, 3), seed=0, **run)
    startup = process_age()
    one_run(model, steps, batch, lengths, gen_len, seed=0, **run)  # every bucket the runs reach
    measured = []
    for i in range(runs):
        if progress:
            progress(f"run {i + 1} of {runs}")
        measured.append(one_run(model, steps, batch, lengths, gen_len, seed=i + 1, **run))

    def spread(key):  # (median, min, max); median_low is always one of the runs, so rates and times agree
        values = [m[key] for m in measured if m[key] is not None]
        return (statistics.median_low(values), min(values), max(values)) if values else (None, None, None)

    ttft, step = spread("ttft_s"), spread("ms_per_step")
    median_run = next(m for m in measured if m["ttft_s"] == ttft[0])  # its rate agrees with the median time
    prefill = (median_run["prefill_tok_s"], *spread("prefill_tok_s")[1:])
    decode = (batch * 1000 / step[0], *spread("decode_tok_s")[1:]) if step[0] else (None, None, None)
    nbytes = weight_bytes(model)
    steps_per_s = decode[0] / batch if decode[0] else None
    bandwidth = nbytes * steps_per_s / 1e9 if steps_per_s else None
    name = device_name(device)
    peak = peak_bw or next((bw for key, bw in PEAK_BANDWIDTH_GBS.items() if key in name), None)
    target_steps = sum(m.get("target_steps", 0) for m in measured)
    speculation = {
        "speculate_k": speculate_k if draft is not None else None,
        "acceptance_rate": (sum(m["accepted"] for m in measured) / max(1, sum(m["proposed"] for m in measured))
                            if draft is not None else None),
        "tokens_per_target_step": (runs * (gen_len - 1) / target_steps if target_steps else 1.0),
    }
    return {
        **speculation, "draft": type(draft).__name__ if draft is not None else None,
        "decode_tok_s": decode[0], "decode_tok_s_range": decode[1:],
        "decode_tok_s_per_row": decode[0] / batch if decode[0] else None, "prefill_tok_s": prefill[0],
        "prefill_tok_s_range": prefill[1:], "ttft_s": ttft[0], "ttft_s_range": ttft[1:], "ms_per_step": step[0],
        "compile_s": steps.compile_s if steps else 0.0, "startup_s": startup, "cache_len": cache_len,
        "attended_len": attended(model, lengths[1] + gen_len - 1, compile),
        "bytes_per_token": nbytes, "bandwidth_gbs": bandwidth,
        "mbu": bandwidth / peak if bandwidth and peak else None, "peak_bw_gbs": peak,
        "peak_mem_bytes": peak_memory(device), "device": name, "dtype": str(model.dtype).removeprefix("torch."),
        "quant": quant, "batch_size": batch, "prompt_len": lengths[1] if lengths[0] == lengths[1] else list(lengths),
        "gen_len": gen_len, "compile": compile, "runs": runs, "torch": torch.__version__,
        "python": platform.python_version(), "params": sum(p.numel() for p in model.parameters()),
    }


def position_curve(model, steps, lengths: tuple[int, int], gen_len: int) -> tuple[list[int], list[float]]:
    """One more run, timed step by step (synchronized): (cache position of each decode step, its tok/s)."""
    prompt = prompts(model, 1, lengths, seed=0)
    prompt = prompt[0][None] if isinstance(prompt, list) else prompt
    positions, rates = [], []
    tokens = generate.generate_tokens(model, prompt, gen_len, steps=steps)
    next(tokens)
    sync(model.device)
    last = time.perf_counter()
    for i, _ in enumerate(tokens):
        sync(model.device)
        now = time.perf_counter()
        positions.append(prompt.shape[1] + i)
        rates.append(1 / (now - last))
        last = now
    return positions, rates


def save_plot(path: str, draw) -> None:
    """draw(axes) with matplotlib (the optional 'plot' extra: pip install -e '.[plot]') into a PNG at path, written
    to a temporary file and renamed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install -e '.[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    draw(ax)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)


def bar_chart(path: str, labels: list[str], series: dict[str, list[float | None]], title: str, ylabel: str) -> None:
    """Bars of each series side by side at each label (None: no bar)."""
    def draw(ax):
        width = 0.8 / len(series)
        for i, (name, values) in enumerate(series.items()):
            xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
            bars = ax.bar(xs, [v or 0 for v in values], width, label=name)
            ax.bar_label(bars, labels=[f"{v:.1f}" if v else "" for v in values], fontsize=7)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        if len(series) > 1:
            ax.legend(fontsize=8)

    save_plot(path, draw)


def check_plot_path(path: str | None) -> None:
    """Fail before measuring, not after: the folder must exist and the name end in .png."""
    if path is None:
        return
    if not path.lower().endswith(".png"):
        raise ValueError(f"--plot {path}: expected a .png file name")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"--plot {path}: no such folder")


def table(result: dict, title: str):
    from rich.table import Table

    def rng(key, fmt):
        lo, hi = result[f"{key}_range"]
        return f"{format(result[key], fmt)}  ({format(lo, fmt)} .. {format(hi, fmt)})" if lo is not None else "-"

    t = Table(title=title, show_header=False)
    rows = [
        ("decode", rng("decode_tok_s", ".1f") + " tok/s"),
        ("ms per decode step", f"{result['ms_per_step']:.2f}" if result["ms_per_step"] else "-"),
        ("prefill", rng("prefill_tok_s", ".0f") + " tok/s"),
        ("time to first token", f"{result['ttft_s'] * 1000:.1f} ms"),
        ("compile (this process)", f"{result['compile_s']:.1f} s"),
        ("startup (process start to ready)", f"{result['startup_s']:.1f} s"),
        ("cache / attended slots", f"{result['cache_len']} / {result['attended_len']}"),
        ("weights read per token", f"{result['bytes_per_token'] / 2**20:.1f} MiB"),
        ("achieved bandwidth", f"{result['bandwidth_gbs']:.1f} GB/s" if result["bandwidth_gbs"] else "-"),
        ("MBU", f"{result['mbu'] * 100:.1f}% of {result['peak_bw_gbs']} GB/s" if result["mbu"] else
         "unknown peak (--peak-bw GB/s)"),
        ("peak memory", f"{result['peak_mem_bytes'] / 2**20:.0f} MiB"),
        ("speculation", (f"{result['draft']}, k {result['speculate_k']}: drafts accepted "
                         f"{result['acceptance_rate']:.0%}, {result['tokens_per_target_step']:.2f} tokens per "
                         "target step") if result["draft"] else "none"),
        ("setup", (f"{result['dtype']}, quant {result['quant']} ({result.get('quant_reason', '')}), batch "
                   f"{result['batch_size']}, prompt {result['prompt_len']}, gen {result['gen_len']}, compile "
                   f"{result['compile']}, {result['runs']} runs")),
        ("device", f"{result['device']}, torch {result['torch']}"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def main(args, console, ckpt: str | None) -> int:
    """chat.py --bench: args are chat.py's parsed arguments; the same defaults as chat (quant auto, compile, the
    model's whole context as the cache)."""
    device = torch.device(args.device)
    prompt_ids = None
    with console.status("Loading..."):
        if args.shape:
            model = random_model(args.shape, device, args.dtype or load.default_dtype(device))
            quant, reason = (None, "random weights") if args.quant in ("auto", "none") else (args.quant, "--quant")
            if quant:
                model = quantized.quantize_model(model, quant)
            title, record = f"{args.shape} (random weights)", None
        else:
            model, record = flags.load_model(ckpt, args, console)
            quant, reason = record.quant, record.reason
            title = ckpt
            if args.prompt is not None:  # a real prompt (prompt lookup needs one): its ids, as one-shot would
                vocab = vocab_module.load_vocabulary(ckpt, args.tokenizer)
                mode = flags.prompt_mode(args, vocab, ckpt)
                prompt_ids = flags.prompt_ids(vocab, flags.prompt_text(args, mode), mode,
                                             args.system)
    draft = flags.make_draft(args, model, console, record)
    check_plot_path(args.plot)
    with console.status("Benchmarking...") as status:
        result = run_benchmark(model, batch=args.batch_size or 1, prompt_len=args.prompt_len, gen_len=args.gen_len,
                               compile=args.compile, runs=args.runs, peak_bw=args.peak_bw,
                               quant=quant or "none", kv_dtype=args.kv_dtype,
                               cache_len=args.max_seq_len, progress=lambda s: status.update(f"Benchmarking: {s}"),
                               prompt_ids=prompt_ids, draft=draft, speculate_k=args.speculate_k)
    result["model"], result["quant_reason"] = title, reason
    if tp.world()[1] > 1:  # tensor parallel: what each rank holds
        result["rank_weight_bytes"] = tp.gather(stored_bytes(model))
        result["rank_peak_mem_bytes"] = tp.gather(peak_memory(device))
    if args.plot:  # decode speed against the position in the cache, one synchronized step at a time
        lengths = args.prompt_len if isinstance(args.prompt_len, tuple) else (args.prompt_len, args.prompt_len)
        steps = steps_for(model) if args.compile else None
        with console.status("Timing each step for the plot..."):
            positions, rates = position_curve(model, steps, lengths, args.gen_len)

        def draw(ax):
            ax.plot(positions, rates, color="#4878a8", linewidth=1)
            ax.set_xlabel("position in the cache")
            ax.set_ylabel("decode tok/s (one row)")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{title}: {result['quant']} {result['dtype']}, cache {result['cache_len']}, "
                         f"{'compiled' if args.compile else 'eager'}, {result['device']}", fontsize=9)

        save_plot(args.plot, draw)
        result["plot_positions"], result["plot_tok_s"] = positions, rates
    if args.json:
        print(json.dumps(result))
    else:
        console.print(table(result, title))
    return 0


if __name__ == "__main__":
    sys.exit("run benchmarks through chat.py: python chat.py --bench ...")
