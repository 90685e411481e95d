"""What the scheduler's rows keep for later requests: a row's cache keeps the tokens of its last request, and the
prefix store (prefix_store.py) and its disk keep whole blocks of what rows held before they were overwritten. These
functions run on the scheduler's thread, over its rows, store, disk and model calls (scheduler.py). The store keys
blocks by their tokens alone: it keeps and gives the prefixes of requests without LoRA adapters (a row with an adapter
is reused by the same adapter's next request only: pick_row)."""

from __future__ import annotations

import os

from dense_engine.server.prefix_store import STATE_EVERY


def stored(scheduler, request) -> int:
    """How many of the prompt's first tokens the store and its disk hold, in whole blocks (0: none, or echo, whose
    logprobs need every prompt position computed); nothing is read or touched (schedule() plans with it)."""
    store, disk = scheduler.store, scheduler.disk
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


def keep(scheduler, row: int, common: int) -> None:
    """Before row's cache is overwritten past its first `common` tokens: its whole blocks into the prefix store
    (those not there yet; the least recently used go to make room)."""
    tokens = scheduler.slots[row].tokens
    if scheduler.store is None or len(tokens) <= common or len(tokens) < scheduler.store.block \
            or scheduler.states_kept or scheduler.slots[row].adapters:
        return  # (a state model's blocks were kept as its prefill passed them, keep_state; an adapter's: not kept)
    keep_blocks(scheduler, row, tokens)


def snapshots(scheduler, request) -> list[int]:
    """Where a state model's prefill of request stops to keep its state: every STATE_EVERY blocks, and the prompt's
    last whole block (its last token is prefilled after it: its logits give the first new token); none for a model
    without state layers, or an echo."""
    if not scheduler.states_kept or request.echo:
        return []
    block, length = scheduler.store.block, len(request.prompt)
    last = (length - 1) // block * block
    return sorted(set(range(STATE_EVERY * block, length, STATE_EVERY * block)) | ({last} if last else set()))


def keep_state(scheduler, row: int, request, end: int) -> None:
    """A state model's row prefilled with request's prompt up to `end`: at a snapshot point, its blocks up to there
    into the store, and its state (now after token end - 1) with the last of them."""
    if end not in snapshots(scheduler, request) or request.adapters:
        return
    store, tokens = scheduler.store, request.prompt[:end]
    blocks, evicted = store.add(tokens)
    held, more = store.hold_state(tokens)
    if blocks or evicted or more or held is not None:
        scheduler.calls.call("keep", row=row, blocks=blocks, size=store.block, drop=evicted + more, state=held)
    if scheduler.metrics is not None:
        scheduler.metrics.evictions.inc(len(evicted) + len(more))


def keep_blocks(scheduler, row: int, tokens: list[int]) -> None:
    """The whole blocks of `tokens` (row's first ones) into the store, those not there yet."""
    store = scheduler.store
    blocks, evicted = store.add(tokens)
    if blocks or evicted:
        scheduler.calls.call("keep", row=row, blocks=blocks, size=store.block, drop=evicted)
    if scheduler.metrics is not None:
        scheduler.metrics.evictions.inc(len(evicted))


def persist(scheduler, row: int) -> None:
    """A prefix used again (what the new request found in its row or the store): its whole blocks onto the disk,
    those not there yet (the writer's thread writes them)."""
    store, disk = scheduler.store, scheduler.disk
    tokens, size = scheduler.slots[row].tokens, store.block if store else 0
    if disk is None or len(tokens) < size or disk.folder is None or scheduler.slots[row].adapters:
        return
    keep_blocks(scheduler, row, tokens)
    chain = store.match(tokens, len(tokens))
    new = [(i, b) for i, b in enumerate(chain) if not b.on_disk]
    if not new:
        return
    scheduler.calls.call("write_blocks", blocks=[(b.id, disk.path(tokens[:(i + 1) * size]), tokens[:(i + 1) * size])
                                                 for i, b in new])
    for _, b in new:
        b.on_disk = True


def restore(scheduler, row: int, request, common: int) -> int:
    """How many of the prompt's first tokens row holds once the prefix store's longest match is copied in (when it
    is longer than the `common` ones the row holds already); 0 when the store has nothing longer."""
    store, disk = scheduler.store, scheduler.disk
    if store is None or request.echo or request.adapters:
        return 0
    limit = len(request.prompt) - 1  # (the last token is prefilled: its logits give the first new token)
    chain = store.match(request.prompt, limit)
    if disk is not None and disk.folder is not None and read_disk(scheduler, request.prompt, len(chain), limit):
        chain = store.match(request.prompt, limit)
    size = store.block
    if len(chain) * size <= common:
        return 0
    first = common // size  # (blocks before it: the row holds them already)
    scheduler.calls.call("restore", row=row, blocks=[b.id for b in chain[first:]], start=first * size)
    return len(chain) * size


def read_disk(scheduler, prompt: list[int], have: int, limit: int) -> int:
    """Read into the store the blocks that follow the prompt's first `have` stored ones, as far as the disk has them
    (within `limit` tokens): how many were read."""
    store, disk, metrics = scheduler.store, scheduler.disk, scheduler.metrics
    size, ends = store.block, []
    for end in range((have + 1) * size, limit + 1, size):
        if not os.path.exists(disk.path(prompt[:end])):
            break
        ends.append(end)
    if not ends:
        return 0
    new, evicted = store.add(prompt[:ends[-1]])
    files = [(i, disk.path(prompt[:start + size]), prompt[:start + size]) for i, start in new]
    read = scheduler.calls.call("read_blocks", blocks=files, size=size, drop=evicted)
    store.drop([i for i, _ in new[read:]][::-1])  # (missing or damaged: not kept)
    for block in store.match(prompt, ends[-1]):
        block.on_disk = True
    if metrics is not None:
        metrics.evictions.inc(len(evicted))
        metrics.disk_tokens.inc(read * size)
    return read
