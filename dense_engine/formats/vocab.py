"""vocab.py: a checkpoint's vocabulary: its tokenizer, chat template (rendered in a sandbox, under a time limit) and
stop tokens, and the incremental detokenizer that streams replies. Stands on checkpoint.py (JSON side files) and
machine.py.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from dataclasses import dataclass, field

from dense_engine.formats.checkpoint import read_json
from dense_engine.system import machine
from dense_engine.system.errors import UsageError, first_line


class TemplateRefused(UsageError):
    """A chat template's own raise_exception(): it refuses these messages."""


@dataclass
class Vocabulary:
    tokenizer: object  # tokenizers.Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    stop_ids: set[int] = field(default_factory=set)
    merged_system: bool = False  # a system message was merged into a template without a system role (noted once)
    sampling: dict = field(default_factory=dict)  # the sampling the checkpoint recommends (transformers' names)
    sampling_source: str = "generation_config.json"  # (or a GGUF file's general.sampling.* keys)

    @property
    def size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render(self, messages: list[dict], tools: list[dict] | None = None, options: dict | None = None) -> str:
        """The chat template rendered as Hugging Face renders tokenizer_config.json's chat_template. A template that
        refuses a system message (Gemma 1 and 2 have no system role) gets it at the start of the first user message
        instead, with a note the first time: transformers would stop with the template's error."""
        try:
            return self.render_as_is(messages, tools, options)
        except TemplateRefused:
            if len(messages) < 2 or messages[0]["role"] != "system" or messages[1]["role"] != "user":
                raise
            merged = [{"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}]
            text = self.render_as_is(merged + messages[2:], tools, options)
            if not self.merged_system:
                machine.note("this chat template has no system role; the system message goes at the start of the "
                             "first user message")
                self.merged_system = True
            return text

    def render_as_is(self, messages: list[dict], tools: list[dict] | None = None, options: dict | None = None) -> str:
        """options: the template's own variables a request sets (chat_template_kwargs: enable_thinking, ...)."""
        from jinja2 import TemplateError

        try:
            extra = {**(options or {}), **({"tools": tools} if tools else {})}  # (templates test `tools is defined`)
            template = self.template()
            template.environment.deadline.at = time.monotonic() + TEMPLATE_SECONDS
            return template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
                                   eos_token=self.eos_token or "", **extra)
        except TemplateError as e:  # syntax errors, undefined names, and the sandbox refusing unsafe access
            first = first_line(e)
            raise UsageError(f"chat template in tokenizer_config.json: {type(e).__name__}: {first}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as e:
            raise UsageError(f"chat template in tokenizer_config.json: {type(e).__name__}: {e}") from None


    def template(self):
        """The chat template compiled once, in jinja2's sandbox (a template is code from the checkpoint)."""
        if getattr(self, "_compiled", None) is None or self._compiled[0] != self.chat_template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise TemplateRefused(f"chat template: {message}")

            class Sandbox(ImmutableSandboxedEnvironment):
                """Every call, attribute and item the template reaches for first checks the clock: a template that
                loops for hours stops at its deadline (in any thread: a server renders in a pool)."""
                deadline = threading.local()

                def call(*args, **kwargs):
                    args[0].check()
                    return ImmutableSandboxedEnvironment.call(*args, **kwargs)

                def getattr(self, obj, attribute):
                    self.check()
                    return super().getattr(obj, attribute)

                def getitem(self, obj, argument):
                    self.check()
                    return super().getitem(obj, argument)

                def check(self) -> None:
                    if time.monotonic() > getattr(self.deadline, "at", float("inf")):
                        raise UsageError(f"chat template in tokenizer_config.json: still rendering after "
                                         f"{TEMPLATE_SECONDS} s")

            env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda form: datetime.datetime.now().strftime(form)  # (as transformers)
            self._compiled = (self.chat_template, env.from_string(self.chat_template))
        return self._compiled[1]


# What generation_config.json may recommend to the sampler (runtime/sampling.py Defaults reads them)
SAMPLING_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty")
TEMPLATE_SECONDS = 5  # a template is code from the checkpoint: it may loop for hours inside the sandbox


def load_vocabulary(ckpt: str, tokenizer_path: str | None) -> Vocabulary:
    from tokenizers import Tokenizer

    folder = ckpt if os.path.isdir(ckpt) else os.path.dirname(os.path.abspath(ckpt))
    extra = {}
    if tokenizer_path is not None:
        path = os.path.join(tokenizer_path, "tokenizer.json") if os.path.isdir(tokenizer_path) else tokenizer_path
        if not os.path.isfile(path):
            raise UsageError(f"--tokenizer {tokenizer_path}: no tokenizer.json there")
    elif ckpt.endswith(".gguf"):
        from dense_engine.formats import gguf_import

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
    except Exception as e:  # noqa: BLE001 (the tokenizers library's errors: said as a UsageError)
        raise UsageError(f"{path}: not a readable tokenizer.json ({first_line(e)})") from None
    tokenizer = with_markers_shown(tokenizer)

    def side(name: str) -> dict:
        if name in extra:
            return json.loads(extra[name])
        file = os.path.join(folder, name)
        return read_json(file) if os.path.isfile(file) else {}

    tok_config, gen_config = side("tokenizer_config.json"), side("generation_config.json")
    model_config = side("config.json")
    template = tok_config.get("chat_template")
    jinja = os.path.join(folder, "chat_template.jinja")  # (transformers 5 saves the template apart; it wins, as there)
    if not extra and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    vocab = Vocabulary(tokenizer, template, token_text(tok_config.get("bos_token")),
                       token_text(tok_config.get("eos_token")))
    if isinstance(vocab.chat_template, list):  # [{"name": "default", "template": ...}, ...]
        vocab.chat_template = next((t["template"] for t in vocab.chat_template if t.get("name") == "default"), None)
    vocab.sampling = {k: gen_config[k] for k in SAMPLING_FIELDS if k in gen_config}
    if ckpt.endswith(".gguf"):  # (its generation_config.json is made from the file's general.sampling.* keys)
        vocab.sampling_source = "general.sampling.*"
    for source in (gen_config, model_config):
        ids = source.get("eos_token_id")
        vocab.stop_ids.update([ids] if isinstance(ids, int) else (ids or []))
    if vocab.eos_token and tokenizer.token_to_id(vocab.eos_token) is not None:
        vocab.stop_ids.add(tokenizer.token_to_id(vocab.eos_token))
    awaits = tokenizer.token_to_id("<|tool_response>")  # (Gemma 4's template writes it after a call: the turn ends)
    if awaits is not None and "<|tool_call>call:" in (vocab.chat_template or ""):
        vocab.stop_ids.add(awaits)
    return vocab


# the markers of a reply's thinking and calls: Gemma 4's, Mistral's
SHOWN = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "[THINK]", "[/THINK]", "[TOOL_CALLS]",
         "[ARGS]", "[CALL_ID]")


def with_markers_shown(tokenizer):
    """The tokenizer with the markers of a reply's thinking and tool calls decoded as text. Gemma 4's and Mistral's
    tokenizer.json call them special, and a decode skips special tokens, yet the thinking and the calls are read
    from them (reasoning.py, tools.py); llama.cpp keeps them in the text for the same reason."""
    from tokenizers import Tokenizer

    if not any(t.special and t.content in SHOWN for t in tokenizer.get_added_tokens_decoder().values()):
        return tokenizer
    spec = json.loads(tokenizer.to_str())
    for token in spec["added_tokens"]:
        token["special"] = token["special"] and token["content"] not in SHOWN
    return Tokenizer.from_str(json.dumps(spec))


def token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class TextStream:
    """Incremental detokenizer, constant work per token (tokenizers' DecodeStream decodes a few ids around the new
    one, not the whole text again): returns only complete text, holding back a multi-byte character split across
    tokens until its last byte arrives. What it returns is, piece by piece, the decode of all the ids."""

    def __init__(self, vocab: Vocabulary) -> None:
        from tokenizers.decoders import DecodeStream

        self.vocab, self.ids, self.shown = vocab, [], 0
        self.decoder = DecodeStream(skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(token)
        new = self.decoder.step(self.vocab.tokenizer, token) or ""
        self.shown += len(new)
        return new

    def finish(self) -> str:
        """The rest: a character whose bytes never completed (U+FFFD, as a whole decode shows it)."""
        text = self.vocab.decode(self.ids)
        new, self.shown = text[self.shown:], len(text)
        return new


class StopText:
    """A reply's text as it grows, cut at the first stop string: push(piece) returns what is safe to show now,
    holding back a tail that could still grow into a stop string (in order, until it completes one or cannot);
    `stopped` once one appeared (nothing from it on is shown)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.pending, self.stopped = stops, "", False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, piece: str) -> str:
        self.pending += piece
        for stop in self.stops:
            at = self.pending.find(stop)
            if at >= 0:
                shown, self.pending, self.stopped = self.pending[:at], "", True
                self.matched = stop
                return shown
        keep = max((n for stop in self.stops for n in range(1, min(len(stop), len(self.pending) + 1))
                    if self.pending.endswith(stop[:n])), default=0)  # the longest tail that may grow into a stop
        shown, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return shown

    def flush(self) -> str:
        """What is held back (the text ends here)."""
        held, self.pending = self.pending, ""
        return held
