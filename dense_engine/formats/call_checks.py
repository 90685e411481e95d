"""The checks of an eager model call, one ValueError each naming what is wrong: token ids inside the vocabulary, no
more tokens than the context, a cache set up before a cached step, its batch, slots and rows. Importing this module
makes them dense.DenseDecoder.check_inputs (checkpoint.py does, so every model a loader reads has them). They read
values (a host sync), so a compiled step skips them."""

import torch

import dense


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_inputs(model: dense.DenseDecoder, input_ids: torch.Tensor, input_pos: torch.Tensor | None,
                 rows: torch.Tensor | None, causal: bool) -> None:
    require(input_ids.ndim == 2 and input_ids.dtype in (torch.int64, torch.int32),
            f"input_ids must be an integer tensor [batch, tokens], got {input_ids.dtype} {list(input_ids.shape)}")
    (B, T), config = input_ids.shape, model.config
    require(T > 0, "input_ids has no tokens")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    require(0 <= lo and hi < config.vocab_size,
            f"token id {lo if lo < 0 else hi} is out of range for the vocabulary of {config.vocab_size}")
    if input_pos is None:
        context = config.max_position_embeddings
        require(T <= context, f"{T} tokens exceed the context of {context}")
        return
    require(model.max_seq_len > 0, "call setup_cache(max_batch_size, max_seq_len) before a cached step (input_pos)")
    require(B <= model.max_batch_size, f"batch {B} exceeds the cache's max_batch_size {model.max_batch_size}")
    require(input_pos.shape in ((T,), (B, T)),
            f"input_pos must have shape [{T}] or [{B}, {T}] (one slot per token), got {list(input_pos.shape)}")
    require(0 <= int(input_pos.min()) and int(input_pos.max()) <= model.max_seq_len,  # slot S: the scratch slot
            f"position {int(input_pos.max())} is outside the cache of {model.max_seq_len} tokens "
            f"(context {config.max_position_embeddings})")
    require(rows is None or (rows.shape == (B,) and int(rows.min()) >= 0 and int(rows.max()) < model.max_batch_size),
            f"rows must be [{B}] cache rows in 0..{model.max_batch_size - 1}")
    require(not causal or (input_pos.ndim == 1 and int(input_pos[0]) == 0 and int(input_pos[-1]) == T - 1),
            "a causal step writes slots 0..T-1 of every row")


dense.DenseDecoder.check_inputs = check_inputs
