"""vocab.py: a checkpoint's vocabulary: its tokenizer, chat template (rendered in a sandbox, under a time limit) and
stop tokens, and the incremental detokenizer that streams replies; a GGUF file's vocabulary rebuilt as the side files
a folder has (gguf_side_files: tokenizer.json, tokenizer_config.json, generation_config.json, as llama.cpp reads the
file's metadata). Stands on checkpoint.py (JSON side files), gguf_import.py (a GGUF's metadata) and machine.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass

from dense_engine.formats.checkpoint import atomic_write, read_json, write_text
from dense_engine.formats.gguf_import import field, open_gguf
from dense_engine.system import machine
from dense_engine.system.errors import CheckpointError, UsageError, first_line


class TemplateRefused(UsageError):
    """A chat template's own raise_exception(): it refuses these messages."""


@dataclass
class Vocabulary:
    tokenizer: object  # tokenizers.Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    stop_ids: set[int] = dataclasses.field(default_factory=set)
    merged_system: bool = False  # a system message was merged into a template without a system role (noted once)
    sampling: dict = dataclasses.field(default_factory=dict)  # the sampling it recommends (transformers' names)
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
        extra = gguf_side_files(ckpt)
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


# the markers of a reply's thinking and calls: Gemma 4's, Mistral's, gpt-oss's (harmony's channels and messages)
SHOWN = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "[THINK]", "[/THINK]", "[TOOL_CALLS]",
         "[ARGS]", "[CALL_ID]", "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>")


def with_markers_shown(tokenizer):
    """The tokenizer with the markers of a reply's thinking and tool calls decoded as text. Gemma 4's, Mistral's and
    gpt-oss's tokenizer.json call them special, and a decode skips special tokens, yet the thinking and the calls are
    read from them (reasoning.py, tools.py); llama.cpp keeps them in the text for the same reason."""
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


# ----------------------------------------------------------------------------------------------------------------
# A GGUF file's vocabulary: `tokenizer.ggml.*` rebuilt with the `tokenizers` library, as llama.cpp reads it: byte-level
# BPE ("gpt2", with llama.cpp's pre-tokenizers), SentencePiece ("llama": scores, byte fallback, "▁" for spaces) or
# Gemma 4's BPE over the text ("gemma4"); the chat template kept for tokenizer_config.json, the recommended sampling
# (general.sampling.*) for generation_config.json

# Token texts that end a turn in common chat formats (llama.cpp recognises them the same way).
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "<turn|>", "<|end|>",
               "</s>")
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type values
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's split: as Llama 3's, but digits one at a time
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's: as Qwen2's, with combining marks (\p{M}) kept in words
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def pre_tokenizer(pre: str, path: str):
    """The pre-tokenizer llama.cpp uses for tokenizer.ggml.pre, in `tokenizers` terms."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2", "gpt-2", "olmo", "jina-es", "jina-de"):
        return byte_level
    if pre in ("smollm", "starcoder", "refact", "exaone"):  # every digit alone, then GPT-2's split (llama.cpp's REFACT)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "dbrx": LLAMA3_SPLIT,
             "smaug-bpe": LLAMA3_SPLIT, "lfm2": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT, "qwen35": QWEN35_SPLIT}.get(pre)
    if split is None:
        raise CheckpointError(f"{path}: GGUF metadata tokenizer.ggml.pre {pre!r} is not supported")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def gguf_tokenizer(reader, path: str):
    """A `tokenizers.Tokenizer` equal to llama.cpp's tokenizer of the file (BPE "gpt2" or SentencePiece "llama")."""
    try:
        return _gguf_tokenizer(reader, path)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 (tokens or merges the tokenizers library refuses)
        raise CheckpointError(f"{path}: the GGUF's tokenizer cannot be built ({type(e).__name__}: "
                              f"{first_line(e)})") from None


def _gguf_tokenizer(reader, path: str):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    kind = field(reader, "tokenizer.ggml.model", path=path)
    tokens = field(reader, "tokenizer.ggml.tokens", path=path)
    types = field(reader, "tokenizer.ggml.token_type", [NORMAL] * len(tokens), path)
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", path=path)]
        tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
        tokenizer.pre_tokenizer = pre_tokenizer(field(reader, "tokenizer.ggml.pre", "default", path), path)
        tokenizer.decoder = decoders.ByteLevel()
    elif kind == "llama":
        tokenizer = sentencepiece_tokenizer(reader, tokens, types, path)
    elif kind == "gemma4":  # BPE on the text itself: spaces as "▁", split only at newlines, <0xXX> byte fallback
        merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", path=path)]
        tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                                         byte_fallback=True))
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        raise CheckpointError(f"{path}: GGUF metadata tokenizer.ggml.model {kind!r} is not supported ('gpt2' BPE, "
                              "'llama' SentencePiece or 'gemma4' BPE)")
    # control tokens (and user-defined ones) are matched whole, before the model sees the text, as llama.cpp does
    tokenizer.add_tokens([AddedToken(t, special=ty == CONTROL, normalized=False)
                          for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)])
    bos = int(field(reader, "tokenizer.ggml.bos_token_id", -1, path))
    if add_bos(reader, path) and 0 <= bos < len(tokens):  # encode(text, add_special_tokens=True) starts with BOS
        from tokenizers import processors

        tokenizer.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A",
                                                                 special_tokens=[(tokens[bos], bos)])
    return tokenizer


