"""The prefix store: prompts' keys and values kept in host memory beyond the cache's rows (the scheduler's block
manager).

A row keeps its last request's tokens in its cache, so the next turn of that conversation prefills only its new
tokens, until another request takes the row. Before that, the scheduler keeps what the row held here: its tokens in
blocks of BLOCK, each block keyed by its parent block and its own tokens (a chain from the first token: a block
stands for the whole prefix that ends with it). A new request looks its prompt up block by block, and takes the
longest stored prefix when it is longer than what its row already holds: the blocks are copied into its row and only
the rest is prefilled. A key holds the tokens themselves, not a hash of them, so two prompts never share a block
unless they share every token before its end.

This index lives with the prefix cache (prefixes.PrefixCache); the blocks' tensors live with the model calls
(runner.ModelCalls.keep and restore: under tensor parallel every rank keeps its own shards of the same blocks). The
store is bounded by bytes: the least recently used block that no other block continues goes first.

A model with state layers (Gated DeltaNet, short conv) holds a state where its tokens end, not per slot: its prefill
stops at snapshot points (every STATE_EVERY blocks, and a prompt's last whole block), where the scheduler keeps the
row's blocks up to there and the state after them (hold_state). A prefix is then reused up to its last block that
holds a state, never further."""

from __future__ import annotations

import array
import hashlib
import os
import queue
import sys
import threading
from dataclasses import dataclass

import torch

from dense_engine.runtime import caches
from dense_engine.system import machine

BLOCK = 64  # tokens a block: a multiple of the CPU cache's 16-slot key blocks (caches.CPUKVCache)
STATE_EVERY = 4  # blocks between a state model's snapshot points (a state costs as much as many blocks of keys)


@dataclass(eq=False)
class Block:
    id: int
    key: tuple  # (the parent block's id, -1 for the first block; its BLOCK tokens)
    parent: Block | None
    used: int = 0  # when it was last matched or kept (the store's clock): least recently used out first
    children: int = 0  # blocks that continue it: only a block with none may go (its chain stays whole)
    on_disk: bool = False  # written to the disk tier (DiskStore) already
    state: bool = False  # a state model's state after its last token is kept with it


