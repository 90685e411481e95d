"""api.py: the engine from Python, no flags.

    import dense_engine
    llm = dense_engine.load("path/to/ckpt")                      # None: the default model, fetched once
    print(llm.generate("The capital of France is", max_new_tokens=8, temperature=0))
    for piece in llm.stream([{"role": "user", "content": "Hi!"}]):
        print(piece, end="", flush=True)

A prompt is text, token ids, or chat messages; text goes through the chat template when the checkpoint has one
(chat=False: as it is). Every call answers through one Session, so a conversation's next turn prefills only its new
tokens. chat.py is a client of the same pieces: load by flags (cli/flags.py), a Session, its stream.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dense_engine.formats import load as loading
from dense_engine.formats import lora as adapters
from dense_engine.formats import preread
from dense_engine.formats.default_model import default_checkpoint
from dense_engine.formats.load import LoadRecord
from dense_engine.formats.vocab import Vocabulary, load_vocabulary
from dense_engine.runtime.sampling import Defaults
from dense_engine.runtime.session import ReplyStats, Session, load_model
from dense_engine.system.errors import UsageError

Prompt = str | list[int] | list[dict]


@dataclass
class LLM:
    """A loaded model with its vocabulary: `model` (dense.DenseDecoder), `vocab`, `load` (the LoadRecord: path,
    quantization and why, dtype, device, the cache's kind and length, compile), and the Session every call answers
    through."""
    model: torch.nn.Module
    vocab: Vocabulary
    load: LoadRecord
    session: Session

    @property
    def path(self) -> str:
        return self.load.path

    @property
    def defaults(self) -> Defaults:
        """The sampling a call that does not say gets (its values and where each came from)."""
        return Defaults.of_vocab(self.vocab)

    @property
    def weights(self) -> str:
        """What was loaded and why."""
        return self.load.weights

    def encode(self, prompt: Prompt, chat: bool | None = None, system: str | None = None) -> list[int]:
        """The token ids generation starts from. chat None: the chat template when the checkpoint has one."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        messages = prompt if isinstance(prompt, list) else None
        if chat is None:
            chat = messages is not None or bool(self.vocab.chat_template)
        if messages is None and not chat:
            return self.vocab.encode(prompt, special=True)
        if not self.vocab.chat_template:
            raise UsageError(f"{self.path}: chat messages need a chat template (tokenizer_config.json has none)")
        messages = messages if messages is not None else [{"role": "user", "content": prompt}]
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        return self.vocab.encode(self.vocab.render(messages), special=False)

    def stream(self, prompt: Prompt, max_new_tokens: int = 256, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, chat: bool | None = None,
               system: str | None = None, **sampling) -> Iterator[str]:
        """The reply's text as it is generated (temperature 0: greedy, the same tokens every run). A sampling value
        not given (None) is the checkpoint's recommendation (generation_config.json, a GGUF's general.sampling.*),
        else llama.cpp's default (sampling.Defaults). sampling: the other fields of SamplerSettings (min_p,
        typical_p, repetition_penalty, repeat_last_n, dry_multiplier, ...), each call's own."""
        ids = self.encode(prompt, chat, system)
        if not ids:
            raise UsageError("the prompt is empty")
        if len(ids) >= self.session.max_seq_len:
            raise UsageError(f"the prompt has {len(ids)} tokens; the cache holds {self.session.max_seq_len}")
        try:
            sampler, sources = self.defaults.settings(temperature=temperature, top_k=top_k, top_p=top_p, **sampling)
        except ValueError as e:
            raise UsageError(f"sampling: {e}") from None
        except TypeError:
            raise UsageError(f"unknown sampling settings {sorted(sampling)}: expected fields of SamplerSettings "
                             "(min_p, typical_p, repetition_penalty, repeat_last_n, dry_multiplier, ...)") from None
        self.session.settings = dataclasses.replace(self.session.settings, sampler=sampler, sources=sources,
                                                    max_new_tokens=max_new_tokens)
        return self.session.stream(ids)

    def generate(self, prompt: Prompt, max_new_tokens: int = 256, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, chat: bool | None = None,
                 system: str | None = None, **sampling) -> str:
        """The whole reply's text; its tokens are `llm.session.reply_ids`, its numbers `llm.stats`."""
        return "".join(self.stream(prompt, max_new_tokens, temperature, top_k, top_p, chat, system, **sampling))

    @property
    def stats(self) -> ReplyStats:
        """The last reply's numbers: tokens, prefilled tokens, time to the first token, total time."""
        return self.session.last


def load(path: str | None = None, quant: str = "auto", device: str | None = None, dtype: torch.dtype | None = None,
         tokenizer: str | None = None, max_seq_len: int | None = None, compile: bool = True,
         kv_dtype: str = "auto", lora: list = ()) -> LLM:
    """A checkpoint (a folder or file any loader reads: Hugging Face, GGUF, native; None: the default model) ready
    to answer. quant: "auto" (as chat.py: a GGUF's own blocks, int4 for Q4_0/Q4_1, else as stored), "none", "int8",
    "int4", "nf4", "llm.int8", "fp8", "gguf". device: default cuda when there is one, else cpu; dtype: default bfloat16
    on cuda, float32 elsewhere. max_seq_len: the cache (default the model's context, or what fits a quarter of the free
    memory). compile: compiled steps, saved for later processes (the first time on a machine they compile in the
    background while it answers eagerly). kv_dtype: the cache's numbers, as chat.py's --kv-dtype ("auto",
    "float32", "float16", "bfloat16", "int8"). lora: LoRA adapters (PEFT folders, llama.cpp's GGUF adapter files),
    each a path, "PATH:SCALE" or (path, scale), as chat.py's --lora: merged into full-precision weights, beside
    quantized ones."""
    from rich.console import Console

    path = path or default_checkpoint(Console(stderr=True, soft_wrap=True))
    vocab = load_vocabulary(path, tokenizer)
    entries = tuple(adapters.entry(a) for a in lora)
    adapters.unnamed(entries, "dense_engine.load")
    record, checkpoint = loading.plan(path, quant, device, dtype, kv_dtype, max_seq_len, compile, entries)
    preread.start_for(record)  # a GGUF's blocks into huge pages (a decode step streams them faster)
    try:
        model = load_model(record, checkpoint)
    finally:
        preread.discard()
    note = (lambda message: print(f"note: {message}", file=sys.stderr)) if compile else None
    return LLM(model, vocab, record, Session(model, vocab, load=record, note=note))