def add_bos(reader, path: str) -> bool:
    """Whether llama.cpp starts a tokenized text with BOS: the file's add_bos_token, else yes for SentencePiece."""
    return bool(field(reader, "tokenizer.ggml.add_bos_token",
                      field(reader, "tokenizer.ggml.model", path=path) == "llama", path))


def sentencepiece_tokenizer(reader, tokens: list[str], types: list[int], path: str):
    """llama.cpp's SentencePiece tokenizer as a `tokenizers` BPE: spaces become "▁" (a "▁" before the text, and after
    every special token, when add_space_prefix), adjacent pieces merge into the highest-scoring piece first, and what
    no piece covers falls back to its UTF-8 bytes (<0xXX> tokens). A merge is ranked by the score of the piece it
    makes, so the BPE's merge order is llama.cpp's."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = field(reader, "tokenizer.ggml.scores", [0.0] * len(tokens), path)
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, ty in zip(tokens, types):
        if ty not in (NORMAL, USER_DEFINED) or len(piece) < 2:
            continue
        merges += [(piece[:i], piece[i:], scores[vocab[piece]]) for i in range(1, len(piece))
                   if piece[:i] in vocab and piece[i:] in vocab]
    merges.sort(key=lambda m: -m[2])  # (stable: equal scores keep the shorter left part first)
    unk = int(field(reader, "tokenizer.ggml.unknown_token_id", 0, path))
    model = models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token=tokens[unk], fuse_unk=True,
                       byte_fallback=True)
    tokenizer = Tokenizer(model)
    prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True, path))
    steps = [normalizers.Prepend("▁")] if prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(decode + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer


# A GGUF file's recommended sampling (general.sampling.*, as llama.cpp reads them) by generation_config.json's names
SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typ_p": "typical_p",
                 "penalty_repeat": "repetition_penalty"}


def gguf_side_files(path: str) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and generation_config.json texts for a GGUF's native folder. Building
    them takes 0.6 s for a 128K vocabulary: they are kept in the cache folder, keyed by the file (path, size, time)
    and this code, and read back by later runs (0.05 s)."""
    saved = None
    try:
        stat = os.stat(path)
        with open(__file__, "rb") as f:
            code = f.read()
        identity = json.dumps([os.path.abspath(path), stat.st_size, stat.st_mtime_ns]).encode()
        saved = os.path.join(machine.cache_dir(), "tokenizers",
                             hashlib.sha256(identity + code).hexdigest()[:32] + ".json")
        with open(saved, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):  # not built yet (or unreadable: built again)
        pass
    files = build_gguf_side_files(path)
    if saved is not None and machine.unwritable_cache() is None:
        try:
            os.makedirs(os.path.dirname(saved), exist_ok=True)
            atomic_write(saved, lambda p: write_text(p, json.dumps(files), encoding="utf-8"))
        except OSError:  # a full disk: built again next time
            pass
    return files


def build_gguf_side_files(path: str) -> dict[str, str]:
    reader = open_gguf(path)
    tokens = field(reader, "tokenizer.ggml.tokens", path=path)
    types = field(reader, "tokenizer.ggml.token_type", [NORMAL] * len(tokens), path)
    bos = int(field(reader, "tokenizer.ggml.bos_token_id", -1, path))
    eos = int(field(reader, "tokenizer.ggml.eos_token_id", -1, path))
    for name, value in (("bos", bos), ("eos", eos)):
        if value >= len(tokens):
            raise CheckpointError(f"{path}: tokenizer.ggml.{name}_token_id {value} is not among the {len(tokens)} "
                                  "tokens")
    stops = [eos] if eos >= 0 else []
    stops += [i for i, (t, ty) in enumerate(zip(tokens, types))
              if ty == CONTROL and t in END_OF_TURN and i not in stops]
    arch = field(reader, "general.architecture", path=path)
    tokenizer_config = {"bos_token": tokens[bos] if bos >= 0 else None, "eos_token": tokens[eos] if eos >= 0 else None,
                        "add_bos_token": add_bos(reader, path),
                        "model_max_length": int(field(reader, f"{arch}.context_length", 2048, path))}
    template = field(reader, "tokenizer.chat_template", "", path)
    if template:
        tokenizer_config["chat_template"] = template
    generation = {"bos_token_id": bos if bos >= 0 else None, "eos_token_id": stops}
    generation.update({name: field(reader, f"general.sampling.{key}", path=path)  # (the sampling it recommends)
                       for key, name in SAMPLING_KEYS.items() if f"general.sampling.{key}" in reader.fields})
    return {"tokenizer.json": gguf_tokenizer(reader, path).to_str(),
            "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n",
            "generation_config.json": json.dumps(generation, indent=2) + "\n"}
