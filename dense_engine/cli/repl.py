"""repl.py: chat.py's interactive mode: read a message, stream the reply, keep the conversation; slash commands
(/retry, /undo, /save, /load, /set, ...). Stands on session.py (the Session and its vocabulary), the /set options beside
it, and terminal.py (line editing, Markdown rendering).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field

import torch

import layer_kinds
from dense_engine.cli import terminal
from dense_engine.formats import convert
from dense_engine.formats.checkpoint import write_text
from dense_engine.formats.vocab import Vocabulary
from dense_engine.runtime import caches, reasoning, tp
from dense_engine.runtime.sampling import DECLARED, describe, normal
from dense_engine.runtime.session import Session
from dense_engine.system import machine
from dense_engine.system.errors import UsageError

HELP = """/help          this text               /exit          quit (or Ctrl-D); Ctrl-C stops a reply
/retry         a new reply to the last message (its prompt is already in the cache)
/undo          drop the last exchange  /reset         new conversation
/system TEXT   set the system message (starts a new conversation)
/save FILE     the conversation as JSON (messages, system message, model, sampling settings), its cache beside
/load FILE     continue a saved conversation (from its cache, when this model saved it: nothing prefilled again)
/set NAME VAL  temperature, top-k, top-p, min-p, typical-p, repetition-penalty (none: off), repeat-last-n,
               dry-multiplier, dry-base, dry-allowed-length, dry-penalty-last-n, max-new-tokens; /set alone: them all
