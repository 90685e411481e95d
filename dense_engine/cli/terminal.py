"""terminal.py: what chat.py's interactive mode does at the terminal: reading messages with line editing and a
history that outlives the program, and showing replies as Markdown while they stream.

Input: GNU readline (the standard library's) edits the line and recalls earlier messages with the arrow keys; the
history is kept in the cache folder. A pasted block of several lines is one message: lines already waiting on the
terminal when one is read belong to it. To type several lines, end each but the last with a backslash.
Output: on a terminal, a reply is rendered as Markdown (code highlighted) in a rich Live view that redraws as tokens
arrive, with a dim status line under it; piped, on a dumb terminal, or with --plain it streams as plain text.
Imports nothing of the project (readline, termios and rich only).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time

from dense_engine.runtime import reasoning

try:
    import readline
    import termios
except ImportError:  # (not on every platform: plain input() then)
    readline = termios = None


class LineReader:
    def __init__(self, history_file: str | None, terminal: bool) -> None:
        self.history_file, self.terminal = history_file, terminal
        if readline is not None and history_file and terminal:
            readline.set_history_length(1000)
            try:
                readline.read_history_file(history_file)
            except OSError:  # none yet, or unreadable: start empty
                pass

    def read(self, prompt: str) -> str:
        """One message: a line, the lines pasted with it, and the lines a trailing backslash continues to."""
        lines = [input(prompt)]
        while True:
            if lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1]
                lines.append(input("... "))
            elif self.terminal and self.waiting():
                lines.append(input(""))
            else:
                break
        if len(lines) > 1 and readline is not None and self.terminal:  # one history entry for the whole message
            for _ in range(min(len(lines), readline.get_current_history_length())):
                readline.remove_history_item(readline.get_current_history_length() - 1)
            readline.add_history("\n".join(lines))
        return "\n".join(lines)

    def waiting(self) -> bool:
        """Whether more input has already arrived (the rest of a paste; typing is far slower than 20 ms)."""
        try:
            return bool(select.select([sys.stdin], [], [], 0.02)[0])
        except (OSError, ValueError):
            return False

    def save(self) -> None:
        if readline is None or not self.history_file or not self.terminal:
            return
        tmp = f"{self.history_file}.{os.getpid()}.tmp"
        try:  # written aside, then renamed: a run killed while writing leaves the old history whole
            os.makedirs(os.path.dirname(self.history_file), exist_ok=True)
            readline.write_history_file(tmp)
            os.replace(tmp, self.history_file)
        except OSError:  # a read-only cache: the history is only lost (said once at the start)
            if os.path.exists(tmp):
                os.unlink(tmp)


class CtrlCRemembered:
    """Ctrl-C in one process: KeyboardInterrupt, as Python's own handler raises it, and remembered until the next
    prompt (line()); the reply's token loop looks after each token (pressed()). Python prints and drops an interrupt
    that lands in a finalizer, and the reply would otherwise run on to its end."""

    def __init__(self) -> None:
        self.seen = False

    def start(self) -> None:
        signal.signal(signal.SIGINT, self.on_signal)

    def on_signal(self, signum, frame) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def line(self) -> None:
        self.seen = False

    def pressed(self) -> bool:
        return self.seen

    def restore(self) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class CtrlCAsKey:
    """Ctrl-C for rank 0 under torchrun, which runs every rank in a session of its own and takes the terminal's
    SIGINT itself (it ends the whole job). While the session runs, rank 0 turns the terminal's signal keys off (ISIG),
    so Ctrl-C arrives as the byte 0x03: at the prompt readline turns it into Ctrl-D on an emptied line (the session
    ends, as Ctrl-C at the prompt ends it in one process); during a reply the terminal hands keys over as they are
    typed and rank 0 looks for it between tokens (pressed()), and every rank stops at the same token. SIGTERM or
    SIGHUP (torchrun ending the job) restore the terminal first."""

    def __init__(self, fd: int) -> None:
        self.fd, self.saved, self.keys = fd, termios.tcgetattr(fd), False

    @staticmethod
    def wanted(rank: int, size: int) -> bool:
        return size > 1 and rank == 0 and readline is not None and sys.stdin.isatty()

    def start(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda signum, frame: (self.restore(), os._exit(128 + signum)))
        readline.parse_and_bind(r'"\C-c": "\C-e\C-u\C-d"')
        readline.set_pre_input_hook(lambda: self.set(None))  # readline turns ISIG on while it reads: off again
        self.line()

    def set(self, keys: bool | None) -> None:
        """ISIG off; keys: one key at a time, unechoed (what was typed before becomes readable too); not keys: lines,
        echoed, as the terminal had them; None: the rest as it is."""
        attrs = termios.tcgetattr(self.fd)
        attrs[3] &= ~termios.ISIG
        if keys:
            attrs[3] &= ~(termios.ICANON | termios.ECHO)
        elif keys is not None:
            attrs[3] |= self.saved[3] & (termios.ICANON | termios.ECHO)
        termios.tcsetattr(self.fd, termios.TCSANOW, attrs)
        self.keys = bool(keys)

    def line(self) -> None:
        """Before a prompt: lines again (readline edits them)."""
        self.set(False)

    def pressed(self) -> bool:
        """Whether Ctrl-C was typed since the reply started or the last look (other keys typed meanwhile are
        dropped)."""
        if not self.keys:
            self.set(True)
        seen = False
        while select.select([self.fd], [], [], 0)[0]:
            data = os.read(self.fd, 256)
            seen = seen or b"\x03" in data
            if not data:
                break
        return seen

    def restore(self) -> None:
        termios.tcsetattr(self.fd, termios.TCSANOW, self.saved)


def prompt_text(console) -> str:
    """The input prompt: bold green on a color terminal (the escapes marked for readline, so it knows the prompt's
    width), plain otherwise."""
    if console.is_terminal and not console.is_dumb_terminal and console.color_system:
        return "\001\033[1;32m\002>>> \001\033[0m\002"
    return ">>> "


class ReplyView:
    """Shows one reply while it streams; write(text) for each piece, finish(stats_line) at the end. thinking (not
    None: a thinking model's reply, True when the prompt opened the thinking): the reasoning is kept apart
    (reasoning.py) and shown dimmed, folded to one line, after the answer."""

    def __init__(self, console, markdown: bool, thinking: bool | None = None,
                 pair: reasoning.Markers = reasoning.THINK) -> None:
        self.console, self.markdown = console, markdown
        self.text, self.pieces, self.start = "", 0, time.perf_counter()
        self.thoughts = reasoning.ThinkStream(thinking, pair) if thinking is not None else None
        self.thought = ""
        self.live = None
        if markdown:
            from rich.live import Live

            self.live = Live(console=console, refresh_per_second=8, vertical_overflow="visible", transient=False)
            self.live.start()

    def write(self, text: str) -> None:
        self.pieces += 1
        parts = self.thoughts.feed(text) if self.thoughts is not None else [("text", text)]
        self.show("".join(t for kind, t in parts if kind == "text"))
        self.thought += "".join(t for kind, t in parts if kind == "thinking")

    def show(self, text: str) -> None:
        self.text += text
        if self.live is None:
            self.console.file.write(text)
            self.console.file.flush()
            return
        rate = self.pieces / max(time.perf_counter() - self.start, 1e-9)
        thinking = f"thinking ({len(self.thought)} characters), " if self.thought and not self.text else ""
        self.live.update(self.render(f"{thinking}{self.pieces} tokens, {rate:.1f} tok/s"))

    def render(self, status: str | None):
        from rich.console import Group
        from rich.markdown import Markdown
        from rich.text import Text

        body = Markdown(self.text, code_theme="monokai")
        return Group(body, Text(status, style="dim")) if status else body

    def finish(self, stats_line: str) -> None:
        if self.thoughts is not None:
            for kind, t in self.thoughts.finish():
                self.thought += t if kind == "thinking" else ""
                self.show(t if kind == "text" else "")
        if self.live is not None:
            self.live.update(self.render(None), refresh=True)
            self.live.stop()
        else:
            self.console.print()
        if self.thought.strip():
            from rich.text import Text

            self.console.print(Text(f"thought: {folded(self.thought, 160)}", style="dim"), soft_wrap=True)
        self.console.print(f"[dim]{stats_line}[/dim]", soft_wrap=True)


def folded(text: str, width: int) -> str:
    """text on one line (its whitespace runs as one space), cut to width characters with an ellipsis."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[:width - 1] + "\u2026"


class Notes:
    """The programs' one-line notes (dim, on the console). While a reply streams (inside `held()`), a note waits and
    is printed after the reply's last line: on a terminal a note printed mid-reply lands inside the answer's words
    (a background compile starts after the first token)."""

    def __init__(self, console) -> None:
        self.console, self.waiting = console, None

    def __call__(self, message: str) -> None:
        if self.waiting is not None:
            self.waiting.append(message)
        else:
            self.console.print(f"[dim]{message}[/dim]", highlight=False)

    @contextlib.contextmanager
    def held(self):
        """A context: the notes of a reply, printed when it ends (after the caller's last write of the reply)."""
        self.waiting = []
        try:
            yield
        finally:
            waiting, self.waiting = self.waiting, None
            for message in waiting:
                self(message)
