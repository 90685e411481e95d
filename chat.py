"""chat.py: chat with a checkpoint, complete text, or generate once, from the terminal.

    python chat.py                                   # the default model (SmolLM2-135M-Instruct), fetched once
    python chat.py --ckpt DIR                        # any checkpoint from_pretrained reads
    python chat.py --ckpt DIR --prompt "Once upon"   # one-shot: only the generated text on stdout

In chat mode the KV cache is kept across turns: each turn prefills only the tokens that are new since the last one.
The program's pieces (dense_engine/cli/): flags.py (the flags and what it loads by them, shared with serve.py), repl.py
(interactive mode), benchmark.py (--bench); the Session it answers through is dense_engine/runtime/session.py; this file
is the command line, one-shot runs and --prompt-file batches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from dense_engine.formats import preread

if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "dense-chat":
    preread.start_from_argv(sys.argv[1:])  # a GGUF file's blocks are read on a thread while torch is imported

import torch

from dense_engine.cli import benchmark, terminal
from dense_engine.cli.flags import (
    add_model_flags,
    check_environment,
    load_model,
    make_draft,
    parse_flags,
    positive_int,
    prompt_ids,
    prompt_mode,
    prompt_text,
    sampler,
    settings,
)
from dense_engine.cli.repl import SETTINGS, ctrl_c_as_key, interactive
from dense_engine.cli.terminal import Notes
from dense_engine.formats import lora
from dense_engine.formats.default_model import default_checkpoint
from dense_engine.formats.vocab import Vocabulary, load_vocabulary
from dense_engine.runtime import caches, generate, grammar, reasoning, tp
from dense_engine.runtime.sampling import describe
from dense_engine.runtime.session import Session
from dense_engine.runtime.steps import Steps
from dense_engine.system.errors import UsageError, leave, run_program

# ----------------------------------------------------------------------------------------------------------------
# The program


def length_or_range(text: str):
    lo, sep, hi = text.partition(":")
    lo, hi = positive_int(lo), positive_int(hi) if sep else None
    if hi is not None and hi < lo:
        raise argparse.ArgumentTypeError(f"range {text}: the end is below the start")
    return lo if hi is None else (lo, hi)


def parse_args(argv):
    p = argparse.ArgumentParser(description="Chat with a dense decoder checkpoint, or complete text.")
    add_model_flags(p)
    p.add_argument("--prompt", help="generate once for this text ('-' reads stdin), print it and exit")
    p.add_argument("--prompt-file", metavar="FILE", help="generate for every prompt in FILE (one a line, or JSONL with "
                   "a \"prompt\" field; '-' reads stdin), in batches: one JSON line per prompt on stdout")
    p.add_argument("--system", help="system message for chat")
    p.add_argument("--prompt-cache", metavar="FILE",
                   help="--prompt: start from the cache FILE holds (a prompt that begins as the saved one prefills "
                        "only the rest), then save this prompt's cache to FILE (llama.cpp's --prompt-cache)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="mode", action="store_const", const="chat", help="force chat mode")
    mode.add_argument("--complete", dest="mode", action="store_const", const="complete", help="force completion")
    p.add_argument("--max-new-tokens", type=positive_int, default=512)
    p.add_argument("--temperature", type=float, default=None, help="0: greedy. The sampling flags default to the "
                   "checkpoint's recommendation (generation_config.json, a GGUF's general.sampling.*), else to "
                   "llama.cpp's (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05); --verbose shows them")
    p.add_argument("--top-k", type=int, default=None, help="0: off")
    p.add_argument("--top-p", type=float, default=None, help="1: off")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens less likely than MIN_P times the likeliest "
                   "(0: off)")
    p.add_argument("--typical-p", type=float, default=None, help="locally typical sampling's mass (1: off)")
    p.add_argument("--repetition-penalty", "--repeat-penalty", type=float, default=None,
                   help="divide a positive logit (multiply a negative one) of the tokens among the last "
                        "--repeat-last-n by this (1: off)")
    p.add_argument("--repeat-last-n", type=int, default=64, help="how many last tokens the penalty looks at (-1: all)")
    p.add_argument("--dry-multiplier", type=float, default=None, help="DRY: penalize what would repeat the context "
                   "(0: off; 0.8 is a common choice)")
    p.add_argument("--dry-base", type=float, default=1.75)
    p.add_argument("--dry-allowed-length", type=int, default=2)
    p.add_argument("--dry-penalty-last-n", type=int, default=-1, help="how many last tokens DRY looks at (-1: all)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling noise: any integer in -2**63..2**64-1 "
                   "(default: a new one each run)")
    p.add_argument("--stats", action="store_true", help="one-shot: print speed to stderr")
    p.add_argument("--verbose", action="store_true", help="say the sampling settings and where each came from")
    p.add_argument("--plain", action="store_true", help="chat: stream replies as plain text, not rendered Markdown")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="one-shot: the reply is JSON valid against this JSON "
                                                              "schema (constrained decoding)")
    shape.add_argument("--json-object", action="store_true", help="one-shot: the reply is a JSON object (--json is "
                                                                   "--bench's output format)")
    bench = p.add_argument_group("benchmark (--bench)")
    bench.add_argument("--bench", action="store_true", help="measure prefill and decode speed, then exit")
    bench.add_argument("--shape", choices=tuple(benchmark.SHAPES),
                       help="benchmark a random-weight model of this published shape instead of --ckpt")
    bench.add_argument("--batch-size", type=positive_int, default=None,
                       help="rows per batch (--prompt-file: default 8; --bench: default 1)")
    bench.add_argument("--prompt-len", type=length_or_range, default=128,
                       help="prompt tokens, or a range LO:HI of random lengths (a ragged batch)")
    bench.add_argument("--gen-len", type=positive_int, default=128)
    bench.add_argument("--runs", type=positive_int, default=5)
    bench.add_argument("--peak-bw", type=float, help="the device's peak memory bandwidth in GB/s (above 0), for MBU")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    bench.add_argument("--plot", metavar="FILE.png", help="also draw decode tok/s against the position in the cache "
                       "(needs matplotlib: pip install -e '.[plot]')")
    args = parse_flags(p, argv)
    if args.seed is not None and not -2**63 <= args.seed < 2**64:
        raise UsageError(f"--seed must be in -2**63..2**64-1, got {args.seed}")
    if args.peak_bw is not None and not 0 < args.peak_bw < float("inf"):
        raise UsageError(f"--peak-bw must be a number of GB/s above 0, got {args.peak_bw}")
    for name, (_, valid, expected) in SETTINGS.items():
        value = getattr(args, name.replace("-", "_"))
        if value is not None and not valid(value):
            raise UsageError(f"--{name} must be {expected}, got {value}")
    lora.unnamed(tuple(lora.entry(spec) for spec in args.lora or ()), "chat.py")
    return args


def read_schema(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except OSError as e:
        raise UsageError(f"--json-schema {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"--json-schema {path}: not valid JSON ({getattr(e, 'msg', 'not UTF-8')})") from None
    try:
        grammar.json_grammar(schema)
    except ValueError as e:
        raise UsageError(f"--json-schema {path}: not a usable JSON schema ({e})") from None
    return schema


def load_prompt_cache(session: Session, path: str, notes: Notes) -> None:
    """--prompt-cache FILE: its cache into the session when this model saved it (else a note: the prompt is prefilled
    whole and FILE written again); a file that is not a prompt cache is refused, never overwritten."""
    if not os.path.exists(path):
        return
    if not caches.is_cache_file(path):
        raise UsageError(f"--prompt-cache {path}: not a prompt cache (this would overwrite it); choose another name")
    try:
        session.load_cache(path)
    except (ValueError, OSError) as e:
        notes(f"note: --prompt-cache {path} not used: {caches.first_words(e)}; it is written again")


def one_shot(session: Session, vocab: Vocabulary, args, mode: str, notes: Notes, load_s: float) -> int:
    """The answer to --prompt on stdout; with --stats, its line (and the load's seconds: reading the checkpoint and
    the vocabulary, the session) on stderr."""
    ids = prompt_ids(vocab, prompt_text(args, mode), mode, args.system)
    if not ids:
        raise UsageError("the prompt is empty")
    if len(ids) >= session.max_seq_len:
        raise UsageError(f"the prompt has {len(ids)} tokens; the context (--max-seq-len) holds {session.max_seq_len}")
    if args.prompt_cache:
        load_prompt_cache(session, args.prompt_cache, notes)
    keys = ctrl_c_as_key(session)
    last = [""]  # the answer's last character: is its line still open?
    # a thinking model's reasoning: kept from stdout (the answer), folded to one dim line on the notes' console after it
    thoughts = reasoning.ThinkStream(reasoning.opened(vocab.decode(ids))) if mode == "chat" and \
        reasoning.thinks(vocab.chat_template) else None
    thought = []
    from rich.markup import escape  # (the model's text is not markup)

    def write(text: str) -> None:
        if thoughts is not None:
            parts = thoughts.feed(text)
            thought.extend(t for kind, t in parts if kind == "thinking")
            text = "".join(t for kind, t in parts if kind == "text")
        show(text)

    def show(text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            last[0] = text[-1:]

    try:
        with notes.held():  # (printed after the reply's line)
            _, stats = session.reply(ids, write)
            if thoughts is not None:
                for kind, t in thoughts.finish():
                    show(t) if kind == "text" else thought.append(t)
                if "".join(thought).strip():
                    notes(f"thought: {escape(terminal.folded(''.join(thought), 160))}")
            # the answer's line is closed, as every command-line program's output is for the next one in a pipe
            if last[0] != "\n":
                show("\n")
    finally:
        if keys is not None:
            keys.restore()
    if args.prompt_cache and tp.world()[0] == 0:
        session.save_cache(args.prompt_cache, len(ids))  # (the prompt's tokens: the next run's shared prefix)
    if args.stats and tp.world()[0] == 0:
        print(f"{stats.line()}, loaded in {load_s:.2f} s", file=sys.stderr)
    return 0


def read_prompts(path: str, console):
    """(line number, prompt) for each prompt of the file, read a line at a time (a file of any length in bounded
    memory): a JSON object with a string "prompt", or the line itself. A line break separates prompts and is never
    part of one. Blank lines are skipped; a line that is not UTF-8, not valid JSON, or has no string "prompt" is
    reported with its number and skipped. Under torchrun rank 0 reads stdin and sends each line to the others."""
    rank, size = tp.world()
    try:  # (the file stays open as the prompts are read from it, a line at a time: SIM115 does not apply)
        source = (sys.stdin.buffer if rank == 0 else iter(())) if path == "-" else open(path, "rb")  # noqa: SIM115
    except OSError as e:
        raise UsageError(f"--prompt-file {path}: {e.strerror}") from None
    lines = source if path != "-" or size == 1 else shared_lines(source)
    for number, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            console.print(f"[yellow]{path}: line {number}: not UTF-8 text; skipped[/yellow]")
            continue
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                value = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                console.print(f"[yellow]{path}: line {number}: not valid JSON ({getattr(e, 'msg', 'nested too deeply')}"
                              "); skipped[/yellow]")
                continue
            if not isinstance(value, dict) or not isinstance(value.get("prompt"), str):
                console.print(f"[yellow]{path}: line {number}: expected an object with a string \"prompt\"; "
                              "skipped[/yellow]")
                continue
            line = value["prompt"]
        yield number, line


def shared_lines(source):
    """Rank 0's lines of stdin on every rank, one broadcast each (None: the end)."""
    for line in source:
        yield tp.broadcast(line)
    tp.broadcast(None)