class PrefixStore:
    """The blocks kept (index), of `block` tokens each (a multiple of 16), their bytes bounded by `capacity`;
    `bytes_per_token`: of every attention layer's keys and values of one slot; `state_bytes`: of a state model's
    state (0: a model without state layers)."""

    def __init__(self, capacity: int, bytes_per_token: int, block: int = BLOCK, state_bytes: int = 0) -> None:
        self.capacity, self.block, self.block_bytes = capacity, block, block * bytes_per_token
        self.state_bytes = state_bytes
        self.index: dict[tuple, Block] = {}
        self.clock = self.next_id = self.evictions = self.states = 0

    @property
    def bytes(self) -> int:
        return len(self.index) * self.block_bytes + self.states * self.state_bytes

    def match(self, tokens: list[int], limit: int, touch: bool = True) -> list[Block]:
        """The stored blocks holding tokens' first whole blocks, in order, within the first `limit` tokens (touch:
        now the most recently used); a state model's chain ends at its last block holding a state."""
        chain = self.stored(tokens, limit)
        while self.state_bytes and chain and not chain[-1].state:
            chain.pop()
        if touch:
            self.touch(chain)
        return chain

    def stored(self, tokens: list[int], limit: int) -> list[Block]:
        """Every stored block of tokens' first whole blocks within `limit`, in order."""
        chain: list[Block] = []
        for start in range(0, limit - self.block + 1, self.block):
            block = self.index.get((chain[-1].id if chain else -1, tuple(tokens[start:start + self.block])))
            if block is None:
                break
            chain.append(block)
        return chain

    def add(self, tokens: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
        """Keep tokens' whole blocks: returns (the new blocks to fill, (id, first slot) each; the blocks evicted to
        make room, ids). Blocks already stored are only touched; when no room can be made without evicting this
        chain's own blocks, the rest is not kept."""
        chain = self.stored(tokens, len(tokens))
        self.touch(chain)
        new, evicted = [], []
        for start in range(len(chain) * self.block, len(tokens) - self.block + 1, self.block):
            if not self.make_room(self.block_bytes, chain, evicted):
                return new, evicted
            parent = chain[-1] if chain else None
            block = Block(self.next_id, (parent.id if parent else -1, tuple(tokens[start:start + self.block])), parent)
            self.next_id += 1
            self.index[block.key] = block
            if parent is not None:
                parent.children += 1
            chain.append(block)
            self.touch([block])
            new.append((block.id, start))
        return new, evicted

    def hold_state(self, tokens: list[int]) -> tuple[int | None, list[int]]:
        """The last block of tokens (whole blocks, stored by add) holds the state after them: (its id, to fill; None
        when it holds one already or no room can be made; the blocks evicted to make room, ids)."""
        chain, evicted = self.stored(tokens, len(tokens)), []
        if len(chain) * self.block != len(tokens) or not chain or chain[-1].state:
            return None, evicted
        if not self.make_room(self.state_bytes, chain, evicted):
            return None, evicted
        chain[-1].state = True
        self.states += 1
        return chain[-1].id, evicted

    def make_room(self, size: int, keep: list[Block], evicted: list[int]) -> bool:
        """Evict least recently used leaves outside `keep` (their ids onto `evicted`) until `size` more bytes fit."""
        while self.bytes + size > self.capacity:
            victim = self.least_recent(keep)
            if victim is None:
                return False
            evicted.append(self.evict(victim))
            self.evictions += 1
        return True

    def least_recent(self, keep: list[Block]) -> Block | None:
        """The least recently used block that no block continues, outside `keep`."""
        protected = {id(b) for b in keep}
        leaves = [b for b in self.index.values() if not b.children and id(b) not in protected]
        return min(leaves, key=lambda b: b.used, default=None)

    def evict(self, block: Block) -> int:
        del self.index[block.key]
        self.states -= block.state
        if block.parent is not None:
            block.parent.children -= 1
        return block.id

    def drop(self, ids: list[int]) -> None:
        """Remove these blocks (the last of a chain first)."""
        by_id = {b.id: b for b in self.index.values()}
        for i in ids:
            self.evict(by_id[i])

    def clear(self) -> list[int]:
        """Drop every block: their ids."""
        ids = [b.id for b in self.index.values()]
        self.index.clear()
        self.states = 0
        return ids

    def touch(self, blocks: list[Block]) -> None:
        self.clock += 1
        for block in blocks:
            block.used = self.clock


def default_capacity_mb() -> int:
    """4 GiB, or a quarter of the host memory available now when that is less (the store fills only as
    conversations come; the cache's rows already took their share)."""
    return max(64, min(4096, machine.available_memory(torch.device("cpu")) // 4 >> 20))


def default_disk_mb() -> int:
    """8 GiB, or a quarter of the cache folder's free disk when that is less."""
    import shutil

    folder = machine.cache_dir()
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return max(64, min(8192, shutil.disk_usage(folder).free // 4 >> 20))


# ---- the disk: blocks of prefixes used more than once, kept across restarts

class DiskStore:
    """Blocks written to `folder` (one per model: its name is the model's key, so a changed model, quantization,
    dtype or cache layout never reads another's), a file each, named by a digest of the whole prefix the block ends
    and holding those tokens (a file whose tokens are not the prompt's is never used), bounded by `capacity` bytes:
    the least recently used files go first. Files are written by a thread of their own (the scheduler does not wait
    on the disk): a temporary file, then a rename, so a reader sees a whole file or none."""

    def __init__(self, root: str, capacity: int, key) -> None:
        """root: the folder of every model's folder; key(): the model's key (model_key: its weights' digest, taken
        by a thread of its own while the server warms up)."""
        self.capacity, self.named = capacity, threading.Event()
        self.jobs: queue.Queue = queue.Queue()

        def name() -> None:
            try:
                self._folder = os.path.join(root, key())
            except Exception as e:  # noqa: BLE001 (no key, no disk: the store stays in memory, with a note)
                self._folder = None
                print(f"note: the prefix store keeps nothing on disk: {type(e).__name__}: {e}", file=sys.stderr)
            self.named.set()

        threading.Thread(target=name, name="prefix-key", daemon=True).start()
        threading.Thread(target=self.write_all, name="prefix-writer", daemon=True).start()

    @property
    def folder(self) -> str | None:
        """The model's folder (None: its key could not be made); waits for the key."""
        self.named.wait()
        return self._folder

    def path(self, tokens: list[int]) -> str:
        digest = hashlib.sha256(array.array("i", tokens).tobytes()).hexdigest()[:40]
        return os.path.join(self.folder, digest + ".safetensors")

    def write(self, path: str, tokens: list[int], layers: list[tuple[torch.Tensor, ...]]) -> None:
        """Queue a block (each layer's (k, v), never changed after: the writer reads them later)."""
        self.jobs.put((path, tokens, layers))

    def write_all(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                caches.write(*job)
                if self.jobs.qsize() == 0:  # (the folder scanned once a batch of blocks, not once a block)
                    self.trim()
            except OSError as e:  # (a full or read-only disk: the blocks stay in memory, nothing else changes)
                print(f"note: the prefix store could not write {job[0]}: {e}", file=sys.stderr, flush=True)
            finally:
                self.jobs.task_done()

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self.jobs.join()

    def trim(self) -> None:
        """Delete the least recently used files while the folder holds more than its bound."""
        files = []
        os.makedirs(self.folder, exist_ok=True)
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".safetensors"):
                stat = entry.stat()
                files.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.capacity:
                break
            os.remove(path)
            total -= size


def read_block(path: str, tokens: list[int], like: list[tuple[torch.Tensor, ...]]):
    """The block's (k, v) per layer when the file holds exactly `tokens` and tensors shaped as `like`'s, whole
    (its digest holds); else None (a damaged or foreign file is deleted)."""
    try:
        stored, layers, _ = caches.read(path, like)
    except FileNotFoundError:
        return None
    except (ValueError, OSError):  # (truncated, damaged, another layout: written again when next used)
        try:
            os.remove(path)
        except OSError:
            pass
        return None
    if stored != list(tokens) or any(t.shape != u.shape for ts, us in zip(layers, like) for t, u in zip(ts, us)):
        return None  # (another prefix with the same digest: never mixed in)
    os.utime(path)  # (recently used: trimmed last)
    return layers
