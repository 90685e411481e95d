"""The replies: one request's events (scheduler.Event: text, done, error) as an API tells its client. ClientEvents
puts them in the order a client is told them; a Reply of each format turns them into its stream's chunks or folds
them into its whole body, so a streamed reply and a whole one are read the same way. OpenAI's chat completions and
completions are the two formats here; another API is another Reply. No HTTP: these are dicts (tests compare them)."""

from __future__ import annotations

import json
import uuid
from typing import NamedTuple

from dense_engine.formats.vocab import Vocabulary
from dense_engine.runtime import tools
from dense_engine.server.protocol import BadRequest, ToolCalling
from dense_engine.server.scheduler import Event, Request


class Piece(NamedTuple):
    """What a choice's client is told next: "text" (text, its logprob entries), "prompt" (echo: the prompt's text and
    entries, before the reply's), "calls" (the reply parsed as tool calls: the text, its entries, the calls), "done"
    (the finish reason, entries) or "error" (a message)."""
    index: int
    kind: str
    text: str
    entries: list
    calls: list | None = None


class ClientEvents:
    """The events of a request's choices, in the order its client is told them: an echoed prompt before a choice's
    first piece; a reply that may be tool calls held back to its end, then sent as calls or as text."""

    def __init__(self, jobs: list[Request], vocab: Vocabulary, calling: ToolCalling | None) -> None:
        self.jobs, self.vocab, self.calling = jobs, vocab, calling
        self.open = len(jobs)  # choices not done (0 after an error: nothing more is told)
        self.echoed, self.held = set(), {job.index: [] for job in jobs}

    def feed(self, event: Event) -> list[Piece]:
        job = self.jobs[event.index]
        if event.kind == "error":
            self.open = 0
            return [Piece(event.index, "error", event.text, [])]
        self.open -= event.kind == "done"
        if self.calling is not None:
            return self.hold(job, event)
        pieces = []
        if job.echo and job.index not in self.echoed and (event.kind == "done" or event.text):  # the prompt first
            self.echoed.add(job.index)
            entries = [job.prompt[0]] + job.prompt_entries[1:] if job.prompt_entries else []  # (the first: none)
            pieces.append(Piece(job.index, "prompt", self.vocab.decode(job.prompt), entries))
        return pieces + [Piece(event.index, event.kind, event.text, event.entries)]

    def hold(self, job: Request, event: Event) -> list[Piece]:
        held = self.held[job.index]
        held.append((event.text if event.kind == "text" else "", event.entries))
        if event.kind != "done":
            return []
        text, entries = "".join(t for t, _ in held), [e for _, got in held for e in got]
        calls = tool_calls(text, self.calling)
        if calls:
            return [Piece(job.index, "calls", text, entries, calls)]
        said = [Piece(job.index, "text", text, entries)] if text or entries else []
        return said + [Piece(job.index, "done", event.text, [])]


def tool_calls(text: str, calling: ToolCalling) -> list[dict]:
    """The reply's calls in OpenAI's form (none unless the reply is calls of the offered tools)."""
    calls = tools.parse_calls(text, calling.format, calling.names)
    calls = calls if calling.parallel else calls[:1]
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


class Reply:
    """One request's reply in one format: `chunks(piece)` for a stream (after `start()`), or `fold(piece)` for each
    piece and then `body()` for the whole reply. head: the id, created, model and system_fingerprint of every
    chunk and body."""
    obj = chunk_obj = ""

    def __init__(self, head: dict, jobs: list[Request], vocab: Vocabulary) -> None:
        self.head, self.jobs, self.vocab = head, jobs, vocab
        self.offsets = {job.index: 0 for job in jobs}  # (streamed) text sent per choice: completions' text_offset
        self.texts = {job.index: [] for job in jobs}  # (whole) per choice: its texts, entries and calls
        self.entries = {job.index: [] for job in jobs}
        self.calls = {}

    def piece(self, token: int) -> str:
        return self.vocab.tokenizer.decode([token], skip_special_tokens=False)

    def usage(self) -> dict:
        prompt, generated = sum(len(j.prompt) for j in self.jobs), sum(len(j.generated) for j in self.jobs)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

    def chunk(self, choices: list, **extra) -> dict:
        return {**self.head, "object": self.chunk_obj, "choices": choices, **extra}

    # streamed

    def start(self) -> list[dict]:
        return []

    def chunks(self, piece: Piece) -> list[dict]:
        if piece.kind == "error":
            return [BadRequest(piece.text, status=500, kind="server_error").body()]
        job, at = self.jobs[piece.index], self.offsets[piece.index]
        if piece.kind == "calls":
            return self.call_chunks(piece.calls)
        if piece.kind == "done":
            return [self.chunk([self.choice(job, None, piece.text, True, piece.entries, at)])]
        self.offsets[piece.index] = at + len(piece.text)
        return [self.chunk([self.choice(job, piece.text, None, True, piece.entries, at)])]

    def usage_chunk(self) -> dict:
        return self.chunk([], usage=self.usage())

    def call_chunks(self, calls: list[dict]) -> list[dict]:
        raise NotImplementedError

    # whole

    def fold(self, piece: Piece) -> None:
        if piece.kind == "error":
            raise BadRequest(piece.text, status=500, kind="server_error")
        if piece.kind == "prompt":  # (before whatever came first)
            self.texts[piece.index].insert(0, piece.text)
            self.entries[piece.index][:0] = piece.entries
            return
        if piece.kind in ("text", "calls"):
            self.texts[piece.index].append(piece.text)
        self.entries[piece.index] += piece.entries
        if piece.kind == "calls":
            self.calls[piece.index] = piece.calls

    def body(self) -> dict:
        choices = []
        for job in self.jobs:
            text, entries = "".join(self.texts[job.index]), self.entries[job.index]
            choices.append(self.choice(job, text, job.finish_reason, False, entries))
            if self.calls.get(job.index):
                choices[-1].update(finish_reason="tool_calls")
                choices[-1]["message"].update(content=None, tool_calls=self.calls[job.index])
        return {**self.head, "object": self.obj, "choices": choices, "usage": self.usage()}

    def choice(self, job: Request, text: str | None, reason: str | None, delta: bool, entries=(), offset=0) -> dict:
        raise NotImplementedError


class ChatReply(Reply):
    """OpenAI's chat completion: a message (streamed: deltas, the role first; tool calls by name, then arguments)."""
    obj, chunk_obj = "chat.completion", "chat.completion.chunk"

    def start(self) -> list[dict]:
        return [self.chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                             "logprobs": None}])]

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

        return {"content": [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in alts]} for t, lp, alts in entries]}

    def call_chunks(self, calls: list[dict]) -> list[dict]:
        """Each call's name first, then its arguments in pieces (as OpenAI streams them), then the finish."""
        def delta(value: dict, reason=None) -> dict:
            return self.chunk([{"index": 0, "delta": value, "finish_reason": reason, "logprobs": None}])

        out = []
        for i, call in enumerate(calls):
            out.append(delta({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                              "function": {"name": call["function"]["name"], "arguments": ""}}]}))
            arguments = call["function"]["arguments"]
            step = max(1, len(arguments) // 3 + 1)
            out += [delta({"tool_calls": [{"index": i, "function": {"arguments": arguments[at:at + step]}}]})
                    for at in range(0, len(arguments), step)]
        return out + [delta({}, "tool_calls")]


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
