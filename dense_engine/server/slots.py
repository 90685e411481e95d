"""llama-server's slot files: POST /slots/{id}?action=save|restore|erase, {"filename": NAME} -> a cache row's tokens
and their keys and values written to, or read from, a file of the --slot-save-path folder (names only: no path from
the client reaches the disk), or the row's cache forgotten. A restored row serves the next request whose prompt
starts with those tokens (the scheduler's prefix reuse) without prefilling them.

The file is runtime/caches.py's, for the whole row (the tokens, each layer's keys and values of their slots,
a digest of their bytes) with the model's key in its metadata: a file saved by another model, quantization, dtype or
cache layout is refused, not read into the row. The work runs on the scheduler's thread (Scheduler.call_soon), on a
row no request holds."""

from __future__ import annotations

import asyncio
import os
import time

from dense_engine.runtime import caches, tp
from dense_engine.server.protocol import BadRequest

ACTIONS = ("save", "restore", "erase")


def slot_file(folder: str, body: dict) -> str:
    """The path of the body's "filename" in folder: a plain name (no folder, no '..', no hidden file)."""
    name = body.get("filename")
    if not isinstance(name, str) or not name or len(name) > 255 or name != os.path.basename(name) \
            or name.startswith(".") or "\\" in name or "\0" in name:
        raise BadRequest("'filename' must be a file name (no folder, not hidden, at most 255 characters)",
                         "filename")
    return os.path.join(folder, name)


async def act(server, row: str, action: str | None, body: dict) -> dict:
    """The route's answer (app.py's slots route): the row and the name checked here, the work done on the
    scheduler's thread."""
    folder = getattr(server.args, "slot_save_path", None)
    if not folder:
        raise BadRequest("this server keeps no slot files: start it with --slot-save-path DIR", status=501,
                         kind="not_supported_error")
    if tp.world()[1] > 1:
        raise BadRequest("slot files are not served under torchrun (tensor parallel)", status=501,
                         kind="not_supported_error")
    scheduler = server.scheduler
    if scheduler.whole_rows:
        raise BadRequest("slot files are not served for a model with state layers (Gated DeltaNet, short conv) yet",
                         status=501, kind="not_supported_error")
    if action not in ACTIONS:
        raise BadRequest(f"'action' must be one of {', '.join(ACTIONS)}, got {action!r}", "action")
    if not row.isdigit() or int(row) >= len(scheduler.requests):
        raise BadRequest(f"slot id must be in 0..{len(scheduler.requests) - 1}, got {row!r}", "id_slot")
    row, files = int(row), SlotFiles(scheduler)
    if action == "erase":
        return await files.on_scheduler(lambda: {"id_slot": row, "n_erased": files.erase(row)})
    path = slot_file(folder, body)
    work = files.save if action == "save" else files.restore
    return await files.on_scheduler(lambda: work(row, path))


class SlotFiles:
    """A scheduler's rows to and from slot files; each call runs on the scheduler's thread, on a row no request
    holds."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler

    async def on_scheduler(self, function):
        """function()'s result, run between two turns; its ValueError a 400 naming the slot."""
        try:
            return await asyncio.wrap_future(self.scheduler.call_soon(function))
        except ValueError as e:
            raise BadRequest(str(e), "id_slot") from None

    def idle(self, row: int) -> None:
        if self.scheduler.rows[row].request is not None:
            raise ValueError(f"slot {row} is running a request; try again when it is done")

    def save(self, row: int, path: str) -> dict:
        """The row's tokens and their keys and values into the file (a temporary file, then renamed)."""
        self.idle(row)
        scheduler = self.scheduler
        if scheduler.rows[row].adapters:
            raise ValueError(f"slot {row} holds keys and values of a LoRA adapter's request; a slot file keeps the "
                             "base model's")
        start, tokens = time.perf_counter(), list(scheduler.rows[row].tokens)
        layers = scheduler.calls.row_slots(row, caches.whole_slots(len(tokens)))
        written = caches.write(path, tokens, layers, {"model": scheduler.model_key()})
        return {"id_slot": row, "filename": os.path.basename(path), "n_saved": len(tokens), "n_written": written,
                "timings": {"save_ms": (time.perf_counter() - start) * 1000}}

    def restore(self, row: int, path: str) -> dict:
        """The file's tokens and their keys and values into the row, when this model saved it."""
        self.idle(row)
        scheduler = self.scheduler
        start, name = time.perf_counter(), os.path.basename(path)
        like = scheduler.calls.row_slots(row, 0)
        try:
            tokens, layers = caches.read_whole(path, like, scheduler.model_key(), scheduler.max_seq_len + 1)
        except FileNotFoundError:
            raise ValueError(f"no slot file {name!r}") from None
        except (ValueError, OSError) as e:
            raise ValueError(f"slot file {name!r}: {caches.first_words(e)}") from None
        scheduler.calls.put_row(row, layers)
        scheduler.rows[row].tokens, scheduler.rows[row].adapters = tokens, ()
        return {"id_slot": row, "filename": name, "n_restored": len(tokens), "n_read": os.path.getsize(path),
                "timings": {"restore_ms": (time.perf_counter() - start) * 1000}}

    def erase(self, row: int) -> int:
        self.idle(row)
        cache_row = self.scheduler.rows[row]
        erased, cache_row.tokens, cache_row.adapters = len(cache_row.tokens), [], ()
        return erased
