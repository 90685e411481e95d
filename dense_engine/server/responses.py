"""The replies: one request's events (scheduler.Event: text, done, error) as an API tells its client. ClientEvents
puts them in the order a client is told them; a Reply of each format turns them into its stream's chunks or folds
them into its whole body, so a streamed reply and a whole one are read the same way. OpenAI's chat completions and
completions are the two formats here; another API is another Reply. No HTTP: these are dicts (tests compare them)."""

from __future__ import annotations

import json
import uuid
from typing import NamedTuple

from dense_engine.formats.vocab import Vocabulary
from dense_engine.runtime import reasoning, tools
from dense_engine.server.protocol import BadRequest, ToolCalling
from dense_engine.server.records import Event, Request


class Piece(NamedTuple):
    """What a choice's client is told next: "text" (text, its logprob entries), "thinking" (a piece of its reasoning,
    reasoning.py), "prompt" (echo: the prompt's text and entries, before the reply's), "call" (a tool call begins:
    text is its name, call its number in the reply),
    "arguments" (a piece of call `call`'s arguments, as the model writes them), "end" (call `call`'s arguments are
    whole), "done" (the finish reason, entries) or "error" (a message)."""
    index: int
    kind: str
    text: str
    entries: list
    call: int | None = None


class ClientEvents:
    """The events of a request's choices, in the order its client is told them: an echoed prompt before a choice's
    first piece; a thinking model's reasoning apart from its answer (reasoning.ThinkStream; thinking: whether the
    prompt opened it, None: no thinking to tell apart); with tools, the answer read by tools.CallStream as it comes:
    text, and calls with their arguments in pieces (text that could still open a call or end the thinking held back,
    a few characters at most)."""

    def __init__(self, jobs: list[Request], vocab: Vocabulary, calling: ToolCalling | None,
                 thinking: bool | None = None) -> None:
        self.jobs, self.vocab, self.calling = jobs, vocab, calling
        self.open = len(jobs)  # choices not done (0 after an error: nothing more is told)
        self.echoed = set()
        pair = reasoning.markers(vocab.chat_template)
        self.thoughts = {job.index: reasoning.ThinkStream(thinking, pair) for job in jobs} if thinking is not None \
            else {}
        self.streams = {job.index: tools.CallStream(calling.format, calling.names, calling.parallel)
                        for job in jobs} if calling is not None else {}
        self.pending = {job.index: [] for job in jobs}  # logprob entries of text a stream holds back

    def feed(self, event: Event) -> list[Piece]:
        job = self.jobs[event.index]
        if event.kind == "error":
            self.open = 0
            return [Piece(event.index, "error", event.text, [])]
        self.open -= event.kind == "done"
        if self.thoughts:
            return self.read_thinking(job, event)
        if self.calling is not None:
            return self.read_calls(job, event)
        pieces = []
        if job.echo and job.index not in self.echoed and (event.kind == "done" or event.text):  # the prompt first
            self.echoed.add(job.index)
            entries = [job.prompt[0]] + job.prompt_entries[1:] if job.prompt_entries else []  # (the first: none)
            pieces.append(Piece(job.index, "prompt", self.vocab.decode(job.prompt), entries))
        return pieces + [Piece(event.index, event.kind, event.text, event.entries)]

    def read_thinking(self, job: Request, event: Event) -> list[Piece]:
        """The reasoning as "thinking" pieces; the answer's text on to the calls' reading, or told as it is."""
        stream, pending = self.thoughts[job.index], self.pending[job.index]
        found = stream.feed(event.text) if event.kind == "text" else stream.finish()
        pending += event.entries  # (the next piece told carries them)
        pieces = []
        for kind, text in found:
            if kind == "text" and self.calling is not None:
                pieces += self.read_calls(job, Event(event.index, "text", text, []))
                continue
            entries, pending[:] = list(pending), []
            pieces.append(Piece(job.index, kind, text, entries))
        if event.kind == "done" and self.calling is not None:
            pieces += self.read_calls(job, Event(event.index, "done", event.text, []))
        elif event.kind == "done":
            entries, pending[:] = list(pending), []
            pieces.append(Piece(job.index, "done", event.text, entries))
        return pieces

    def read_calls(self, job: Request, event: Event) -> list[Piece]:
        stream, pending = self.streams[job.index], self.pending[job.index]
        pending += event.entries
        found = stream.feed(event.text) if event.kind == "text" else stream.finish()
        pieces = []
        for kind, *rest in found:
            entries, pending[:] = list(pending), []
            call, text = (rest[0], rest[1]) if kind != "text" else (None, rest[0])
            pieces.append(Piece(job.index, kind, text, entries, call))
        if event.kind == "done":
            entries, pending[:] = list(pending), []
            pieces.append(Piece(job.index, "done", event.text, entries))
        return pieces


