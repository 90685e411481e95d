"""generate.py: generation over dense.py's static KV cache: a prefill, then one fixed-shape decode step per token.

    import dense, generate
    model = dense.DenseDecoder.from_pretrained("path/to/ckpt")
    out = generate.generate(model, input_ids, 64, temperature=0.0, eos_id=None, compile=True)     # [B, T + 64]
    rows = generate.generate(model, [[1, 2, 3], [4, 5]], 64, eos_id=2)                            # ragged: a list

What makes it fast, in order:
  * Decode cost follows the conversation, not the cache size. A compiled step has fixed shapes, so SDPA in it
    attends over a fixed number of cache slots: instead of the whole cache (the model's context, 8192 for SmolLM2)
    it attends over the smallest bucket that holds the positions in use, 256, 512, 1024, ... up to the cache
    length, one graph per bucket, compiled when first reached (CUDA graphs replay one per bucket). On CPU the cache
    is kernels.KVCache, whose attention reads only the slots in use: one graph serves every position.
  * Saved steps. Each graph is compiled ahead of time (torch.compile(...).aot_compile) and saved under
    $XDG_CACHE_HOME/dense-engine/compiled/ (or ~/.cache/...), keyed by everything that shapes it (torch version,
    this engine's code, the model config, dtype, quantized layouts, device, cache size, batch, bucket and sampling
    settings). The next process loads it in well under a second instead of tracing and compiling again. Steps are
    compiled without Dynamo's guards: the key already pins what they would check, so no token pays for evaluating
    them and no load pays for rebuilding them. A damaged or foreign file is rebuilt, with a notice.
  * A short prefill (a chat turn) is one compiled step too, padded to a fixed size (padding writes to the cache's
    scratch slot); a long prompt is one eager pass, whose large matmuls are its whole cost.
Ragged batches: prompts are left-padded to a common length; row_start tells each row where its tokens begin, so its
positions start at 0 and padding is never attended to. Speculative decoding lives in speculative.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

import dense
import kernels

MIN_BUCKET = 256
PREFILL_CHUNK = 16  # prompts up to this long prefill in one compiled step (padded); longer ones in one eager pass
SOURCES = ("dense.py", "quantize.py", "kernels.py", "kernels.cpp", "generate.py")  # code that shapes a graph


def buckets(cache_len: int) -> list[int]:
    """Attention widths a cache of cache_len slots is compiled for: powers of two from 256, and cache_len itself."""
    out, b = [], MIN_BUCKET
    while b < cache_len:
        out.append(b)
        b *= 2
    return out + [cache_len]


def bucket_for(length: int, cache_len: int) -> int:
    """The smallest bucket holding `length` slots."""
    return next(b for b in buckets(cache_len) if b >= length)


def setup_cache(model: dense.DenseDecoder, batch: int, seq_len: int) -> None:
    """model.setup_cache with the cache this device runs fastest: on CPU (float32), kernels.py's."""
    cache_class, dtype = kernels.cache_for(model)
    model.setup_cache(batch, seq_len, dtype, cache_class=cache_class)


def attend_width(model: dense.DenseDecoder, length: int) -> int:
    """How many slots a compiled step over `length` slots in use attends: the bucket, or the whole cache when the
    cache's attention reads only the slots in use anyway (kernels.KVCache: one graph serves every position)."""
    if isinstance(model.layers[0].attn.kv_cache, kernels.KVCache):
        return model.max_seq_len
    return bucket_for(length, model.max_seq_len)


def cache_length(needed: int, context: int) -> int:
    """Cache sizes come in powers of two (>= 256) so prompts of different lengths reuse one compiled step."""
    return min(context, max(MIN_BUCKET, 1 << (needed - 1).bit_length()))


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    vocab_limit: int | None = None


# ----------------------------------------------------------------------------------------------------------------
# The step functions (traced whole by torch.compile; every Python number in them is a constant of the graph)


def decode_step(model, token, input_pos, row_start, attend: int, sampling: Sampling):
    """token [B, 1] at slot input_pos [1] -> the next token [B, 1]."""
    logits = model(token, input_pos, attend=attend, row_start=row_start)[:, -1]
    return dense.sample(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.vocab_limit)


def prefill_step(model, tokens, input_pos, row_start, attend: int, last):
    """tokens [B, T] at slots input_pos [T] -> hidden state [B, C] of the token at index `last` [1] (the head is
    applied to one position only, by the caller)."""
    hidden = model.hidden_states(tokens, input_pos, attend, row_start)
    return hidden.index_select(1, last)[:, 0]


