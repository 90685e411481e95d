"""serve.py: an OpenAI-compatible HTTP server over the engine, with continuous batching.

    python serve.py [--ckpt DIR] [--port 8000] [--max-batch 8] [--api-key KEY] [chat.py's model flags]
    curl localhost:8000/v1/chat/completions -d '{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: GET /health (200 when the model is ready, 503 before), GET /v1/models, POST /v1/chat/completions and
POST /v1/completions (OpenAI's formats; "stream": true sends server-sent events), POST /tokenize and /detokenize
(llama-server's shapes), POST /slots/{id}?action=save|restore|erase (llama-server's slot files, --slot-save-path),
GET /metrics (Prometheus), GET /lora-adapters (llama-server's: the adapters served by name, --lora NAME=DIR, which a
request picks by its model name or `lora` field). Started with --embedding (or on a folder with sentence-transformers'
modules.json) or --rerank, it serves embeddings or rankings instead of text (embeddings.py).

The rooms, each a module of this folder: protocol.py (a request body -> checked Settings, or an API's error),
records.py (a Request, its Output and Shaping, a Row per cache row), scheduler.py (the turn: schedule -> run ->
postprocess), runner.py (the model calls, by name on every tensor-parallel rank), prefixes.py (what rows keep for
later requests: the prefix store and its disk), responses.py (the events -> each API's chunks and bodies), app.py
(the routes, on Starlette and uvicorn: small, well kept, plain ASGI), metrics.py; this file is the program (flags,
load, signals).

Continuous batching: one scheduler thread owns the model. The KV cache has --max-batch rows; each request gets a row
while it runs (the free row whose cache already holds the longest prefix of its prompt: only the rest is prefilled;
what a row held before another request took it is kept in host memory, the prefix store, --prefix-cache-mb).
Each scheduler turn admits waiting requests, prefills (while other rows stream, at most --prefill-chunk tokens, so a
long prompt goes in chunks between their steps; prompts admitted together in one pass), then runs one decode step
that feeds each busy row its own last token at its own position (an idle or still-prefilling row writes to the
scratch slot). A row is freed when its request ends (end of text, max_tokens, a stop string) or its client goes away;
more requests than rows wait in line (--max-queue). Decoding, a row's result never depends on the others: the CPU
kernels compute each row alone, in the same order whatever the batch; a prompt prefilled in chunks or beside others
may differ in the last bits of its logits from a whole prefill (its greedy text is tested equal). Sampling settings
differ per request: they are inputs of the compiled step, and each request draws its noise from its own generator
(its `seed`). With a draft (--draft, --lookup), one request at a time decodes speculatively in row 0, a round each
turn, while the other rows decode beside it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from dense_engine.formats import preread

if os.path.basename(sys.argv[0]) == "dense-serve":
    preread.start_from_argv(sys.argv[1:])  # (serve.py starts it itself, before this module's imports)

import torch

from dense_engine.cli.flags import add_model_flags, check_environment, load_model, make_draft, parse_flags, positive_int
from dense_engine.formats import lora
from dense_engine.formats.default_model import default_checkpoint
from dense_engine.formats.pooling import Pooling, read_pooling
from dense_engine.formats.vocab import Vocabulary, load_vocabulary
from dense_engine.runtime import caches, tp
from dense_engine.runtime.embedding import Reranker
from dense_engine.runtime.sampling import Defaults, describe
from dense_engine.server.app import make_app
from dense_engine.server.embeddings import Embedder
from dense_engine.server.metrics import Metrics
from dense_engine.server.scheduler import PREFILL_BUDGET, Scheduler
from dense_engine.system.errors import CheckpointError, UsageError, first_line, run_program


class Server:
    """The state the routes share: the scheduler (once the model is loaded), the vocabulary, the model's name."""

    def __init__(self, args) -> None:
        self.args, self.ready, self.error = args, threading.Event(), None
        self.scheduler: Scheduler | None = None
        self.embedder: Embedder | None = None  # (a server that embeds or reranks: no scheduler)
        self.vocab: Vocabulary | None = None
        self.max_seq_len = 0
        self.name = "dense"
        self.adapters: list[tuple[str, str, float]] = []  # LoRA adapters served by name: (name, path, scale)
        self.metrics = Metrics()

    def load(self, console) -> None:
        """Load the model and start the scheduler (a thread of its own; /health answers 503 meanwhile)."""
        args = self.args
        ckpt, self.vocab, model, record = load_for_serving(args, console)
        self.name = os.path.basename(os.path.normpath(ckpt))
        self.adapters = [(name, path, scale) for path, scale, name in record.lora if name]
        self.embedder = pooling_for(args, ckpt, self.vocab, model, record)
        if self.embedder is not None:
            self.max_seq_len = self.embedder.max_tokens
            self.ready.set()
            return
        draft = make_draft(args, model, console, record)
        self.max_seq_len = caches.fitting_cache(model, args.max_batch, record.max_seq_len, record.kv_dtype)
        self.scheduler = Scheduler(model, self.vocab, args.max_batch, self.max_seq_len, record.compile, draft,
                                   args.speculate_k, reuse=args.prefix_reuse, prefill_chunk=args.prefill_chunk,
                                   prefix_cache_mb=args.prefix_cache_mb if args.prefix_cache else 0,
                                   prefix_disk_mb=args.prefix_cache_disk_mb, load=record)
        self.scheduler.warm_up()
        self.scheduler.metrics = self.metrics  # (after the warm-up: its throwaway tokens are not counted)
        self.metrics.watch(self.scheduler)
        self.scheduler.thread.start()
        self.ready.set()


