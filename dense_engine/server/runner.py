"""The scheduler's model calls, by name. Under tensor parallel (torchrun) rank 0 sends each call's name and
arguments to the other ranks, which make the same call on their shards (follow); one process: the call alone."""

from __future__ import annotations

import torch

from dense_engine.runtime import generate, tp


class ModelCalls:
    """prefill, prefill_rows and decode over one generate.Runner (its eager or compiled steps), made on every rank."""

    def __init__(self, runner: generate.Runner) -> None:
        self.runner = runner
        self.device = runner.model.device

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

    def prefill(self, row: int, prompt: list[int], every: bool, start: int) -> torch.Tensor:
        """A prompt (or a chunk of it) into cache row `row` from slot `start`: the last token's logits [1, V] (every:
        each token's, [1, T, V])."""
        return self.runner.prefill(torch.tensor([prompt], device=self.device), start, None,
                                   rows=torch.tensor([row], device=self.device), every=every)

    def prefill_rows(self, rows: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Several rows' chunks in one pass: each chunk's last logits [B, V]."""
        return self.runner.prefill_rows(chunks, starts, torch.tensor(rows, device=self.device))

    def decode(self, tokens: list[int], positions: list[int], sampling: generate.Sampling, with_logits: bool):
        """One step of rows 0..B-1, token b at positions[b]: the next tokens [B, 1] (and the logits [B, V])."""
        return self.runner.decode(torch.tensor(tokens, device=self.device)[:, None], positions, None, sampling,
                                  with_logits)