def logits_step(model, tokens, input_pos, row_start, attend: int):
    """tokens [B, T] at slots input_pos [T] -> float32 logits [B, T, V] (speculative decoding's verify step)."""
    return model(tokens, input_pos, attend=attend, row_start=row_start)


# ----------------------------------------------------------------------------------------------------------------
# Compiled steps, saved across processes


def code_version() -> str:
    digest = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in SOURCES:
        if os.path.isfile(os.path.join(here, name)):
            with open(os.path.join(here, name), "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def model_signature(model: dense.DenseDecoder) -> dict:
    """What a compiled step depends on besides its arguments: the config and every tensor's shape and dtype."""
    tensors = {name: [list(t.shape), str(t.dtype)] for name, t in model.named_buffers()}
    tensors.update({name: [list(t.shape), str(t.dtype)] for name, t in model.named_parameters()})
    layers = {name: type(m).__name__ for name, m in model.named_modules() if not list(m.children())}
    return {"config": model.config.to_dict(), "tensors": tensors, "layers": layers, "device": model.device.type,
            "kernels": kernels.available() if model.device.type == "cpu" else None}


class Steps:
    """The compiled steps of one model, by (kind, batch, tokens, bucket, options): loaded from the cache folder or
    compiled there on first use. status(message) is called before a compile that will take a while."""

    def __init__(self, model: dense.DenseDecoder, status: Callable[[str], None] | None = None,
                 folder: str | None = None) -> None:
        self.model, self.status = model, status
        self.folder = folder or os.path.join(kernels.cache_dir(), "compiled")
        self.functions: dict[str, Callable] = {}
        self.base = None  # the part of the key shared by every step of this model and cache
        self.compile_s = 0.0  # seconds spent compiling (not loading) in this process
        self.loaded = self.compiled = 0

    def key(self, kind: str, **shape) -> str:
        if self.base is None or self.base[0] != (self.model.max_batch_size, self.model.max_seq_len):
            signature = {"torch": torch.__version__, "python": sys.version.split()[0], "code": code_version(),
                         "model": model_signature(self.model)}
            digest = hashlib.sha256(json.dumps(signature, sort_keys=True, default=str).encode()).hexdigest()
            self.base = ((self.model.max_batch_size, self.model.max_seq_len), digest[:24])
        detail = json.dumps(shape, sort_keys=True, default=str)
        return f"{kind}-{self.base[1]}-{hashlib.sha256(detail.encode()).hexdigest()[:16]}"

    def get(self, kind: str, fn: Callable, args: tuple, **shape) -> Callable:
        key = self.key(kind, **shape)
        compiled = self.functions.get(key)
        if compiled is None:
            compiled = self.functions[key] = self.load_or_compile(key, kind, fn, args)
        return compiled

    def load_or_compile(self, key: str, kind: str, fn: Callable, args: tuple) -> Callable:
        if self.model.device.type == "cuda":  # CUDA graphs: one replay per step, compiled in process
            return torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead")
        if torch.distributed.is_available() and torch.distributed.is_initialized():  # tensor parallel: the graph
            return torch.compile(fn, fullgraph=True, dynamic=False)  # holds collectives of this process group
        path = os.path.join(self.folder, key + ".bin")
        if os.path.isfile(path):
            try:
                with open(path, "rb") as f:
                    loaded = torch.compiler.load_compiled_function(f)
                self.loaded += 1
                return loaded
            except Exception as e:  # a damaged file, another torch or python: compile it again
                notice(f"ignoring the saved compiled step {path} ({dense_reason(e)}); compiling it again")
                self.discard(path)
        return self.compile_now(path, kind, fn, args)

    def compile_now(self, path: str, kind: str, fn: Callable, args: tuple) -> Callable:
        estimate = self.estimate(kind)
        if self.status:
            self.status(f"Compiling the {kind} step for {self.model.max_seq_len}-slot cache (once per machine; about "
                        f"{estimate:.0f} s)...")
        start = time.perf_counter()
        # No guards: the key pins what they would check (every tensor's shape and dtype, the code, the versions), and
        # rebuilding thousands of them is most of the time it takes to load a step. No size or alignment asserts
        # either, for the same reason: one Python-to-C++ call each per tensor per token (0.3-0.6 ms of a 20 ms float32
        # SmolLM2 token). (Inductor's C++ wrapper decoded int8 SmolLM2 1.09x faster but compiled 3x slower, 77
        # against 25 s: a first run would wait a minute more.)
        options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe, "size_asserts": False,
                   "alignment_asserts": False}
        compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=options).aot_compile((args, {}))
        took = time.perf_counter() - start
        self.compile_s += took
        self.compiled += 1
        try:
            os.makedirs(self.folder, exist_ok=True)
            compiled.save_compiled_function(path)  # written to a temporary file and renamed: concurrent runs are safe
            self.record(kind, took)
        except Exception as e:  # a full disk or a read-only cache: the step still works in this process
            notice(f"could not save the compiled step to {path} ({dense_reason(e)})")
            return compiled
        try:  # run the step as saved, as later processes load it: the object compile returns decodes ~12% slower
            with open(path, "rb") as f:  # (measured: 38-39 against 43-44 tok/s, float32 SmolLM2)
                return torch.compiler.load_compiled_function(f)
        except Exception:
            return compiled

    def discard(self, path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    def estimate(self, kind: str) -> float:
        try:
            with open(os.path.join(self.folder, "timings.json")) as f:
                return float(json.load(f)[kind])
        except (OSError, ValueError, KeyError, TypeError):
            return 40.0 if kind == "decode" else 60.0

    def record(self, kind: str, seconds: float) -> None:
        import convert

        path = os.path.join(self.folder, "timings.json")
        try:
            with open(path) as f:
                timings = json.load(f)
            timings = timings if isinstance(timings, dict) else {}
        except (OSError, ValueError):
            timings = {}
        timings[kind] = round(seconds, 1)
        convert.atomic_write(path, lambda p: open(p, "w").write(json.dumps(timings)))


def notice(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def dense_reason(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


_steps: dict[int, Steps] = {}


def steps_for(model: dense.DenseDecoder) -> Steps:
    """The Steps of a model (one per model object, so compiled steps are shared by every generate call)."""
    steps = _steps.get(id(model))
    if steps is None or steps.model is not model:
        steps = _steps[id(model)] = Steps(model)
    return steps


# ----------------------------------------------------------------------------------------------------------------
# Prefill and decode


class Runner:
    """Feeds one model: eager calls, or the compiled steps of `steps` (None: eager)."""

    def __init__(self, model: dense.DenseDecoder, steps: Steps | None) -> None:
        self.model, self.steps = model, steps

    @torch.no_grad()  # (compiled steps are inference graphs: the cache key assumes no autograd)
    def prefill(self, tokens: torch.Tensor, start: int, row_start: torch.Tensor | None) -> torch.Tensor:
        """Write tokens [B, T] at slots start.., return the float32 logits of the last one, [B, V]. Up to
        PREFILL_CHUNK tokens (a chat turn, a short prompt) run one compiled step, padded; a longer prompt runs one
        eager pass: its large matmuls are the whole cost and run best in one piece (measured: BENCHMARKS.md)."""
        model, device = self.model, tokens.device
        B, T = tokens.shape
        model.tokens_prefilled += T
        if self.steps is None or T > PREFILL_CHUNK:
            hidden = model.hidden_states(tokens, torch.arange(start, start + T, device=device), row_start=row_start)
            return model.lm_head(hidden[:, -1]).float()
        slots = torch.arange(start, start + PREFILL_CHUNK, device=device)
        slots[T:] = model.max_seq_len  # padding goes to the scratch slot
        chunk = torch.nn.functional.pad(tokens, (0, PREFILL_CHUNK - T))
        attend = attend_width(model, start + T)
        args = (model, chunk, slots, row_start, attend, torch.tensor([T - 1], device=device))
        fn = self.steps.get("prefill", prefill_step, args, batch=B, tokens=PREFILL_CHUNK, attend=attend,
                            ragged=row_start is not None)
        return model.lm_head(fn(*args)).float()

    @torch.no_grad()
    def decode(self, token: torch.Tensor, pos: int, row_start, sampling: Sampling) -> torch.Tensor:
        """token [B, 1] at slot pos -> next token [B, 1]."""
        model = self.model
        input_pos = torch.tensor([pos], device=token.device)
        if self.steps is None:
            return decode_step(model, token, input_pos, row_start, None, sampling)
        attend = attend_width(model, pos + 1)
        args = (model, token, input_pos, row_start, attend, sampling)
        fn = self.steps.get("decode", decode_step, args, batch=token.shape[0], attend=attend, sampling=sampling,
                            ragged=row_start is not None)
        return fn(*args).clone()  # a CUDA graph reuses its output buffer

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, pos: int, row_start=None) -> torch.Tensor:
        """Logits [B, T, V] of tokens [B, T] at slots pos.. (the verify step of speculative decoding)."""
        model, T = self.model, tokens.shape[1]
        input_pos = torch.arange(pos, pos + T, device=tokens.device).clamp(max=model.max_seq_len)
        if self.steps is None:
            return logits_step(model, tokens, input_pos, row_start, None if row_start is None else pos + T)
        attend = attend_width(model, min(pos + T, model.max_seq_len))
        args = (model, tokens, input_pos, row_start, attend)
        fn = self.steps.get("verify", logits_step, args, batch=tokens.shape[0], tokens=T, attend=attend,
                            ragged=row_start is not None)
        return fn(*args)


def as_batch(prompts, device) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """A [B, T] tensor as is, or a list of prompts (lists or 1-D tensors of ids) left-padded with id 0 ->
    (ids [B, T], row_start [B] or None when no row is padded, lengths)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got {list(prompts.shape)}")
        return prompts, None, [prompts.shape[1]] * prompts.shape[0]
    rows = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
    if not rows or any(r.numel() == 0 for r in rows):
        raise ValueError("every prompt needs at least one token")
    lengths = [r.numel() for r in rows]
    T = max(lengths)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - r.numel():] = r
    start = torch.tensor([T - n for n in lengths], device=device)
    return ids.to(device), (start if int(start.max()) > 0 else None), lengths


@torch.no_grad()
def generate_tokens(model: dense.DenseDecoder, prompts, max_new_tokens: int, *, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, compile: bool = False, start_pos: int = 0,
                    vocab_limit: int | None = None, steps: Steps | None = None, draft=None,
                    speculate_k: int = 4, stats: dict | None = None,
                    context: list[int] | None = None) -> Iterator[torch.Tensor]:
    """Yield max_new_tokens new tokens [B, 1], one per step. prompts: [B, T] ids, or a list of prompts of any
    lengths (left-padded; every row's positions start at 0). The prompt is prefilled at slots start_pos..; slots
    before start_pos must already hold this conversation (a chat continuing it). The last token yielded has not been
    fed to the model yet. compile=True (or steps) runs compiled, bucketed steps; draft (speculative.py) proposes
    tokens that the model checks speculate_k at a time (stats gets proposed / accepted / target_steps; context: the
    tokens already cached at 0..start_pos - 1, which a draft model needs to follow a conversation)."""
    device = model.device
    ids, row_start, _ = as_batch(prompts, device)
    B, T = ids.shape
    needed = start_pos + T + max_new_tokens - 1
    if needed > model.config.max_position_embeddings:
        raise ValueError(f"{start_pos + T} tokens + {max_new_tokens} new exceed the context of "
                         f"{model.config.max_position_embeddings}")
    if model.max_seq_len < needed or model.max_batch_size < B:
        if start_pos:
            raise ValueError(f"the cache ({model.max_seq_len} tokens) is too small to continue to {needed} tokens")
        setup_cache(model, max(B, model.max_batch_size), cache_length(needed, model.config.max_position_embeddings))
    if row_start is not None and start_pos:
        raise ValueError("a ragged batch starts a new cache (start_pos must be 0)")
    runner = Runner(model, steps or (steps_for(model) if compile else None))
    sampling = Sampling(temperature, top_k, top_p, vocab_limit)
    if draft is not None:
        import speculative

        yield from speculative.generate(runner, draft, ids, start_pos, max_new_tokens, sampling, speculate_k, stats,
                                        context)
        return
    logits = runner.prefill(ids, start_pos, row_start)
    token = dense.sample(logits, temperature, top_k, top_p, vocab_limit)
    yield token
    for i in range(max_new_tokens - 1):
        token = runner.decode(token, start_pos + T + i, row_start, sampling)
        yield token


@torch.no_grad()
def generate(model: dense.DenseDecoder, prompts, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | Sequence[int] | None = None,
             compile: bool = False, vocab_limit: int | None = None, draft=None, speculate_k: int = 4,
             stats: dict | None = None):
    """[B, T] prompt -> [B, T + new] ids; rows that produced an eos id are padded with it, and generation stops once
    every row has. A list of prompts -> a list of 1-D tensors of each row's new ids, up to and including its eos."""
    ids, _, _ = as_batch(prompts, model.device)
    eos = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id or []), device=model.device)
    done = torch.zeros(ids.shape[0], 1, dtype=torch.bool, device=model.device)
    new = []
    for token in generate_tokens(model, prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 compile=compile, vocab_limit=vocab_limit, draft=draft, speculate_k=speculate_k,
                                 stats=stats):
        if len(eos):
            if new:
                token = torch.where(done, new[-1], token)  # a finished row repeats its eos
            done = done | torch.isin(token, eos)
        new.append(token)
        if len(eos) and bool(done.all()):
            break
    out = torch.cat(new, dim=1) if new else ids[:, :0]
    if isinstance(prompts, torch.Tensor):
        return torch.cat([ids, out], dim=1)
    rows = []
    for row in out:
        hits = torch.isin(row, eos).nonzero() if len(eos) else []
        rows.append(row[: int(hits[0]) + 1] if len(hits) else row)
    return rows