def call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_event(obj: dict) -> str:
    """A server-sent event named by its type (Anthropic's and the Responses API's streams)."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Reply:
    """One request's reply in one format: `chunks(piece)` for a stream (after `start()`, then `end()`), each chunk
    sent as `frame(chunk)`, or `fold(piece)` for each piece and then `body()` for the whole reply. head: the id,
    created, model and system_fingerprint of every chunk and body; settings: the parsed request; meta: what the
    API's translator kept of its own request (protocol.py knows none of it)."""
    obj = chunk_obj = ""
    call_prefix = "call_"  # (a tool call's id)
    media_type, done_line = "text/event-stream", "data: [DONE]\n\n"

    def __init__(self, head: dict, jobs: list[Request], vocab: Vocabulary, settings=None, meta: dict | None = None):
        self.head, self.jobs, self.vocab, self.settings, self.meta = head, jobs, vocab, settings, meta or {}
        self.offsets = {job.index: 0 for job in jobs}  # (streamed) text sent per choice: completions' text_offset
        self.texts = {job.index: [] for job in jobs}  # (whole) per choice: its texts, entries and calls
        self.entries = {job.index: [] for job in jobs}
        self.calls = {job.index: [] for job in jobs}  # per choice: its calls so far, {"id", "name", "arguments"}
        self.thinking = {job.index: [] for job in jobs}  # (whole) per choice: its reasoning's pieces
        self.after_calls = set()  # choices with text after their calls (note_text)

    def piece(self, token: int) -> str:
        return self.vocab.tokenizer.decode([token], skip_special_tokens=False)

    def usage(self) -> dict:
        """(n choices of a prompt count its tokens once, as OpenAI's usage does)"""
        n = self.settings.n if self.settings is not None else 1
        prompt, generated = sum(len(j.prompt) for j in self.jobs[::n]), sum(len(j.generated) for j in self.jobs)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

    def chunk(self, choices: list, **extra) -> dict:
        return {**self.head, "object": self.chunk_obj, "choices": choices, **extra}

    # streamed

    def start(self) -> list[dict]:
        return []

    def end(self) -> list[dict]:
        """The stream's last chunks (OpenAI's: the usage, when stream_options asked for it)."""
        return [self.usage_chunk()] if self.settings is not None and self.settings.include_usage else []

    def frame(self, chunk: dict) -> str:
        return sse(chunk)

    def chunks(self, piece: Piece) -> list[dict]:
        if piece.kind == "error":
            return [BadRequest(piece.text, status=500, kind="server_error").body()]
        job, at = self.jobs[piece.index], self.offsets[piece.index]
        if piece.kind in ("call", "arguments", "end"):
            self.track(piece)
            return self.call_chunks(piece, self.calls[piece.index][piece.call])
        if piece.kind == "done":
            return [self.chunk([self.choice(job, None, piece.text, True, piece.entries, at)])]
        self.note_text(piece)
        self.offsets[piece.index] = at + len(piece.text)
        return [self.chunk([self.choice(job, piece.text, None, True, piece.entries, at)])]

    def usage_chunk(self) -> dict:
        return self.chunk([], usage=self.usage())

    def call_chunks(self, piece: Piece, call: dict) -> list[dict]:
        """A call's start (its name) or a piece of its arguments, as the format streams them."""
        raise NotImplementedError

    def track(self, piece: Piece) -> None:
        calls = self.calls[piece.index]
        if piece.kind == "call":
            calls.append({"id": call_id(self.call_prefix), "name": piece.text, "arguments": ""})
        elif piece.kind == "arguments":
            calls[piece.call]["arguments"] += piece.text
        elif piece.kind == "end":
            calls[piece.call]["ended"] = True

    def call_cut(self, index: int, reason: str) -> bool:
        """Whether max_tokens cut choice `index` inside a tool call: its arguments not whole, or text after its calls
        (another call cut before its name was whole). Its finish is "length", never "tool_calls"."""
        return reason == "length" and (any(not call.get("ended") for call in self.calls[index]) or
                                       index in self.after_calls)

    def note_text(self, piece: Piece) -> None:
        """Text told after a choice's calls (what a call cut before its name is whole reads as)."""
        if self.calls[piece.index] and piece.text.strip():
            self.after_calls.add(piece.index)

    # whole

    def fold(self, piece: Piece) -> None:
        if piece.kind == "error":
            raise BadRequest(piece.text, status=500, kind="server_error")
        if piece.kind == "prompt":  # (before whatever came first)
            self.texts[piece.index].insert(0, piece.text)
            self.entries[piece.index][:0] = piece.entries
            return
        if piece.kind == "text":
            self.texts[piece.index].append(piece.text)
            self.note_text(piece)
        if piece.kind == "thinking":
            self.thinking[piece.index].append(piece.text)
        self.entries[piece.index] += piece.entries
        if piece.kind in ("call", "arguments", "end"):
            self.track(piece)

    def body(self) -> dict:
        choices = []
        for job in self.jobs:
            text, entries = "".join(self.texts[job.index]), self.entries[job.index]
            choices.append(self.choice(job, text, job.finish_reason, False, entries))
            if self.calls[job.index]:
                choices[-1].update(finish_reason="length" if self.call_cut(job.index, job.finish_reason) else
                                   "tool_calls")
                calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"],
                                                                          "arguments": c["arguments"]}}
                         for c in self.calls[job.index]]
                choices[-1]["message"].update(content=text.strip() or None, tool_calls=calls)
        return {**self.head, "object": self.obj, "choices": choices, "usage": self.usage()}

    def choice(self, job: Request, text: str | None, reason: str | None, delta: bool, entries=(), offset=0) -> dict:
        raise NotImplementedError


