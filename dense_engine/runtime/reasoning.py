"""reasoning.py: a thinking model's reply told apart: its reasoning (between the template's markers, <think> and
</think>) and its answer. Qwen3, Qwen3.5, SmolLM3 and DeepSeek-R1's distills write the markers; a template may open
the thinking in the prompt itself (the reply then starts inside it and only closes it). The server's APIs tell the
reasoning in their own fields (server/responses.py); chat.py shows it dimmed. Standard library only.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str | None) -> bool:
    """Whether a chat template writes the thinking markers (its model thinks before it answers)."""
    return bool(template) and OPEN in template and CLOSE in template


def opened(prompt: str) -> bool:
    """Whether the rendered prompt leaves a thinking open (ends with <think>, whitespace aside): the reply starts
    inside it."""
    return prompt.rstrip().endswith(OPEN)


class ThinkStream:
    """One reply's text, read as it comes (feed, then finish at its end), as ("thinking", text) and ("text", text)
    pieces. The thinking opens only before any answer; whitespace right after a marker is dropped (the answer does
    not start with the blank lines after </think>); text that could still be a marker is held back, a few characters
    at most."""

    def __init__(self, thinking: bool = False) -> None:
        self.thinking, self.answered, self.fresh, self.held = thinking, False, True, ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        out = []
        while True:
            marker = CLOSE if self.thinking else None if self.answered else OPEN
            at = self.held.find(marker) if marker else -1
            before = self.held[:at] if at >= 0 else self.held[:len(self.held) - partial(self.held, OPEN)]
            if marker == OPEN and before.strip():
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


def split(text: str, thinking: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a whole reply."""
    stream = ThinkStream(thinking)
    parts = stream.feed(text) + stream.finish()
    return ("".join(t for kind, t in parts if kind == "thinking"), "".join(t for kind, t in parts if kind == "text"))
