"""session.py: what chat.py, benchmark.py and serve.py share: the model flags and loading the model as they say,
the prompt's token ids, the speculative draft, and Session: generation over a KV cache that outlives a reply.
(The checkpoint's vocabulary and chat template: vocab.py; the default model: default_model.py.)

Stands on load.py, generate.py, speculative.py, tp.py, background.py, vocab.py and default_model.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

import background
import convert
import generate
import kernels
import load
import machine
import quantized
import speculative
import terminal
import tp
from checkpoint import torch_dtype
from vocab import TextStream, UsageError, Vocabulary

SETTINGS = {"temperature": (float, lambda v: 0 <= v < float("inf"), "a number >= 0"),  # (NaN fails every comparison)
            "top-k": (int, lambda v: v >= 1, "a whole number >= 1"),
            "top-p": (float, lambda v: 0 < v <= 1, "in (0, 1]"),
            "max-new-tokens": (int, lambda v: v >= 1, "a whole number >= 1")}


# ----------------------------------------------------------------------------------------------------------------
# The machine, the flags and the model


def check_environment(args, console) -> None:
    """One note for each thing about this machine that changes how the program answers: no C++ compiler (PyTorch's
    kernels, no compiled steps), a cache folder that cannot be written (nothing saved)."""
    if machine.compiler() is None:
        console.print("[dim]note: no C++ compiler (c++, g++ or clang++ on PATH, or $CXX): answering without compiled "
                      "steps and, unless they were built before, with PyTorch's kernels: several times slower; "
                      "install one (e.g. `apt install g++`) for the fast path[/dim]")
        args.compile = False
    reason = machine.unwritable_cache()
    if reason is not None:
        console.print(f"[dim]note: the cache folder {machine.cache_dir()} cannot be written ({reason}): answering "
                      "without saving compiled steps, built kernels or history (make it writable, or set "
                      "XDG_CACHE_HOME)[/dim]")


# ----------------------------------------------------------------------------------------------------------------
# A conversation over one static KV cache


@dataclass
class ReplyStats:
    tokens: int = 0
    prefilled: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    compile_s: float | None = None
    interrupted: bool = False
    speculation: dict | None = None  # proposed, accepted, target_steps

    def line(self) -> str:
        decode_s = self.total_s - self.ttft_s
        rate = f"{(self.tokens - 1) / decode_s:.1f} tok/s" if self.tokens > 1 and decode_s > 0 else "- tok/s"
        text = (f"{self.tokens} tokens, {rate}, first token {self.ttft_s * 1000:.0f} ms, "
                f"prefilled {self.prefilled} tokens")
        spec = self.speculation
        if spec and spec.get("target_steps"):
            rate = spec["accepted"] / spec["proposed"] if spec["proposed"] else 0.0
            text += (f", drafts accepted {rate:.0%} ({(self.tokens - 1) / spec['target_steps']:.2f} tokens per "
                     "target step)")
        if self.compile_s:
            text += f", steps compiled in {self.compile_s:.1f} s"
        return text + (" (interrupted)" if self.interrupted else "")


def steps_for_program(model, batch: int, seq_len: int, status=None, note=None) -> generate.Steps:
    """The compiled steps of a program's model: a step not compiled yet on this machine is compiled by a background
    process while the program answers eagerly (background.py), where that can be done (a model loaded from a
    checkpoint, on the CPU, in one process); else compiled here, before answering. note(message): one line about
    background compiles."""
    compiler = None
    if (background.enabled() and getattr(model, "source", None) and model.device.type == "cpu" and tp.world()[1] == 1
            and machine.unwritable_cache() is None):
        compiler = background.Compiler(**model.source, batch=batch, seq_len=seq_len, status=note)
    return generate.Steps(model, status=status, background=compiler)


def fitting_cache(model, batch: int = 1) -> int:
    """The default cache: the model's whole context, or the largest power of two that fits in a quarter of the memory
    still available (with a note), for `batch` rows. (Its pages are committed only as positions are used.)"""
    context = model.config.max_position_embeddings
    dtype = kernels.cache_for(model)[1]
    budget = machine.available_memory(model.device) // 4
    if model.cache_bytes(batch, context, dtype) <= budget:
        return context
    length = 256
    while length * 2 < context and model.cache_bytes(batch, length * 2, dtype) <= budget:
        length *= 2
    rows = f" x {batch} rows" if batch > 1 else ""
    machine.note(f"the cache holds {length} tokens{rows}: the model's context of {context} would need "
                 f"{model.cache_bytes(batch, context, dtype) / 2**30:.1f} GiB (--max-seq-len sets it)")
    return length


class Session:
    """Generation over a cache that outlives a reply: `cached` lists the tokens whose keys/values sit in the cache
    at positions 0.. len(cached) - 1, so the next prompt prefills only what follows its common prefix with them."""

    def __init__(self, model, vocab: Vocabulary, args, status=None, draft=None, note=None) -> None:
        self.model, self.vocab, self.args, self.draft = model, vocab, args, draft
        self.max_seq_len = args.max_seq_len or fitting_cache(model)
        generate.setup_cache(model, 1, self.max_seq_len)
        self.steps = steps_for_program(model, 1, self.max_seq_len, status, note) if args.compile else None
        self.cached: list[int] = []
        self.prefilled = 0  # tokens prefilled by the replies, in all (/stats)
        self.compile_s: float | None = None
        self.last = ReplyStats()
        self.stop = None  # under torchrun: a function every rank calls after each token; True stops the reply
        self.constraint = None  # a function making each reply's grammar.Constraint (chat.py --json-schema)

    def warm_up(self) -> float:
        """Load (or compile: in the background the first time on this machine) the prefill and decode steps a first
        reply needs, and run the eager prefill once (its first call sets up the matmul libraries: 0.3 s), on
        throwaway tokens, so that the first reply is not slowed by it. Returns the seconds spent compiling here."""
        list(self.generate([0] * (generate.PREFILL_CHUNK + 1), 2, start_pos=0))
        list(self.generate([0], 3, start_pos=0))
        self.cached = []
        if self.draft is not None:
            self.draft.reset()
        compiled = self.steps.compile_s if self.steps is not None else 0.0
        return compiled + (self.draft_steps_compile_s() if self.draft is not None else 0.0)

    def draft_steps_compile_s(self) -> float:
        runner = getattr(self.draft, "runner", None)
        return runner.steps.compile_s if runner is not None and runner.steps is not None else 0.0

    def generate(self, new_ids: list[int], max_new: int, start_pos: int, context: list[int] | None = None,
                 stats: dict | None = None):
        args = self.args
        ids = torch.tensor([new_ids], device=self.model.device)
        vocab_limit = self.vocab.size if self.vocab.size < self.model.config.vocab_size else None
        settings = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, start_pos=start_pos,
                        vocab_limit=vocab_limit, steps=self.steps)
        if self.draft is None:
            constraint = self.constraint() if self.constraint is not None else None
            return generate.generate_tokens(self.model, ids, max_new, constraint=constraint, **settings)
        return speculative.generate_tokens(self.model, ids, max_new, self.draft, speculate_k=args.speculate_k,
                                           stats=stats, context=self.cached[:start_pos] if context is None else context,
                                           **settings)

    def room(self, prompt_len: int) -> int:
        return min(self.args.max_new_tokens, self.max_seq_len - prompt_len)

    def reply(self, prompt_ids: list[int], write) -> tuple[list[int], ReplyStats]:
        """Generate after prompt_ids, streaming text through write(str). Ctrl-C stops the reply, not the session."""
        common = 0
        while common < min(len(self.cached), len(prompt_ids) - 1) and self.cached[common] == prompt_ids[common]:
            common += 1  # at least one token is always prefilled: its logits give the first new token
        stats = ReplyStats(prefilled=len(prompt_ids) - common, compile_s=self.compile_s,
                           speculation={} if self.draft is not None else None)
        self.prefilled += stats.prefilled
        self.compile_s = None
        stream, generated, yielded = TextStream(self.vocab), [], 0
        start = time.perf_counter()
        try:
            tokens = self.generate(prompt_ids[common:], self.room(len(prompt_ids)), common, prompt_ids[:common],
                                   stats.speculation)
            for (token,) in generate.ahead(tokens):  # (on a GPU the next step is queued before this one is read)
                yielded += 1
                if yielded == 1:
                    stats.ttft_s = time.perf_counter() - start
                if token in self.vocab.stop_ids:
                    break
                generated.append(token)
                write(stream.push(token))
                if self.stop is not None and self.stop():
                    stats.interrupted = True
                    break
        except KeyboardInterrupt:
            stats.interrupted = True
        write(stream.finish())
        stats.total_s, stats.tokens = time.perf_counter() - start, yielded
        # every yielded token but the last was fed back, so the cache now holds these positions
        self.cached = (prompt_ids + generated)[: len(prompt_ids) + max(yielded - 1, 0)]
        self.last = stats
        return generated, stats


def ctrl_c_as_key(session: Session):
    """Under torchrun, which ends the whole job on the terminal's SIGINT: rank 0 reads Ctrl-C as a key
    (terminal.CtrlCAsKey) and every rank stops the reply at the same token. Returns what to restore() at the end."""
    rank, size = tp.world()
    keys = terminal.CtrlCAsKey(sys.stdin.fileno()) if terminal.CtrlCAsKey.wanted(rank, size) else None
    if size == 1 or not tp.broadcast(keys is not None):  # no terminal to watch: no broadcast after every token
        return None
    session.stop = lambda: tp.agree(keys is not None and keys.pressed(), session.model.device)
    if keys is not None:
        keys.start()
    return keys


def set_option(args, text: str) -> str:
    """/set NAME VALUE for the rest of the session: temperature, top-k, top-p (both: none to turn off),
    max-new-tokens."""
    name, _, value = text.partition(" ")
    name, value = name.strip().replace("_", "-"), value.strip()
    if name not in SETTINGS or not value:
        raise UsageError(f"expected /set NAME VALUE with NAME one of {', '.join(SETTINGS)}")
    if value.lower() == "none" and name in ("top-k", "top-p"):
        parsed = None
    else:
        try:
            parsed = SETTINGS[name][0](value)
        except ValueError:
            raise UsageError(f"{name} must be {'a number' if SETTINGS[name][0] is float else 'a whole number'}, "
                             f"got {value!r}") from None
        if not SETTINGS[name][1](parsed):
            raise UsageError(f"{name} {value} is out of range")
    setattr(args, name.replace("-", "_"), parsed)
    return f"{name} = {parsed}"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags that choose and load the model, shared by chat.py and serve.py."""
    p.add_argument("--ckpt", help="checkpoint folder or file (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--tokenizer", help="tokenizer.json (or its folder) when the checkpoint has none")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: bfloat16 on cuda, else float32")
    p.add_argument("--quant", choices=("auto", "none", "int8", "int4", "nf4", "llm.int8", "gguf"), default="auto",
                   help="weight quantization (a variant saved by quantize.py, else made at load time); auto: int4 "
                        "for weights from a Q4_0/Q4_1 GGUF (held exactly), a GGUF's own blocks for its other types "
                        "(gguf: Q4_K, Q5_K, Q6_K, Q8_0, ...), else as stored; none: full precision")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compiled prefill and decode steps, saved in the cache folder for later runs (default: on)")
    p.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="KV cache length (default: the model's context; smaller is faster)")
    spec = p.add_argument_group("speculative decoding (the same output as without, in fewer target steps)")
    drafts = spec.add_mutually_exclusive_group()
    drafts.add_argument("--draft", metavar="CKPT", help="a small model with the same tokenizer drafts tokens")
    drafts.add_argument("--draft-quant", choices=("int8", "int4", "nf4"),
                        help="a quantized copy of the model drafts (made in memory; use with --quant none)")
    drafts.add_argument("--lookup", action="store_true", help="drafts copied from earlier in the context "
                        "(prompt lookup: for edits, summaries, code)")
    spec.add_argument("--lookup-ngram", type=positive_int, default=3, help="longest n-gram prompt lookup matches")
    spec.add_argument("--speculate-k", type=positive_int, default=4, help="draft tokens checked per target step "
                      "(1..64)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def parse_flags(p: argparse.ArgumentParser, argv):
    """Parse, a bad flag being one line (UsageError), and check the device and dtype."""
    def one_line_error(message):
        raise UsageError(message)

    p.error = one_line_error
    args = p.parse_args(argv)
    if args.speculate_k > 64:
        raise UsageError(f"--speculate-k must be at most 64 (a verify step checks k + 1 tokens), got {args.speculate_k}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device}: not a device (cpu, cuda, cuda:N, mps)") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available.get(device.type, False):
        raise UsageError(f"--device {args.device}: {device.type} is not available on this machine")
    if device.type == "cuda" and tp.world()[1] > 1:  # under torchrun each rank takes its own GPU, whatever cuda:N says
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', tp.world()[0]))}"
        device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA devices")
    args.dtype = torch_dtype(args.dtype) or (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    return args


def load_model(ckpt: str, args, console):
    """The model as --quant asks, and one line saying what was loaded and why."""
    with console.status(f"Loading {ckpt} ({str(args.dtype).removeprefix('torch.')}, {args.device})..."):
        checkpoint = convert.read_checkpoint(ckpt)
        if args.quant == "auto":
            quant, reason = load.auto_mode(checkpoint, args.device)
        else:
            quant, reason = (None if args.quant == "none" else args.quant), f"--quant {args.quant}"
        loader = tp.from_pretrained if tp.world()[1] > 1 else load.from_pretrained
        model = loader(ckpt, device=args.device, dtype=args.dtype, quant=quant or "none")
    return model, f"weights: {quant or 'full precision'} ({reason})"


def prompt_mode(args, vocab: Vocabulary, ckpt: str) -> str:
    """"chat" or "complete": as --chat/--complete say, else chat when the checkpoint has a chat template."""
    mode = args.mode or ("chat" if vocab.chat_template else "complete")
    if mode == "chat" and not vocab.chat_template:
        raise UsageError(f"{ckpt}: --chat needs a chat template (tokenizer_config.json has none)")
    return mode


def prompt_text(args, mode: str) -> str:
    """--prompt's text ('-': stdin, read by rank 0 under torchrun and sent to the others). Read from stdin, a chat
    message loses its trailing line breaks (a message is what was typed, not the newline `echo` adds) and a text to
    complete loses one (echo's; a text that should end in a line break ends in two); a --prompt argument is taken as
    it is."""
    text = tp.broadcast(sys.stdin.read() if args.prompt == "-" and tp.world()[0] == 0 else args.prompt)
    if args.prompt != "-":
        return text
    if mode == "chat":
        return text.rstrip("\r\n")
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


def prompt_ids(vocab: Vocabulary, text: str, mode: str, system: str | None) -> list[int]:
    """The token ids generation starts from: the chat template around text, or text itself."""
    if mode == "chat":
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return vocab.encode(vocab.render(messages), special=False)
    return vocab.encode(text, special=True)


def make_draft(args, model, console):
    """The speculative draft the flags ask for, or None."""
    if args.lookup:
        return speculative.LookupDraft(args.lookup_ngram)
    if args.draft_quant:
        if any(isinstance(m, quantized.QuantLinear) for m in model.modules()):
            raise UsageError("--draft-quant makes a quantized copy of a full-precision model: add --quant none")
        with console.status(f"Making the {args.draft_quant} draft..."):
            return speculative.ModelDraft(speculative.quantized_copy(model, args.draft_quant))
    if args.draft:
        if not os.path.exists(args.draft):
            raise UsageError(f"--draft {args.draft}: no such file or folder")
        with console.status(f"Loading the draft {args.draft}..."):
            draft = load.from_pretrained(args.draft, device=args.device, dtype=args.dtype, quant="auto")
        if draft.config.vocab_size != model.config.vocab_size:
            raise UsageError(f"--draft {args.draft}: its vocabulary ({draft.config.vocab_size}) is not the model's "
                             f"({model.config.vocab_size}); a draft must share the tokenizer")
        return speculative.ModelDraft(draft)
    return None