def pooling_for(args, ckpt: str, vocab: Vocabulary, model, record) -> Embedder | None:
    """What a server that embeds or reranks holds (None: it generates): --rerank, a Qwen3-Reranker-style model
    scoring pairs by its "yes" and "no" tokens; --embedding, a folder with sentence-transformers' modules.json or a
    GGUF file with a pooling_type: its pooling (a plain decoder: its last token's hidden state, normalized, as vLLM
    pools one)."""
    pooling = read_pooling(ckpt)
    context = record.max_seq_len or model.config.max_position_embeddings  # (no cache: a text's tokens at most)
    if args.rerank:
        reranker = Reranker.of(vocab)
        if reranker is None:
            raise UsageError(f"--rerank: {ckpt}'s vocabulary has no 'yes' and 'no' tokens (a reranker in "
                             "Qwen3-Reranker's format answers with them)")
        return Embedder(model, vocab, None, reranker, context)
    if not args.embedding and pooling is None:
        return None
    if pooling is None:
        print("note: no modules.json: embeddings are the last token's final hidden state, normalized",
              file=sys.stderr, flush=True)
    return Embedder(model, vocab, pooling or Pooling("lasttoken", normalize=True), None, context)


def load_for_serving(args, console, rank0: bool = True) -> tuple:
    """(the checkpoint, its vocabulary, the model, its LoadRecord): what every rank loads (rank 0 says what it
    loaded)."""
    if rank0:
        check_environment(args, console)
    ckpt = args.ckpt or default_checkpoint(console)
    vocab = load_vocabulary(ckpt, args.tokenizer)
    if vocab.chat_template and rank0:
        from jinja2 import TemplateError

        try:
            vocab.template()  # (compiled once, now: not in the first request's time)
        except TemplateError:
            pass  # (a chat request says what is wrong with it; completions still work)
    model, record = load_model(ckpt, args, console)
    if rank0:
        print(f"weights: {record.weights}", file=sys.stderr, flush=True)
        defaults = Defaults.of_vocab(vocab, lambda message: print(f"note: {message}", file=sys.stderr, flush=True))
        print(f"a request's sampling by default: {describe(*defaults.settings())}", file=sys.stderr, flush=True)
    return ckpt, vocab, model, record


