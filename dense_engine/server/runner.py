"""The scheduler's model calls, by name. Under tensor parallel (torchrun) rank 0 sends each call's name and
arguments to the other ranks, which make the same call on their shards (follow); one process: the call alone."""

from __future__ import annotations

import torch

from dense_engine.formats import lora
from dense_engine.runtime import caches, generate, tp
from dense_engine.server import prefix_store


class ModelCalls:
    """prefill, prefill_rows and decode over one generate.Runner (its eager or compiled steps), made on every rank;
    keep and restore: the prefix store's blocks (prefix_store.py), this rank's keys and values of them."""

    def __init__(self, runner: generate.Runner) -> None:
        self.runner = runner
        self.device = runner.model.device
        self.kept: dict[int, list[tuple[torch.Tensor, ...]]] = {}  # block id -> each layer's (k, v[, their scales])
        self.states: dict[int, list[torch.Tensor]] = {}  # block id -> a state model's row states after its end
        self.disk: prefix_store.DiskStore | None = None  # (one process only: no disk tier under tensor parallel)
        self.switches = lora.switches(runner.model)  # the linears with LoRA adapters served by name

    def call(self, name: str, **args):
        """Make the call `name` (a method below) here and, under tensor parallel, on every other rank."""
        if tp.world()[1] > 1:
            tp.broadcast((name, args))
        return getattr(self, name)(**args)

    def stop(self) -> None:
        """Rank 0 is done: the other ranks' follow() returns."""
        if tp.world()[1] > 1:
            tp.broadcast(("stop", {}))

    def follow(self) -> None:
        """Ranks other than 0: make every call rank 0 makes, until it stops."""
        while True:
            name, args = tp.broadcast(None)
            if name == "stop":
                return
            getattr(self, name)(**args)

    def prefill(self, row: int, prompt: list[int], every: bool, start: int, adapters: list = ((),)
                ) -> torch.Tensor:
        """A prompt (or a chunk of it) into cache row `row` from slot `start`: the last token's logits [1, V] (every:
        each token's, [1, T, V]). adapters: [the row's adapters' scales] (Request.adapters)."""
        self.switch(adapters)
        return self.runner.prefill(torch.tensor([prompt], device=self.device), start, None,
                                   rows=torch.tensor([row], device=self.device), every=every)

    def prefill_rows(self, rows: list[int], chunks: list[list[int]], starts: list[int], adapters: list = ()
                     ) -> torch.Tensor:
        """Several rows' chunks in one pass: each chunk's last logits [B, V]."""
        self.switch(adapters)
        return self.runner.prefill_rows(chunks, starts, torch.tensor(rows, device=self.device))

    def decode(self, tokens: list[int] | torch.Tensor, positions: list[int], sampling: generate.Sampling,
               with_logits: bool, rows: list[int] | None = None, adapters: list = ()):
        """One step of cache rows `rows` (None: 0..B-1), token b at positions[b]: the next tokens [B, 1] (and the
        logits [B, V]). tokens: ids, or the step before's next tokens [B, 1] on the device (one step behind)."""
        self.switch(adapters)
        token = tokens if torch.is_tensor(tokens) else torch.tensor(tokens, device=self.device)[:, None]
        return self.runner.decode(token, positions, None, sampling, with_logits,
                                  None if rows is None else torch.tensor(rows, device=self.device))

    def switch(self, adapters: list[tuple[float, ...]]) -> None:
        """The next call's rows with their LoRA adapters served by name (lora.switch): adapters[b] for row b of its
        input, () or missing: none."""
        if self.switches:
            lora.switch(self.switches, list(adapters) + [()] * (self.runner.model.max_batch_size - len(adapters)))

    def keep(self, row: int, blocks: list[tuple[int, int]], size: int, drop: list[int], state: int | None = None
             ) -> None:
        """Forget the blocks `drop`, then copy row's slots start..start + size of each new block (id, start) into
        host memory (a state model: its attention layers'); state: the block whose end row's state is at now."""
        for i in drop:
            del self.kept[i]
            self.states.pop(i, None)
        for i, start in blocks:
            self.kept[i] = caches.copy_keys(self.runner.model, row, start, start + size)
        if state is not None:
            self.states[state] = caches.row_states(self.runner.model, row)

    def restore(self, row: int, blocks: list[int], start: int) -> None:
        """Kept blocks, in order, into row's slots from `start` on (a state model: and the last one's state)."""
        layers = [tuple(torch.cat(parts, dim=1) for parts in zip(*(self.kept[i][n] for i in blocks)))  # (dim 1: the
                  for n in range(len(self.kept[blocks[0]]))]  # slots of keys, values, scales in every layout)
        caches.put_keys(self.runner.model, row, start, layers)
        if caches.has_state(self.runner.model):
            caches.put_row_states(self.runner.model, row, self.states[blocks[-1]])

    def copy_row(self, source: int, row: int, end: int) -> None:
        """Row `source`'s keys and values at slots 0..end-1 (a multiple of 16) into row `row`."""
        caches.put_keys(self.runner.model, row, 0, caches.copy_keys(self.runner.model, source, 0, end))

    def read_blocks(self, blocks: list[tuple[int, str, list[int]]], size: int, drop: list[int]) -> int:
        """Forget the blocks `drop`, then read blocks of `size` tokens (id, file, the tokens of the prefix it ends)
        from the disk, in order, until one is missing or not whole: how many were read."""
        for i in drop:
            del self.kept[i]
        like = caches.like(self.runner.model, size)  # (shapes, dtypes)
        for n, (i, path, tokens) in enumerate(blocks):
            layers = prefix_store.read_block(path, tokens, like)
            if layers is None:
                return n
            self.kept[i] = layers
        return len(blocks)

    def write_blocks(self, blocks: list[tuple[int, str, list[int]]]) -> None:
        """Queue kept blocks (id, file, the tokens of the prefix it ends) for the disk."""
        for i, path, tokens in blocks:
            self.disk.write(path, tokens, self.kept[i])

    def row_slots(self, row: int, end: int) -> list[tuple[torch.Tensor, ...]]:
        """Copies, in host memory, of row's keys and values at slots 0..end-1 (end: a multiple of 16)."""
        return caches.copy_slots(self.runner.model, row, 0, end)

    def put_row(self, row: int, layers: list[tuple[torch.Tensor, ...]]) -> None:
        """row_slots' copies into row's slots from 0 on."""
        caches.put_slots(self.runner.model, row, 0, layers)
