"""What the scheduler's rows keep for later requests: a row's cache keeps the tokens of its last request, and the
prefix cache keeps, in the prefix store (prefix_store.py) and its disk, whole blocks of what rows held before they
were overwritten; a later choice of a prompt copies its first choice's row. It runs on the scheduler's thread, over
the rows it is given and the model calls (runner.ModelCalls, where the blocks' tensors live). The store keys blocks
by their tokens alone: it keeps and gives the prefixes of requests without LoRA adapters (a row with an adapter is
reused by the same adapter's next request only: scheduler.pick_row)."""

from __future__ import annotations

import os
from collections.abc import Callable

import dense
from dense_engine.runtime import caches, tp
from dense_engine.server.prefix_store import STATE_EVERY, DiskStore, PrefixStore, default_capacity_mb, default_disk_mb
from dense_engine.server.records import Request, Row, Status
from dense_engine.server.runner import ModelCalls
from dense_engine.system import machine


class PrefixCache:
    """The prefix store (None: no reuse, or no room) and its disk tier (None: none; prefixes used more than once,
    kept across restarts, no states yet), their blocks copied through the model calls. capacity_mb None: the
    default (default_capacity_mb); disk_mb 0: no disk, None: the default; key(): the model's key (the disk's
    folder)."""

    def __init__(self, model: dense.DenseDecoder, calls: ModelCalls, reuse: bool, capacity_mb: int | None,
                 disk_mb: int | None, block: int, key: Callable[[], str]) -> None:
        self.calls, self.metrics = calls, None  # (metrics: the scheduler's, set with it)
        if capacity_mb is None:
            capacity_mb = default_capacity_mb()
        whole_rows = caches.has_state(model)  # (a row's state is where it ends: the row reused whole or not)
        self.store = PrefixStore(capacity_mb << 20, token_bytes(model), block, caches.states_bytes(model)) \
            if reuse and capacity_mb else None
        self.states_kept = self.store is not None and whole_rows  # (at snapshot points: keep_state)
        self.disk = None
        if self.store is not None and disk_mb != 0 and tp.world()[1] == 1 and machine.unwritable_cache() is None \
                and not whole_rows:
            self.disk = DiskStore(os.path.join(machine.cache_dir(), "prefixes"), (disk_mb or default_disk_mb()) << 20,
                                  lambda: f"{key()}-{block}")
            calls.disk = self.disk

    def stored(self, request: Request) -> int:
        """How many of the prompt's first tokens the store and its disk hold, in whole blocks (0: none, or echo,
        whose logprobs need every prompt position computed); nothing is read or touched (schedule() plans with it)."""
        store, disk = self.store, self.disk
        if store is None or request.echo or request.adapters:
            return 0
        limit, size = len(request.prompt) - 1, store.block  # (the last token is prefilled: its logits give the first)
        have = len(store.match(request.prompt, limit, touch=False))
        if disk is not None and disk.folder is not None:
            for end in range((have + 1) * size, limit + 1, size):
                if not os.path.exists(disk.path(request.prompt[:end])):
                    break
                have += 1
        return have * size

    def keep(self, row: int, cache_row: Row, common: int) -> None:
        """Before row's cache is overwritten past its first `common` tokens: its whole blocks into the prefix store
        (those not there yet; the least recently used go to make room)."""
        tokens = cache_row.tokens
        if self.store is None or len(tokens) <= common or len(tokens) < self.store.block or self.states_kept \
                or cache_row.adapters:
            return  # (a state model's blocks were kept as its prefill passed them, keep_state; an adapter's: not kept)
        self.keep_blocks(row, tokens)

    def snapshots(self, request: Request) -> list[int]:
        """Where a state model's prefill of request stops to keep its state: every STATE_EVERY blocks, and the
        prompt's last whole block (its last token is prefilled after it: its logits give the first new token); none
        for a model without state layers, or an echo."""
        if not self.states_kept or request.echo:
            return []
        block, length = self.store.block, len(request.prompt)
        last = (length - 1) // block * block
        return sorted(set(range(STATE_EVERY * block, length, STATE_EVERY * block)) | ({last} if last else set()))

    def keep_state(self, row: int, request: Request, end: int) -> None:
        """A state model's row prefilled with request's prompt up to `end`: at a snapshot point, its blocks up to
        there into the store, and its state (now after token end - 1) with the last of them."""
        if end not in self.snapshots(request) or request.adapters:
            return
        store, tokens = self.store, request.prompt[:end]
        blocks, evicted = store.add(tokens)
        held, more = store.hold_state(tokens)
        if blocks or evicted or more or held is not None:
            self.calls.call("keep", row=row, blocks=blocks, size=store.block, drop=evicted + more, state=held)
        if self.metrics is not None:
            self.metrics.evictions.inc(len(evicted) + len(more))

    def keep_blocks(self, row: int, tokens: list[int]) -> None:
        """The whole blocks of `tokens` (row's first ones) into the store, those not there yet."""
        store = self.store
        blocks, evicted = store.add(tokens)
        if blocks or evicted:
            self.calls.call("keep", row=row, blocks=blocks, size=store.block, drop=evicted)
        if self.metrics is not None:
            self.metrics.evictions.inc(len(evicted))

    def persist(self, row: int, cache_row: Row) -> None:
        """A prefix used again (what the new request found in its row or the store): its whole blocks onto the disk,
        those not there yet (the writer's thread writes them)."""
        store, disk = self.store, self.disk
        tokens, size = cache_row.tokens, store.block if store else 0
        if disk is None or len(tokens) < size or disk.folder is None or cache_row.adapters:
            return
        self.keep_blocks(row, tokens)
        chain = store.match(tokens, len(tokens))
        new = [(i, b) for i, b in enumerate(chain) if not b.on_disk]
        if not new:
            return
        self.calls.call("write_blocks", blocks=[(b.id, disk.path(tokens[:(i + 1) * size]), tokens[:(i + 1) * size])
                                                for i, b in new])
        for _, b in new:
            b.on_disk = True

    def restore(self, row: int, request: Request, common: int) -> int:
        """How many of the prompt's first tokens row holds once the prefix store's longest match is copied in (when
        it is longer than the `common` ones the row holds already); 0 when the store has nothing longer."""
        store, disk = self.store, self.disk
        if store is None or request.echo or request.adapters:
            return 0
        limit = len(request.prompt) - 1  # (the last token is prefilled: its logits give the first new token)
        chain = store.match(request.prompt, limit)
        if disk is not None and disk.folder is not None and self.read_disk(request.prompt, len(chain), limit):
            chain = store.match(request.prompt, limit)
        size = store.block
        if len(chain) * size <= common:
            return 0
        first = common // size  # (blocks before it: the row holds them already)
        self.calls.call("restore", row=row, blocks=[b.id for b in chain[first:]], start=first * size)
        return len(chain) * size

    def read_disk(self, prompt: list[int], have: int, limit: int) -> int:
        """Read into the store the blocks that follow the prompt's first `have` stored ones, as far as the disk has
        them (within `limit` tokens): how many were read."""
        store, disk, metrics = self.store, self.disk, self.metrics
        size, ends = store.block, []
        for end in range((have + 1) * size, limit + 1, size):
            if not os.path.exists(disk.path(prompt[:end])):
                break
            ends.append(end)
        if not ends:
            return 0
        new, evicted = store.add(prompt[:ends[-1]])
        files = [(i, disk.path(prompt[:start + size]), prompt[:start + size]) for i, start in new]
        read = self.calls.call("read_blocks", blocks=files, size=size, drop=evicted)
        store.drop([i for i, _ in new[read:]][::-1])  # (missing or damaged: not kept)
        for block in store.match(prompt, ends[-1]):
            block.on_disk = True
        if metrics is not None:
            metrics.evictions.inc(len(evicted))
            metrics.disk_tokens.inc(read * size)
        return read

    def share_prefills(self, rows: list[Row]) -> None:
        """Rows whose request is a later choice of a prompt the first choice has prefilled: that row's keys and values
        copied in, whole blocks of 16 slots up to the prompt's last token (prefilled here: its logits start this
        choice), when that row still holds them; else the choice prefills its prompt itself."""
        for row, cache_row in enumerate(rows):
            request = cache_row.request
            if request is None or request.follows is None or request.status is not Status.PREFILLING \
                    or request.waits:
                continue
            source, end = request.follows.row, (len(request.prompt) - 1) // 16 * 16
            if len(cache_row.tokens) < end and source >= 0 and rows[source].tokens[:end] == request.prompt[:end]:
                self.calls.call("copy_row", source=source, row=row, end=end)
                cache_row.tokens = request.prompt[:end]
            request.follows = None  # (done: it prefills the rest)

    def clear(self) -> None:
        """Drop every block the store holds (and the model calls' copies of them)."""
        if self.store is not None:
            self.calls.call("keep", row=0, blocks=[], size=self.store.block, drop=self.store.clear())


def token_bytes(model: dense.DenseDecoder) -> int:
    """Bytes of one slot's keys and values (and an int8 cache's scales) in every attention layer's cache."""
    parts = [t for memory in caches.key_memories(model) for t in memory.slots(0, 0, 16)]  # (whole key blocks)
    return sum(t.numel() * t.element_size() for t in parts) // 16