def parse_args(argv):
    p = argparse.ArgumentParser(description="Serve the model over OpenAI's HTTP API, with continuous batching.")
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=positive_int, default=8,
                   help="requests decoded together (more wait in line); with a draft one of them speculates")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request")
    p.add_argument("--prefix-reuse", action=argparse.BooleanOptionalAction, default=True,
                   help="a request prefills only what follows the longest prefix a free row's cache (or the prefix "
                        "store) already holds (default on; off: the prefix store too)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the prefixes rows held before other requests took them in host memory, and those used "
                        "more than once on disk across restarts (the prefix store, default on)")
    p.add_argument("--prefix-cache-mb", type=int, metavar="MB",
                   help="the prefix store's host memory (default 4096 MiB or a quarter of the memory available, the "
                        "less)")
    p.add_argument("--prefix-cache-disk-mb", type=int, metavar="MB",
                   help="the prefix store's files in the cache folder (default 8192 MiB or a quarter of the free "
                        "disk, the less; 0: none)")
    p.add_argument("--slot-save-path", metavar="DIR",
                   help="the folder of POST /slots/{id}?action=save|restore (llama-server's slot files; the client "
                        "names a file in it, never a path); without it, those actions are answered 501")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_BUDGET, metavar="N",
                   help=f"prompt tokens prefilled between two decode steps while other requests stream (default "
                        f"{PREFILL_BUDGET}: a long prompt never stalls them for long); 0: every prompt whole")
    p.add_argument("--max-body-mb", type=positive_int, default=16, metavar="MB",
                   help="the largest request body (default 16 MiB); a larger one is answered 413 before it is read")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests that may wait for a row (default 64); more are answered 503 with Retry-After")
    p.add_argument("--embedding", action="store_true",
                   help="serve embeddings (/v1/embeddings, /api/embed, /embedding) instead of text; on by itself for "
                        "a folder with sentence-transformers' modules.json")
    p.add_argument("--rerank", action="store_true",
                   help="serve /v1/rerank (and /rerank) with a Qwen3-Reranker-style model instead of text")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="let pages from ORIGIN call the server from a browser (CORS; repeat it for more, '*' for any)")
    args = parse_flags(p, argv)
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    if args.prefill_chunk < 0:
        raise UsageError(f"--prefill-chunk must be 0 or more, got {args.prefill_chunk}")
    for flag in ("prefix_cache_mb", "prefix_cache_disk_mb"):
        if getattr(args, flag) is not None and getattr(args, flag) < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be 0 or more, got {getattr(args, flag)}")
    if args.max_queue < 0:
        raise UsageError(f"--max-queue must be 0 or more, got {args.max_queue}")
    if args.embedding and args.rerank:
        raise UsageError("--embedding and --rerank: a server does one of them")
    if tp.world()[1] > 1 and (args.embedding or args.rerank):
        raise UsageError("--embedding and --rerank are not served under torchrun (tensor parallel)")
    named = [name for _, _, name in map(lora.entry, args.lora or ()) if name]
    if named and (args.draft or args.draft_quant or args.lookup):
        raise UsageError("--lora NAME=DIR: speculative decoding with adapters picked per request is not served; drop "
                         "--draft, --draft-quant and --lookup")
    twice = sorted({name for name in named if named.count(name) > 1})
    if twice:
        raise UsageError(f"--lora: two adapters named {twice[0]!r}")
    if tp.world()[1] > 1 and (args.draft or args.draft_quant or args.lookup):
        raise UsageError("speculative decoding is not served under torchrun (tensor parallel): drop --draft, "
                         "--draft-quant and --lookup")
    return args


def main(argv=None) -> int:
    from rich.console import Console

    argv = sys.argv[1:] if argv is None else argv
    console = Console(stderr=True, highlight=False, soft_wrap=True)

    def work() -> int:
        args = parse_args(argv)
        if tp.world()[1] > 1:
            tp.setup(torch.device(args.device).type)
        if tp.world()[0] != 0:  # tensor parallel: the other ranks follow rank 0's model calls
            return serve_follower(args, console)
        return serve(args, console)

    return run_program(work, argv)


def serve(args, console) -> int:
    import uvicorn

    server = Server(args)

    class Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGTERM or SIGINT: finish cleanly, exit 0 (stock uvicorn
            self.should_exit = True  # raises the signal again once it has stopped: status -15)

    config = uvicorn.Config(make_app(server), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=5, lifespan="off")
    http = Uvicorn(config)

    def loading():
        try:
            server.load(console)
            doing = f"batch {len(server.scheduler.requests)}" if server.scheduler else "reranking" if \
                server.embedder.reranker else "embeddings"
            print(f"serving {server.name} on http://{args.host}:{args.port} ({doing}, context {server.max_seq_len})",
                  file=sys.stderr, flush=True)
        except (UsageError, CheckpointError, ValueError, OSError) as e:
            server.error = first_line(e, None)
            sys.stderr.write(f"error: {server.error}\n")
            http.should_exit = True

    threading.Thread(target=loading, name="loading", daemon=True).start()
    http.run()
    if server.scheduler is not None:
        server.scheduler.stopping.set()
        if tp.world()[1] > 1:
            server.scheduler.thread.join(timeout=5)
        if server.scheduler.disk is not None:
            server.scheduler.disk.flush()  # (the prefix blocks still queued for the disk)
    if tp.world()[1] > 1:
        tp.exit(0 if server.error is None else 2)
    return 0 if server.error is None else 2


def serve_follower(args, console) -> int:
    """A rank other than 0 under torchrun: the same model and cache, every model call rank 0 makes."""
    _, vocab, model, record = load_for_serving(args, console, rank0=False)
    max_seq_len = caches.fitting_cache(model, args.max_batch, record.max_seq_len, record.kv_dtype)
    scheduler = Scheduler(model, vocab, args.max_batch, max_seq_len, record.compile, load=record)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    scheduler.calls.follow()
    tp.exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