def prompt_file(model, vocab: Vocabulary, record, args, mode: str, console) -> int:
    """--prompt-file: every prompt in batches of --batch-size (left-padded, each row stopping at its own end of
    text), read and answered a batch at a time; one JSON line per prompt on stdout, in input order, written as each
    batch finishes. A row's completion is what --prompt prints for that prompt alone with the same settings (greedy:
    token for token)."""
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    batch = args.batch_size or 8
    context = model.config.max_position_embeddings
    length = caches.fitting_cache(model, batch, record.max_seq_len, record.kv_dtype)
    caches.setup_cache(model, batch, length, record.kv_dtype)  # one cache for the file
    steps = Steps(model) if record.compile else None
    vocab_limit = vocab.size if vocab.size < model.config.vocab_size else None
    counts = {"prompts": 0, "tokens": 0}
    start = time.perf_counter()

    def answer(rows, progress, task) -> None:
        longest = max(len(ids) for *_, ids in rows)
        max_new = min(args.max_new_tokens, model.max_seq_len - longest)
        outputs, finished = [[] for _ in rows], [None] * len(rows)
        asked = sampler(args, vocab)[0]
        tokens = generate.generate_tokens(model, [ids for *_, ids in rows], max_new, sampler=asked,
                                          vocab_limit=vocab_limit, steps=steps, dry=asked.dry_for(vocab))
        for token in generate.ahead(tokens):
            for i, t in enumerate(token):
                if finished[i] is None:
                    if t in vocab.stop_ids:
                        finished[i] = "eos"
                    else:
                        outputs[i].append(t)
                        counts["tokens"] += 1
            if all(finished):
                break
            progress.update(task, rate=f"{counts['tokens'] / (time.perf_counter() - start):.1f} tok/s")
        for (index, number, text, _), ids, reason in zip(rows, outputs, finished):
            record = {"index": index, "line": number, "prompt": text, "completion": vocab.decode(ids),
                      "tokens": len(ids), "finish_reason": reason or "length"}
            sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")  # (one write: a signal ends lines whole)
        sys.stdout.flush()
        counts["prompts"] += len(rows)
        progress.update(task, completed=counts["prompts"])

    with Progress(TextColumn("prompts {task.completed}"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("prompts", total=None, rate="")
        rows = []
        for index, (number, text) in enumerate(read_prompts(args.prompt_file, console)):
            ids = prompt_ids(vocab, text, mode, args.system)
            if not ids or len(ids) >= min(context, model.max_seq_len):
                console.print(f"[yellow]{args.prompt_file}: line {number}: the prompt has {len(ids)} tokens; the "
                              f"cache holds {model.max_seq_len}; skipped[/yellow]")
                continue
            rows.append((index, number, text, ids))
            if len(rows) == batch:
                answer(rows, progress, task)
                rows = []
        if rows:
            answer(rows, progress, task)
    if counts["prompts"] == 0:
        raise UsageError(f"--prompt-file {args.prompt_file}: no prompts")
    return 0


def run(argv, console) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    if tp.world()[1] > 1:  # under torchrun: join the group; every rank samples with rank 0's seed
        tp.setup(torch.device(args.device).type)
        args.seed = tp.broadcast(args.seed if args.seed is not None else int(torch.randint(2**62, ())))
    if args.seed is not None:
        torch.manual_seed(args.seed)
    if args.shape and not args.bench:
        raise UsageError("--shape needs --bench (it makes a random-weight model for measuring)")
    if args.plot and not args.bench:
        raise UsageError("--plot needs --bench (it draws what the benchmark measured)")
    if (args.json_schema or args.json_object) and (args.prompt is None or args.draft or args.draft_quant
                                                    or args.lookup):
        raise UsageError(f"{'--json-schema' if args.json_schema else '--json-object'} applies to one-shot --prompt "
                         "runs, without speculative decoding")
    schema = read_schema(args.json_schema) if args.json_schema else None
    if (args.repetition_penalty not in (None, 1) or args.dry_multiplier) and (
            args.draft or args.draft_quant or args.lookup):
        raise UsageError("--repetition-penalty and --dry-multiplier are not served with speculative decoding (--draft, "
                         "--draft-quant, --lookup)")
    if args.prompt_cache and args.prompt is None:
        raise UsageError("--prompt-cache applies to one-shot --prompt runs (interactive: /save and /load keep the "
                         "conversation's cache)")
    if args.prompt_cache and tp.world()[1] > 1:
        raise UsageError("--prompt-cache is not kept under torchrun (tensor parallel)")
    if args.prompt_file is not None and (args.draft or args.draft_quant or args.lookup):
        raise UsageError("--prompt-file runs batches; speculative decoding (--draft, --draft-quant, --lookup) runs at "
                         "batch 1")
    check_environment(args, console)
    ckpt = None if args.shape else args.ckpt or default_checkpoint(console)
    if ckpt is not None and not os.path.exists(ckpt):
        raise UsageError(f"--ckpt {ckpt}: no such file or folder")
    if args.bench:
        return benchmark.main(args, console, ckpt)
    with ThreadPoolExecutor(1) as pool:  # the tokenizer is parsed while the weights are read (their reads wait on I/O)
        vocab_read = pool.submit(load_vocabulary, ckpt, args.tokenizer)
        try:
            model, record = load_model(ckpt, args, console)
        finally:  # (a vocabulary that cannot be read is said first, as if read first)
            vocab = vocab_read.result()
    why = f"weights: {record.weights}"
    if args.max_seq_len and args.max_seq_len > model.config.max_position_embeddings:
        raise UsageError(f"--max-seq-len {args.max_seq_len} exceeds the model's context of "
                         f"{model.config.max_position_embeddings}")
    mode = prompt_mode(args, vocab, ckpt)
    if args.prompt_file is not None:
        return prompt_file(model, vocab, record, args, mode, console)
    notes = Notes(console)
    draft = make_draft(args, model, console, record)
    with console.status("Loading the compiled steps..." if record.compile else "Warming up...") as status:
        session = Session(model, vocab, settings(args, vocab, lambda message: notes(f"note: {message}")), record,
                          status=status.update, draft=draft, note=lambda message: notes(f"note: {message}"))
        if args.prompt is None:
            session.compile_s = session.warm_up()
        elif session.steps is not None:
            # one-shot: its one prefill runs eagerly (a first run then compiles one step in the background, not
            # two); the decode step loads after the first token
            session.steps.eager.add("prefill")
    if args.prompt is None or args.stats:
        console.print(f"[dim]{why}[/dim]")
    if args.verbose:
        console.print(f"sampling: {describe(session.settings.sampler, session.settings.sources)}", markup=False)
    if args.json_schema or args.json_object:
        grammar_text, tokenizer = grammar.json_grammar(schema), grammar.tokenizer_for(vocab, model.config.vocab_size)
        session.constraint = lambda: grammar.Constraint(grammar_text, tokenizer, model.config.vocab_size)
    if args.prompt is not None:
        return one_shot(session, vocab, args, mode, notes, time.perf_counter() - started)
    return interactive(session, vocab, args, mode, console, ckpt, why, notes)


def main(argv=None) -> int:
    from rich.console import Console

    argv = sys.argv[1:] if argv is None else argv
    one_shot_mode = any(a in ("--prompt", "--json", "--prompt-file") or a.startswith(("--prompt=", "--prompt-file="))
                        for a in argv)
    # one-shot: stdout holds only the generated text. soft_wrap: a note or an error is one line whatever the width
    # (a script reading stderr line by line; rich would wrap at 80 columns when stderr is not a terminal)
    console = Console(stderr=one_shot_mode, highlight=False, soft_wrap=True)
    if tp.world()[0] != 0:  # tensor parallel: rank 0 owns the terminal; the others print only their errors
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (this process's stdout from now on)
        console = Console(file=sys.stdout, soft_wrap=True)
    return run_program(lambda: run(argv, console), argv, signals=True)


def entry() -> None:
    """`python chat.py` and the `dense-chat` command."""
    code = main()
    if tp.world()[1] > 1:  # under torchrun
        tp.exit(code)
    leave(code)


if __name__ == "__main__":
    entry()
