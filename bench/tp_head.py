"""Tensor parallel's output head, replicated against split over the vocabulary, measured per token on N processes
(gloo, one thread each): the replicated head multiplies the whole [vocab, hidden] weight on every rank; the split
head multiplies vocab/N rows and all-gathers the logits. Prints ms per token for each and the bytes per rank.

    python bench/tp_head.py [--ranks 2] [--reps 50]
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {"SmolLM2-135M": (49152, 576), "TinyLlama-1.1B": (32000, 2048)}


def head(mode: str, vocab: int, hidden: int):
    from dense_engine.cpu import kernels, quantized

    if mode == "float32":
        layer = kernels.Linear(hidden, vocab, bias=False) if kernels.available() else torch.nn.Linear(hidden, vocab,
                                                                                                       bias=False)
        return layer.requires_grad_(False)
    cls = {"int8": quantized.Int8Linear, "int4": quantized.Int4Linear}[mode]
    layer = cls(hidden, vocab, False)
    for name, t in cls.stored(torch.randn(vocab, hidden) * 0.02).items():
        getattr(layer, name).copy_(t)
    layer.finish_loading()
    return layer


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / reps * 1e3


def worker(rank: int, size: int, port: int, reps: int) -> None:
    import torch.distributed._functional_collectives as funcol

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    for model, (vocab, hidden) in SHAPES.items():
        for mode in ("float32", "int8", "int4"):
            torch.manual_seed(0)
            x = torch.randn(1, 1, hidden)
            whole, part = head(mode, vocab, hidden), head(mode, vocab // size, hidden)

            def split():
                local = part(x)  # [1, 1, vocab/N]  # noqa: B023 (split is timed here, in this iteration)
                gathered = funcol.all_gather_single(local.reshape(1, -1), 0, dist.group.WORLD)  # [N, vocab/N]
                return funcol.wait_tensor(gathered).reshape(1, 1, -1)

            replicated_ms, split_ms = timed(lambda: whole(x), reps), timed(split, reps)  # noqa: B023 (timed here)
            nbytes = lambda m: sum(t.numel() * t.element_size() for t in m.state_dict().values())
            if rank == 0:
                print(f"{model:15} {mode:8} replicated {replicated_ms:7.3f} ms  split {split_ms:7.3f} ms  "
                      f"({split_ms / replicated_ms:.2f}x)  head MiB per rank {nbytes(whole) / 2**20:6.1f} -> "
                      f"{nbytes(part) / 2**20:6.1f}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.ranks, port, args.reps), nprocs=args.ranks)


if __name__ == "__main__":
    main()