class ChatReply(Reply):
    """OpenAI's chat completion: a message (streamed: deltas, the role first; tool calls by name, then arguments)."""
    obj, chunk_obj = "chat.completion", "chat.completion.chunk"

    def start(self) -> list[dict]:
        return [self.chunk([{"index": job.index, "delta": {"role": "assistant", "content": ""},
                             "finish_reason": None, "logprobs": None}]) for job in self.jobs]

    def choice(self, job: Request, text: str | None, reason: str | None, delta: bool, entries=(), offset=0) -> dict:
        message = {"content": text} if delta else {"role": "assistant", "content": text}
        if delta and text is None:
            message = {}
        return {"index": job.index, "delta" if delta else "message": message, "finish_reason": reason,
                "logprobs": self.logprobs(job, list(entries))}

    def logprobs(self, job: Request, entries: list) -> dict | None:
        if job.logprobs is None:
            return None

        def one(token, lp):
            return {"token": self.piece(token), "logprob": lp, "bytes": list(self.piece(token).encode())}

        return {"content": [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in alts]}
                            for t, lp, alts in entries]}

    def call_chunks(self, piece: Piece, call: dict) -> list[dict]:
        """A call's id and name first, then its arguments in pieces as they come (OpenAI's tool_calls deltas)."""
        if piece.kind == "end":
            return []
        if piece.kind == "call":
            value = {"index": piece.call, "id": call["id"], "type": "function",
                     "function": {"name": call["name"], "arguments": ""}}
        else:
            value = {"index": piece.call, "function": {"arguments": piece.text}}
        return [self.chunk([{"index": piece.index, "delta": {"tool_calls": [value]}, "finish_reason": None,
                             "logprobs": None}])]

    def chunks(self, piece: Piece) -> list[dict]:
        if piece.kind == "thinking":  # (llama-server's and vLLM's field)
            return [self.chunk([{"index": piece.index, "delta": {"reasoning_content": piece.text},
                                 "finish_reason": None,
                                 "logprobs": self.logprobs(self.jobs[piece.index], list(piece.entries))}])]
        if piece.kind == "done" and self.calls[piece.index]:  # the finish of a reply that called tools
            reason = "length" if self.call_cut(piece.index, piece.text) else "tool_calls"
            return [self.chunk([{"index": piece.index, "delta": {}, "finish_reason": reason,
                                 "logprobs": self.logprobs(self.jobs[piece.index], list(piece.entries))}])]
        return super().chunks(piece)


    def body(self) -> dict:
        body = super().body()
        for choice in body["choices"]:
            if self.thinking[choice["index"]]:
                choice["message"]["reasoning_content"] = "".join(self.thinking[choice["index"]])
        return body


class CompletionReply(Reply):
    """OpenAI's (legacy) completion: a text per prompt, logprobs as parallel lists with text offsets."""
    obj = chunk_obj = "text_completion"

    def choice(self, job: Request, text: str | None, reason: str | None, delta: bool, entries=(), offset=0) -> dict:
        return {"index": job.index, "text": text or "", "finish_reason": reason,
                "logprobs": self.logprobs(job, list(entries), offset)}

    def logprobs(self, job: Request, entries: list, offset: int) -> dict | None:
        """(echo: a prompt's first token has an id but no logprob, as OpenAI's null)"""
        if job.logprobs is None:
            return None
        tokens = [self.piece(e[0]) if isinstance(e, tuple) else self.piece(e) for e in entries]
        offsets = [offset + sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [e[1] if isinstance(e, tuple) else None for e in entries],
                "top_logprobs": [self.top_by_text(e[2]) if isinstance(e, tuple) else None for e in entries],
                "text_offset": offsets}

    def top_by_text(self, alternatives: list) -> dict:
        """{token text: logprob}, best first; two ids of one text keep the better one."""
        top = {}
        for token, lp in alternatives:
            top.setdefault(self.piece(token), lp)
        return top


FORMATS = {"chat": ChatReply, "completion": CompletionReply}
