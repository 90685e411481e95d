"""Code infill for editors (llama.vscode, Continue's autocomplete): the fill-in-the-middle prompt from the
vocabulary's own FIM tokens (prefix, suffix, middle, in that order: PSM), for llama-server's /infill and for the
completions' `suffix` (and Ollama's generate `suffix`). A vocabulary without FIM tokens is a 400 that says so.

    [<|file_sep|>name\\ntext ...] <|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|> [prompt]"""

from __future__ import annotations

from dense_engine.server.protocol import BadRequest, check_fields
from dense_engine.server.responses import Piece, Reply

# (prefix, suffix, middle) as each family spells them; the file separator of repository-level prompts
SPELLINGS = [("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder, CodeGemma
             ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, SantaCoder
             ("▁<PRE>", "▁<SUF>", "▁<MID>"), ("<PRE>", "<SUF>", "<MID>"),  # CodeLlama
             ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")]  # DeepSeek-Coder
FILE_SEPARATORS = ("<|file_sep|>", "<file_sep>")
SAMPLERS = {"temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n",
            "presence_penalty", "frequency_penalty", "seed", "stop", "stream", "dry_multiplier", "dry_base",
            "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers"}
IGNORED = {"input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "max_tokens", "model", "id_slot",
           "cache_prompt", "t_max_predict_ms", "samplers", "n_indent", "return_tokens"}


def fim_tokens(vocab) -> tuple[int, int, int] | None:
    """The ids of the vocabulary's prefix, suffix and middle tokens, or None when it has none."""
    for spelling in SPELLINGS:
        ids = [vocab.tokenizer.token_to_id(t) for t in spelling]
        if all(i is not None for i in ids):
            return tuple(ids)
    return None


def fim_prompt(vocab, prefix: str, suffix: str, where: str = "suffix", extra: list | None = None,
               prompt: str = "") -> list[int]:
    """The token ids of an infill prompt: the beginning-of-text token where the vocabulary adds one, the extra
    files (repository-level FIM: their separator, name and text), then prefix, suffix, middle and `prompt`."""
    ids = fim_tokens(vocab)
    if ids is None:
        raise BadRequest(f"'{where}': this model's vocabulary has no fill-in-the-middle tokens (such as "
                         "<|fim_prefix|>, <fim_prefix> or <PRE>): it cannot infill", where)
    pre, suf, mid = ids
    out = vocab.encode("", special=True)  # ([BOS] where the vocabulary adds one)
    if extra:
        separator = next((vocab.tokenizer.token_to_id(t) for t in FILE_SEPARATORS
                          if vocab.tokenizer.token_to_id(t) is not None), None)
        if separator is None:
            raise BadRequest("'input_extra': this vocabulary has no file separator token (<|file_sep|>)",
                             "input_extra")
        for i, chunk in enumerate(extra):
            if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str) or \
                    not isinstance(chunk.get("filename", ""), str):
                raise BadRequest(f"input_extra[{i}] must be {{filename, text}}", f"input_extra[{i}]")
            out += [separator] + vocab.encode(chunk.get("filename", "") + "\n" + chunk.get("text", ""), special=False)
    out += [pre] + vocab.encode(prefix, special=False) + [suf] + vocab.encode(suffix, special=False) + [mid]
    return out + (vocab.encode(prompt, special=False) if prompt else [])


def completions_body(body: dict, server) -> tuple[str, dict, dict]:
    """/v1/completions: with a `suffix`, the prompt (a string) becomes the infill prompt."""
    suffix = body.get("suffix")
    if suffix in (None, ""):
        return "completion", body, {}
    prompt = body.get("prompt", "")
    if not isinstance(suffix, str) or not isinstance(prompt, str):
        raise BadRequest("'suffix' needs a 'prompt' string, and must be a string", "suffix")
    rest = {k: v for k, v in body.items() if k != "suffix"}
    return "completion", {**rest, "prompt": fim_prompt(server.vocab, prompt, suffix)}, {}


def translate(body: dict, server) -> tuple[str, dict, dict]:
    """llama-server's /infill: input_prefix, input_suffix, input_extra, prompt, n_predict and the samplers."""
    check_fields(body, IGNORED | SAMPLERS)
    for name in ("input_prefix", "input_suffix", "prompt"):
        if not isinstance(body.get(name, ""), str):
            raise BadRequest(f"'{name}' must be a string", name)
    extra = body.get("input_extra") or []
    if not isinstance(extra, list):
        raise BadRequest("'input_extra' must be a list of {filename, text}", "input_extra")
    ids = fim_prompt(server.vocab, body.get("input_prefix", ""), body.get("input_suffix", ""), "input_prefix", extra,
                     body.get("prompt", ""))
    out = {name: body[name] for name in SAMPLERS if name in body}
    limit = body.get("n_predict", body.get("max_tokens"))
    if limit is not None and not (isinstance(limit, int) and not isinstance(limit, bool) and limit < 0):
        out["max_tokens"] = limit
    return "completion", {**out, "prompt": ids}, {"fields": {"max_tokens": "n_predict"}}


class InfillReply(Reply):
    """llama-server's completion shape: {"content", "stop", ...}; streamed: one event a piece, the last with stop."""
    done_line = ""

    def end(self) -> list[dict]:
        return []

    def final(self, text: str) -> dict:
        job = self.jobs[0]
        matched = job.output.held.matched if job.output.held is not None else None
        kind = "limit" if job.finish_reason == "length" else "word" if matched else "eos"
        return {"index": 0, "content": text, "stop": True, "model": self.head["model"], "stop_type": kind,
                "stopping_word": matched or "", "tokens_predicted": len(job.generated),
                "tokens_evaluated": len(job.prompt), "truncated": False}

    def chunks(self, piece: Piece) -> list[dict]:
        if piece.kind == "error":
            return [{"error": {"code": 500, "message": piece.text, "type": "server_error"}}]
        if piece.kind == "text":
            return [{"index": 0, "content": piece.text, "stop": False}]
        return [self.final("")] if piece.kind == "done" else []

    def body(self) -> dict:
        return self.final("".join(self.texts[0]))
