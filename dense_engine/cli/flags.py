"""flags.py: the flags chat.py and serve.py share, and what they load by them: the model (with one line saying which
weights and why), the speculative draft, the prompt's text and token ids, the Settings of a Session, and the notes
about this machine that change how a program answers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

from dense_engine.cpu import quantized
from dense_engine.formats import load, lora, preread
from dense_engine.formats.checkpoint import torch_dtype
from dense_engine.formats.vocab import Vocabulary
from dense_engine.runtime import caches, session, speculative, tp
from dense_engine.runtime.sampling import Defaults, SamplerSettings
from dense_engine.runtime.session import Settings
from dense_engine.system import machine
from dense_engine.system.errors import UsageError


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
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="default: bfloat16 on cuda, else float32")
    p.add_argument("--quant", choices=("auto", "none", "int8", "int4", "nf4", "llm.int8", "fp8", "gguf"),
                   default="auto",
                   help="weight quantization (a variant saved by quantize.py, else made at load time); auto: int4 "
                        "for weights from a Q4_0/Q4_1 GGUF (held exactly), a GGUF's own blocks for its other types "
                        "(gguf: Q4_K, Q5_K, Q6_K, Q8_0, ...), an FP8 folder's float8 weights on a GPU (float on "
                        "the CPU), else as stored; none: full precision")
    p.add_argument("--lora", action="append", metavar="[NAME=]PATH[:SCALE]",
                   help="a LoRA adapter (a PEFT folder, or llama.cpp's .gguf adapter file) times SCALE (default 1): "
                        "merged into full-precision weights, beside quantized ones; several allowed. serve.py: "
                        "NAME= serves it beside the weights, for the requests that name it (their model, or "
                        "llama-server's lora field)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compiled prefill and decode steps, saved in the cache folder for later runs (default: on)")
    p.add_argument("--kv-dtype", choices=load.KV_DTYPES, default="auto",
                   help="the KV cache's numbers: auto (the model's dtype: float32 on CPU unless --dtype says "
                        "otherwise), float32, float16, bfloat16, or int8 (a scale per token and head: a quarter of "
                        "float32's bytes)")
    p.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="KV cache length (default: the model's context; smaller is faster)")
    spec = p.add_argument_group("speculative decoding (the same output as without, in fewer target steps)")
    drafts = spec.add_mutually_exclusive_group()
    drafts.add_argument("--draft", metavar="CKPT", help="a small model with the same tokenizer drafts tokens; mtp: "
                        "the checkpoint's own multi-token prediction layers (Qwen3.5's)")
    drafts.add_argument("--draft-quant", choices=("int8", "int4", "nf4"),
                        help="a quantized copy of the model drafts (its saved variant, else made at load; "
                        "use with --quant none)")
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
        raise UsageError("--speculate-k must be at most 64 (a verify step checks k + 1 tokens), got "
                         f"{args.speculate_k}")
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
    args.dtype = torch_dtype(args.dtype)  # (None: load.default_dtype's)
    return args


def load_model(ckpt: str, args, console) -> tuple:
    """(the model, its LoadRecord) as the flags ask: what was loaded and why is the record's `weights`."""
    record, checkpoint = load.plan(ckpt, args.quant, args.device, args.dtype, args.kv_dtype, args.max_seq_len,
                                   args.compile, [lora.entry(spec) for spec in args.lora or ()])
    if getattr(args, "prompt", None) is None or getattr(args, "bench", False):
        # the blocks into huge pages, for a run that decodes long (a one-shot's stay in the file's pages)
        preread.start_for(record)
    try:
        with console.status(f"Loading {ckpt} ({str(record.dtype).removeprefix('torch.')}, {record.device})..."):
            model = session.load_model(record, checkpoint)
    finally:
        preread.discard()  # (an early read of a file the load converted instead)
    if caches.has_state(model) and getattr(args, "prompt_cache", None):  # (refused before it would answer wrongly)
        raise UsageError(f"{ckpt}: --prompt-cache is not available for a model with state layers (Gated DeltaNet, "
                         "short conv) yet")
    return model, record


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
    return text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")


def prompt_ids(vocab: Vocabulary, text: str, mode: str, system: str | None) -> list[int]:
    """The token ids generation starts from: the chat template around text, or text itself."""
    if mode == "chat":
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return vocab.encode(vocab.render(messages), special=False)
    return vocab.encode(text, special=True)


def make_draft(args, model, console, record: load.LoadRecord | None = None):
    """The speculative draft the flags ask for, or None. --draft-quant: the checkpoint's saved variant of that mode
    when it has one (record.path; read as stored, as a load of it would be), else the model quantized in memory."""
    if args.lookup:
        return speculative.LookupDraft(args.lookup_ngram)
    if args.draft_quant:
        if any(isinstance(m, quantized.QuantLinear) for m in model.modules()):
            raise UsageError("--draft-quant makes a quantized copy of a full-precision model: add --quant none")
        if record is not None and record.path and args.draft_quant in load.saved_variants(record.path):
            # (its record: a background process compiles the draft's steps by loading it the same way)
            draft_record = dataclasses.replace(record, quant=args.draft_quant, reason="the draft", kv_dtype="auto")
            with console.status(f"Loading the saved {args.draft_quant} variant as the draft..."):
                return speculative.ModelDraft(load.from_pretrained(record.path, device=model.device, dtype=model.dtype,
                                                                   quant=args.draft_quant), draft_record)
        with console.status(f"Making the {args.draft_quant} draft..."):
            return speculative.ModelDraft(speculative.quantized_copy(model, args.draft_quant))
    if args.draft == "mtp":
        if record is None or not record.path:
            raise UsageError("--draft mtp reads the checkpoint's multi-token prediction layers: give --ckpt")
        with console.status("Loading the multi-token prediction layers as the draft..."):
            return speculative.mtp_draft(model, load.read_with_adapters(record.path, record.lora), record.quant)
    if args.draft:
        if not os.path.exists(args.draft):
            raise UsageError(f"--draft {args.draft}: no such file or folder")
        with console.status(f"Loading the draft {args.draft}..."):
            draft = load.from_pretrained(args.draft, device=args.device, dtype=model.dtype, quant="auto")
        if draft.config.vocab_size != model.config.vocab_size:
            raise UsageError(f"--draft {args.draft}: its vocabulary ({draft.config.vocab_size}) is not the model's "
                             f"({model.config.vocab_size}); a draft must share the tokenizer")
        return speculative.ModelDraft(draft)
    return None


def settings(args, vocab, notes=None) -> Settings:
    """The Session settings the flags give, over the checkpoint's sampling defaults."""
    asked, sources = sampler(args, vocab, notes)
    return Settings(asked, max_new_tokens=args.max_new_tokens, speculate_k=args.speculate_k, sources=sources)


def sampler(args, vocab, notes=None) -> tuple[SamplerSettings, dict]:
    """What the flags ask of the sampler, over the checkpoint's defaults (sampling.Defaults: its recommendation, else
    llama.cpp's), and where each value came from."""
    defaults = Defaults.of_vocab(vocab, notes)
    return defaults.settings("flag", temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             min_p=args.min_p, typical_p=args.typical_p, repetition_penalty=args.repetition_penalty,
                             repeat_last_n=args.repeat_last_n, dry_multiplier=args.dry_multiplier or 0.0,
                             dry_base=args.dry_base, dry_allowed_length=args.dry_allowed_length,
                             dry_penalty_last_n=args.dry_penalty_last_n)
