"""reasoning.py: a thinking model's reply told apart: its reasoning (between the template's markers) and its answer.
Qwen3, Qwen3.5, SmolLM3 and DeepSeek-R1's distills write <think> ... </think>; Gemma 4 writes a thought channel,
<|channel>thought ... <channel|>; Ministral 3's reasoning models and Magistral [THINK] ... [/THINK]. A template
may open the thinking in the prompt itself (the reply then starts inside it and only closes it), or close an empty
one there (thinking switched off). The server's APIs tell the reasoning in
their own fields (server/responses.py); chat.py shows it dimmed. Standard library only.
"""

from __future__ import annotations

from typing import NamedTuple


class Markers(NamedTuple):
    """What opens and closes a thinking in a reply; token: the one token a reply opens it with (a grammar that holds
    after the thinking lets it through first: grammar.Lazy); answer: what opens an answer written without a thinking
    (dropped; "": none)."""
    open: str
    close: str
    token: str
    answer: str = ""


THINK = Markers("<think>", "</think>", "<think>")
CHANNEL = Markers("<|channel>thought", "<channel|>", "<|channel>")  # Gemma 4
BRACKETS = Markers("[THINK]", "[/THINK]", "[THINK]")  # Ministral 3 Reasoning, Magistral
# gpt-oss (harmony): the analysis channel, then the final one, each a message of its own
HARMONY = Markers("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>",
                  "<|channel|>", "<|channel|>final<|message|>")
CLOSES = (THINK.close, CHANNEL.close, BRACKETS.close, HARMONY.close)


def markers(template: str | None) -> Markers | None:
    """The markers a chat template writes (its model thinks before it answers), or None. (A harmony template writes
    each channel's opener, never the two messages' seam: its answer's opener stands for the close.)"""
    return next((m for m in (HARMONY, CHANNEL, BRACKETS, THINK)
                 if template and m.open in template and (m.answer or m.close) in template), None)


def thinks(template: str | None) -> bool:
    return markers(template) is not None


def opened(prompt: str, pair: Markers = THINK) -> bool:
    """Whether the rendered prompt leaves a thinking open (ends with its opener, whitespace aside): the reply starts
    inside it."""
    return prompt.rstrip().endswith(pair.open)


class ThinkStream:
    """One reply's text, read as it comes (feed, then finish at its end), as ("thinking", text) and ("text", text)
    pieces. The thinking opens only before any answer; whitespace right after a marker is dropped (the answer does
    not start with the blank lines after </think>); text that could still be a marker is held back, a few characters
    at most."""

    def __init__(self, thinking: bool = False, pair: Markers = THINK) -> None:
        self.thinking, self.answered, self.fresh, self.held = thinking, False, True, ""
        self.open, self.close, self.answer = pair.open, pair.close, pair.answer

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        out = []
        if self.answer and not self.thinking and not self.answered:  # an answer's own opener, without a thinking
            start = self.held.lstrip()
            if start.startswith(self.answer):
                self.held, self.answered, self.fresh = start[len(self.answer):], True, True
            elif self.answer.startswith(start):
                return out  # (it may still be that opener)
        while True:
            marker = self.close if self.thinking else None if self.answered else self.open
            at = self.held.find(marker) if marker else -1
            before = self.held[:at] if at >= 0 else self.held[:len(self.held) - partial(self.held, self.open)]
            if marker == self.open and before.strip():
                marker, at = None, -1  # an answer came first: it does not think
            if at < 0:
                keep = partial(self.held, marker) if marker else 0
                self.emit(out, self.held[:len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                return out
            self.emit(out, self.held[:at])
            self.held = self.held[at + len(marker):]
            self.thinking, self.fresh = not self.thinking, True

    def finish(self) -> list[tuple[str, str]]:
        out = []
        self.emit(out, self.held)
        self.held = ""
        return out

    def emit(self, out: list, text: str) -> None:
        if self.fresh:
            text = text.lstrip()
        if not text:
            return
        if not self.thinking:
            self.answered = True
        self.fresh = False
        out.append(("thinking" if self.thinking else "text", text))


def partial(text: str, marker: str) -> int:
    """The length of the longest end of text that begins marker (held back: the next piece may complete it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split(text: str, thinking: bool = False, pair: Markers = THINK) -> tuple[str, str]:
    """(reasoning, answer) of a whole reply."""
    stream = ThinkStream(thinking, pair)
    parts = stream.feed(text) + stream.finish()
    return ("".join(t for kind, t in parts if kind == "thinking"), "".join(t for kind, t in parts if kind == "text"))
