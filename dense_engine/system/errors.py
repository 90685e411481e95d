"""errors.py: the errors a person reads, and the one way the programs report them: a user's mistake is one line on
stderr and exit status 2; a bug of ours is one line too, naming its type (`--debug` shows the traceback instead);
Ctrl-C exits 130, SIGTERM or SIGHUP 128 + the signal. Imports nothing of the project.
"""

from __future__ import annotations

import sys


class UsageError(Exception):
    """Bad input from the user (a flag, a file, a prompt): printed as one line, exit status 2."""


class CheckpointError(ValueError):
    """A checkpoint or config that cannot be used; the message is one line naming the file and what is wrong."""


class Terminated(Exception):
    """SIGTERM or SIGHUP: unwind (the terminal restored, written lines whole) and exit 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def first_line(e: BaseException, limit: int | None = 200) -> str:
    """An exception's message as one line: its first non-empty one (its type's name when it has no message), at most
    limit characters."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0].strip()[:limit]


def leave(code: int):
    """End the program now with status `code`: atexit's handlers run and stdout and stderr are flushed, then the process
    ends without the interpreter's teardown (freeing torch's modules and objects one at a time: 0.3-0.5 s after a
    one-shot's answer, BENCHMARKS.md). For a program whose own files are closed by the time it returns (chat.py)."""
    import atexit
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (a reader gone: a closed pipe)
            pass
    os._exit(code)


def run_program(work, argv: list[str], signals: bool = False) -> int:
    """Run work() -> exit status as a program: a UsageError, CheckpointError, ValueError or OSError (and
    becomes `error: <one line>` and status 2; any other exception `error: <type>: <one line> (--debug shows where)`.
    With --debug in argv every error raises with its traceback. signals: SIGTERM and SIGHUP unwind the program
    (Terminated). (Each message is one write: the ranks of a tensor-parallel run share stderr.)"""
    import signal

    def on_signal(signum, frame):
        raise Terminated(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP) if signals else ():
        signal.signal(sig, on_signal)
    try:
        return work()
    except (UsageError, CheckpointError, ValueError, OSError) as e:
        if "--debug" in argv:
            raise
        sys.stderr.write(f"error: {first_line(e, None)}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated as e:
        return 128 + e.signum
    except Exception as e:  # anything else is a bug of ours: still one line, the traceback with --debug
        if "--debug" in argv:
            raise
        sys.stderr.write(f"error: {type(e).__name__}: {first_line(e, None)} (--debug shows where)\n")
        return 2