/model         what is loaded          /stats         cache and speed of the last reply
/think on|off  a thinking model thinks first, or answers at once (its template's enable_thinking)
Up/down recall earlier messages. A pasted block is one message; end a line with \\ to type another."""

# The sampling settings: (type, valid value, what is expected). parse_args checks the flags with them, /set the
# values typed in a session, /save and /load keep them.
SETTINGS = {"temperature": (float, lambda v: 0 <= v < float("inf"), "a number >= 0"),  # (NaN fails every comparison)
            "top-k": (int, lambda v: v >= 0, "a whole number >= 0 (0: off)"),
            "top-p": (float, lambda v: 0 < v <= 1, "in (0, 1] (1: off)"),
            "min-p": (float, lambda v: 0 <= v <= 1, "in [0, 1] (0: off)"),
            "typical-p": (float, lambda v: 0 < v <= 1, "in (0, 1] (1: off)"),
            "repetition-penalty": (float, lambda v: 0 < v <= 10, "in (0, 10] (1: off)"),
            "repeat-last-n": (int, lambda v: v >= -1, "a whole number >= -1 (-1: the whole context)"),
            "dry-multiplier": (float, lambda v: 0 <= v <= 100, "in [0, 100] (0: off)"),
            "dry-base": (float, lambda v: 1 <= v <= 10, "in [1, 10]"),
            "dry-allowed-length": (int, lambda v: v >= 1, "a whole number >= 1"),
            "dry-penalty-last-n": (int, lambda v: v >= -1, "a whole number >= -1 (-1: the whole context)"),
            "max-new-tokens": (int, lambda v: v >= 1, "a whole number >= 1")}

OFF = {"top-k": None, "top-p": None, "min-p": None, "typical-p": None, "repetition-penalty": 1.0,
       "dry-multiplier": 0.0}  # /set NAME none
EOF = "\x04"  # what interactive mode's reader gives for Ctrl-D (sent to the other ranks too)


def set_option(settings, text: str) -> str:
    """/set NAME VALUE for the rest of the session: a name of SETTINGS (the filters and the penalty: none turns
    them off). /set alone: the sampling settings and where each came from."""
    if not text.strip():
        return f"sampling: {describe(settings.sampler, settings.sources)}; max-new-tokens {settings.max_new_tokens}"
    name, _, value = text.partition(" ")
    name, value = name.strip().replace("_", "-"), value.strip()
    if name not in SETTINGS or not value:
        raise UsageError(f"expected /set NAME VALUE with NAME one of {', '.join(SETTINGS)}")
    if value.lower() == "none" and name in OFF:
        parsed = OFF[name]
    else:
        try:
            parsed = SETTINGS[name][0](value)
        except ValueError:
            raise UsageError(f"{name} must be {'a number' if SETTINGS[name][0] is float else 'a whole number'}, "
                             f"got {value!r}") from None
        if not SETTINGS[name][1](parsed):
            raise UsageError(f"{name} {value} is out of range")
    key = name.replace("-", "_")
    if key in DECLARED:
        parsed = normal(key, parsed) if parsed is not None else None  # (a neutral value: off)
    if hasattr(settings.sampler, key):  # (the sampler's record is frozen: a new one with the new value)
        settings.sampler = dataclasses.replace(settings.sampler, **{key: parsed})
        settings.sources = {**settings.sources, key: "/set"}
    else:
        setattr(settings, key, parsed)
    return f"{name} = {parsed}"


def option(settings, name: str):
    """The value of a name of SETTINGS (/save)."""
    key = name.replace("-", "_")
    return getattr(settings.sampler if hasattr(settings.sampler, key) else settings, key)


def ctrl_c_as_key(session: Session):
    """How Ctrl-C stops a reply at a token; returns what to line() before each prompt and restore() at the end. Under
    torchrun, which ends the whole job on the terminal's SIGINT, rank 0 reads Ctrl-C as a key (terminal.CtrlCAsKey)
    and every rank stops at the same token; in one process, the signal as Python raises it, remembered too
    (terminal.CtrlCRemembered)."""
    rank, size = tp.world()
    if size == 1:
        keys = terminal.CtrlCRemembered()
        session.stop = keys.pressed
        keys.start()
        return keys
    keys = terminal.CtrlCAsKey(sys.stdin.fileno()) if terminal.CtrlCAsKey.wanted(rank, size) else None
    if not tp.broadcast(keys is not None):  # no terminal to watch: no broadcast after every token
        return None
    session.stop = lambda: tp.agree(keys is not None and keys.pressed(), session.model.device)
    if keys is not None:
        keys.start()
    return keys


@dataclass
class Conversation:
    """What interactive mode keeps between turns: the messages (chat) or the last line (completion)."""
    mode: str
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    last_line: str | None = None
    options: dict = field(default_factory=dict)  # the chat template's variables (/think: enable_thinking)


def interactive(session: Session, vocab: Vocabulary, args, mode: str, console, ckpt: str, why: str, notes) -> int:
    talk = Conversation(mode, args.system)
    markdown = console.is_terminal and not console.is_dumb_terminal and not args.plain
    rank = tp.world()[0]
    reader = terminal.LineReader(os.path.join(machine.cache_dir(), "history") if rank == 0 else None,
                                 sys.stdin.isatty())
    if session.steps is not None:  # a later compile (a /set that changes sampling) says so
        session.steps.status = notes
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
                if command(session, vocab, talk, line, console, ckpt, why, markdown, notes) == "exit":
                    return 0
                continue
            try:
                turn(session, vocab, talk, line, console, markdown, notes)
            except KeyboardInterrupt:  # Ctrl-C before the reply started: back to the prompt
                console.print("[dim](interrupted)[/dim]")
    finally:
        reader.save()
        if keys is not None:
            keys.restore()


def command(session: Session, vocab: Vocabulary, talk: Conversation, line: str, console, ckpt: str, why: str,
            markdown: bool, notes) -> str | None:
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
            console.print(f"[dim]last reply: {session.last.line()}, {session.last.reused} from the cache\ncache: "
                          f"{len(session.cached)} of {session.max_seq_len} positions in use; {session.prefilled} "
                          f"tokens prefilled in all, {session.reused} from the cache[/dim]", soft_wrap=True)
        elif name == "/retry":
            if talk.mode == "chat" and talk.messages and talk.messages[-1]["role"] == "assistant":
                talk.messages = talk.messages[:-1]
                turn(session, vocab, talk, None, console, markdown, notes)
            elif talk.mode == "complete" and talk.last_line is not None:
                turn(session, vocab, talk, talk.last_line, console, markdown, notes)
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
            kept = ""
            if tp.world()[0] == 0:
                save_conversation(rest, talk, session.settings, ckpt)
                kept = save_cache_beside(session, rest)
            console.print(f"[dim]saved {len(talk.messages)} messages to {rest}{kept}[/dim]")
        elif name == "/load":
            note = load_conversation(rest, talk, session.settings, ckpt)
            note += load_cache_beside(session, rest)
            console.print(f"[dim]loaded {len(talk.messages)} messages from {rest}{note}[/dim]")
        elif name == "/set":
            console.print(f"[dim]{set_option(session.settings, rest)}[/dim]")
        elif name == "/model":
            console.print(describe_model(session, ckpt, why), markup=False)
        elif name == "/think":
            if rest not in ("on", "off"):
                raise UsageError("expected on or off")
            if not reasoning.thinks(vocab.chat_template):
                raise UsageError("this model's chat template has no thinking to switch")
            talk.options["enable_thinking"] = rest == "on"
            console.print(f"[dim]thinking {rest} (the template's enable_thinking)[/dim]")
        else:
            console.print(f"[red]unknown command {name}[/red] (/help lists them)")
    except UsageError as e:
        console.print(f"[red]{name}: {e}[/red]", markup=True, highlight=False)
    return None


def turn(session: Session, vocab: Vocabulary, talk: Conversation, line: str | None, console, markdown: bool,
         notes) -> None:
    """One exchange: prompt -> streamed reply -> stats line. line None: reply again to the conversation as it is
    (/retry: its prompt is all in the cache, so only its last token is fed again)."""
    if talk.mode == "chat":
        messages = talk.messages + ([{"role": "user", "content": line}] if line is not None else [])
        ids, dropped = fit_conversation(session, vocab, talk.system, messages, talk.options)
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
    pair = reasoning.markers(vocab.chat_template) if talk.mode == "chat" else None
    thinking = reasoning.opened(vocab.decode(ids), pair) if pair is not None else None
    view = terminal.ReplyView(console, markdown, thinking, pair or reasoning.THINK)
    with notes.held():  # (after the reply and its status line)
        try:
            reply, stats = session.reply(ids, view.write)
        except BaseException:
            view.finish("(stopped)")
            raise
        view.finish(stats.line())
    if talk.mode == "chat":  # (the answer: templates drop an earlier turn's thinking)
        answer = vocab.decode(reply) if thinking is None else reasoning.split(vocab.decode(reply), thinking, pair)[1]
        talk.messages = talk.messages + [{"role": "assistant", "content": answer}]


CONVERSATION_FORMAT = "dense-engine conversation"


def save_conversation(path: str, talk: Conversation, settings, ckpt: str) -> None:
    """The conversation as JSON, written to a temporary file and renamed; an existing file is replaced only when it is
    a saved conversation itself."""
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
              "sampling": {key: option(settings, key) for key in SETTINGS}}
    try:
        text = json.dumps(record, indent=1, ensure_ascii=False)
        convert.atomic_write(path, lambda p: write_text(p, text, encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror or e}") from None


def load_conversation(path: str, talk: Conversation, settings, ckpt: str) -> str:
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
                set_option(settings, f"{key} {'none' if value is None else value}")
            except UsageError:
                pass
    other = record.get("model")
    return f" (saved with {other})" if isinstance(other, str) and other != os.path.abspath(ckpt) else ""


def save_cache_beside(session: Session, path: str) -> str:
    """/save's second file, PATH.cache: the conversation's tokens in the cache and their keys and values (/load
    continues without prefilling them again); a note for the user. Not under tensor parallel (each rank holds a
    part of every key)."""
    cache = os.path.expanduser(path) + ".cache"
    if tp.world()[1] > 1 or not session.cached:
        return ""
    if caches.has_state(session.model):
        return " (its cache not saved: a model with state layers keeps no cache files yet)"
    if os.path.exists(cache) and not caches.is_cache_file(cache):
        return f" (its cache not saved: {cache} exists and is not a conversation's cache)"
    try:
        return f" and its cache ({session.save_cache(cache)} tokens) to {cache}"
    except OSError as e:
        return f" (its cache not saved: {cache}: {e.strerror or e})"


def load_cache_beside(session: Session, path: str) -> str:
    """/load's second file, PATH.cache, when there is one: into the session's cache when this model saved it."""
    cache = os.path.expanduser(path) + ".cache"
    if tp.world()[1] > 1 or not os.path.exists(cache):
        return ""
    try:
        return f" and its cache ({session.load_cache(cache)} tokens: not prefilled again)"
    except (ValueError, OSError) as e:
        return f" (its cache not used: {caches.first_words(e)})"


def describe_model(session: Session, ckpt: str, why: str) -> str:
    """/model: what is loaded (the parameter count of the full model, whatever its storage)."""
    model, config = session.model, session.model.config
    with torch.device("meta"):
        params = sum(p.numel() for p in layer_kinds.Decoder(config).parameters())
    source = os.path.join(ckpt, "config.json")
    origin = (read_json_quietly(source).get("source_format") if os.path.isfile(source) else None) or "native"
    heads = f"{config.heads(0)} heads ({config.kv_heads(0)} key/value)"
    return (f"{ckpt} ({origin})\n  {params / 1e6:.1f}M parameters, {config.num_hidden_layers} layers, {heads}, "
            f"{config.norm}, {config.mlp}{', parallel residual' if config.parallel_residual else ''}, vocabulary "
            f"{config.vocab_size}, context {config.max_position_embeddings}\n"
            f"  {str(model.dtype).removeprefix('torch.')} on {model.device}, {why.removeprefix('weights: ')}\n"
            f"  cache {session.max_seq_len} tokens ({len(session.cached)} in use) of "
            f"{str(caches.kv_memory(model).v.dtype).removeprefix('torch.')}"
            f"{', and state layers' if caches.has_state(model) else ''}, "
            f"{'compiled steps' if session.steps is not None else 'eager'}"
            f"{', draft ' + type(session.draft).__name__ if session.draft is not None else ''}")


def read_json_quietly(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def fit_conversation(session: Session, vocab: Vocabulary, system: str | None, history: list[dict],
                     options: dict | None = None):
    """Token ids of the rendered conversation, dropping the oldest messages (never the system message) until the
    prompt and a reply fit the cache. Returns (ids, messages dropped), or (None, 0) when even the last message
    alone does not fit."""
    head = [{"role": "system", "content": system}] if system else []
    for dropped in range(0, len(history), 2):
        ids = vocab.encode(vocab.render(head + history[dropped:], options=options), special=False)
        if len(ids) + min(session.settings.max_new_tokens, 64) <= session.max_seq_len:
            return ids, dropped
    return None, 0
