"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/ps, /api/show, /api/version), what Open WebUI, many
editors and the `ollama` Python client speak: a translator of its requests into a chat completion's or a
completion's body (options -> the samplers, num_predict -> max_tokens, format -> response_format, suffix -> a
fill-in-the-middle prompt), and Replies that tell the pieces as Ollama's lines (NDJSON: a line a piece, then one
with done and the counts and durations) or one body. A streamed tool call is told whole as soon as its arguments
are (Ollama's calls carry their arguments as an object, not as text in pieces). Errors are {"error": "..."}."""

from __future__ import annotations

import datetime
import hashlib
import json
import time

from dense_engine.runtime import reasoning
from dense_engine.server import infill
from dense_engine.server.protocol import BadRequest, check_fields, note_unknown
from dense_engine.server.responses import Piece, Reply

VERSION = "0.13.3"  # the Ollama API this follows (clients check it for features: tools, thinking, ...)
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "typical_p": "typical_p", "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "seed": "seed",
           "stop": "stop", "mirostat": "mirostat"}  # (mirostat: refused when on, by the chat parser)
IGNORED_OPTIONS = {"num_ctx", "num_keep", "num_batch", "num_gpu", "main_gpu", "use_mmap", "use_mlock", "num_thread",
                   "low_vram", "f16_kv", "vocab_only", "numa", "penalize_newline", "mirostat_tau", "mirostat_eta",
                   "tfs_z"}
IGNORED = {"model", "keep_alive", "options", "format", "stream", "think", "tools", "messages", "prompt", "suffix",
           "system", "raw", "template", "images", "context", "truncate", "shift", "logprobs", "top_logprobs"}
FIELDS = {"max_tokens": "options.num_predict", "response_format": "format", "repeat_penalty": "options.repeat_penalty",
          **{name: "options." + name for name in OPTIONS if name != "repeat_penalty"}}


def error_body(e: BadRequest) -> dict:
    return {"error": str(e)}


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def common(body: dict) -> dict:
    """The fields /api/chat and /api/generate share, as a chat or completion body's."""
    check_fields(body, IGNORED)
    think = body.get("think")
    if think not in (None, True, False, "low", "medium", "high"):
        raise BadRequest("'think' must be true, false, \"low\", \"medium\" or \"high\"", "think")
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'options' must be an object", "options")
    out = {"stream": body.get("stream", True)}  # (Ollama streams unless told not to)
    if think is not None:  # the template's switch; a level is also its reasoning_effort
        out["chat_template_kwargs"] = {"enable_thinking": think is not False}
        if isinstance(think, str):
            out["reasoning_effort"] = think
    for name, value in options.items():
        if name in OPTIONS:
            out[OPTIONS[name]] = value
        elif name == "num_predict":
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                continue  # -1: no limit, -2: fill the context (both: what the context leaves)
            out["max_tokens"] = value
        elif name not in IGNORED_OPTIONS:
            note_unknown(name, "option")
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise BadRequest("'format' must be \"json\" or a JSON schema", "format")
    return out


def translate_chat(body: dict, server) -> tuple[str, dict, dict]:
    chat = common(body)
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise BadRequest("'messages' must be a non-empty list of {role, content}", "messages")
    chat["messages"] = [chat_message(m, i) for i, m in enumerate(given)]
    if body.get("tools"):
        chat["tools"] = body["tools"]
    return "chat", chat, {"fields": FIELDS}


def chat_message(m, i: int) -> dict:
    if not isinstance(m, dict):
        raise BadRequest(f"messages[{i}] must be an object with a role and a content", f"messages[{i}]")
    if m.get("images"):
        raise BadRequest(f"messages[{i}].images: this model reads text only", f"messages[{i}].images")
    out = {"role": m.get("role"), "content": m.get("content", "")}
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                  for c in calls):
            raise BadRequest(f"messages[{i}].tool_calls must be a list of {{function: {{name, arguments}}}}",
                             f"messages[{i}].tool_calls")
        out["tool_calls"] = [{"id": f"call_{i}_{j}", "type": "function",
                              "function": {"name": c["function"].get("name"),
                                           "arguments": json.dumps(c["function"].get("arguments") or {},
                                                                   ensure_ascii=False)}}
                             for j, c in enumerate(calls)]
    if m.get("role") == "tool" and m.get("tool_name"):
        out["name"] = m["tool_name"]
    return out


def translate_generate(body: dict, server) -> tuple[str | None, dict, dict]:
    """/api/generate: a prompt (with `suffix`: the model fills the middle; `raw`: no template) -> a completion's or
    a chat's body. An empty prompt only loads the model, as Ollama's does: (None, the answer, {})."""
    out = common(body)
    prompt, suffix, system = body.get("prompt", ""), body.get("suffix"), body.get("system")
    for name, value in (("prompt", prompt), ("suffix", suffix), ("system", system)):
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"'{name}' must be a string", name)
    for name in ("template", "images", "context"):
        if body.get(name):
            raise BadRequest(f"'{name}' is not supported by this server", name)
    meta = {"fields": FIELDS}
    if not prompt and not suffix:
        return None, {"model": body.get("model"), "created_at": now_iso(), "response": "", "done": True,
                      "done_reason": "load"}, meta
    if suffix:
        return "completion", {**out, "prompt": infill.fim_prompt(server.vocab, prompt, suffix, where="suffix")}, meta
    if body.get("raw") or not server.vocab.chat_template:
        return "completion", {**out, "prompt": prompt}, meta
    out["messages"] = ([{"role": "system", "content": system}] if system else []) + [{"role": "user",
                                                                                       "content": prompt}]
    return "chat", out, meta


def details(server) -> dict:
    model = server.scheduler.model
    count = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    size = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"
    quant = getattr(server.args, "quant", None) or "none"
    return {"parent_model": "", "format": "gguf" if str(getattr(server.args, "ckpt", "")).endswith(".gguf")
            else "safetensors", "family": server.name, "families": [server.name], "parameter_size": size,
            "quantization_level": quant}


def weight_bytes(server) -> int:
    model = server.scheduler.model
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def tags(server, running: bool = False) -> dict:
    """/api/tags (and /api/ps: running, with its expiry): the one model this server serves."""
    entry = {"name": server.name, "model": server.name, "modified_at": now_iso(), "size": weight_bytes(server),
             "digest": hashlib.sha256(server.name.encode()).hexdigest(), "details": details(server)}
    if running:
        entry.update(expires_at="2999-01-01T00:00:00Z", size_vram=0, context_length=server.max_seq_len)
    return {"models": [entry]}


def show(server, body: dict) -> dict:
    config = server.scheduler.model.config
    capabilities = ["completion"] + (["tools"] if server.vocab.chat_template and "tools" in server.vocab.chat_template
                                     else []) + (["insert"] if infill.fim_tokens(server.vocab) else []) + (
        ["thinking"] if reasoning.thinks(server.vocab.chat_template) else [])
    info = {"general.architecture": server.name,
            "general.parameter_count": sum(p.numel() for p in server.scheduler.model.parameters()),
            "context_length": config.max_position_embeddings, "embedding_length": config.hidden_size,
            "block_count": config.num_hidden_layers}
    return {"modelfile": "", "parameters": "", "template": server.vocab.chat_template or "", "details": details(server),
            "model_info": info, "capabilities": capabilities, "modified_at": now_iso()}


def version() -> dict:
    return {"version": VERSION}


class OllamaReply(Reply):
    """NDJSON lines: one per piece (a call whole once its arguments are), then a last one with done, the reason,
    the token counts and the durations in nanoseconds."""
    media_type, done_line = "application/x-ndjson", ""
    key = "response"

    def frame(self, chunk: dict) -> str:
        return json.dumps(chunk, ensure_ascii=False) + "\n"

    def line(self, **fields) -> dict:
        return {"model": self.head["model"], "created_at": now_iso(), **fields}

    def stats(self) -> dict:
        job, end = self.jobs[0], time.perf_counter()
        arrived, first = job.timing.arrived, job.timing.first_token_at or end
        ns = 1_000_000_000
        return {"done_reason": job.finish_reason if job.finish_reason in ("stop", "length") else "stop",
                "total_duration": int((end - arrived) * ns), "load_duration": 0,
                "prompt_eval_count": len(job.prompt), "prompt_eval_duration": int((first - arrived) * ns),
                "eval_count": len(job.generated), "eval_duration": int((end - first) * ns)}

    def end(self) -> list[dict]:
        return []

    def chunks(self, piece: Piece) -> list[dict]:
        if piece.kind == "error":
            return [{"error": piece.text}]
        if piece.kind == "text":
            return [self.line(**self.said(piece.text), done=False)]
        if piece.kind == "thinking":
            return [self.line(**self.said("", thinking=piece.text), done=False)]
        if piece.kind in ("call", "arguments"):
            self.track(piece)
            return []
        if piece.kind == "end":
            return [self.line(**self.said("", [self.calls[piece.index][piece.call]]), done=False)]
        if piece.kind == "done":
            return [self.line(**self.said(""), done=True, **self.stats())]
        return []

    def body(self) -> dict:
        text = "".join(self.texts[0])
        return self.line(**self.said(text, self.calls[0], "".join(self.thinking[0])), done=True, **self.stats())

    def said(self, text: str, calls: list | None = None, thinking: str = "") -> dict:
        return {self.key: text, **({"thinking": thinking} if thinking else {})}


class ChatReply(OllamaReply):
    def said(self, text: str, calls: list | None = None, thinking: str = "") -> dict:
        message = {"role": "assistant", "content": text, **({"thinking": thinking} if thinking else {})}
        if calls:
            message["content"] = text.strip()
            message["tool_calls"] = [{"function": {"index": self.calls[0].index(c), "name": c["name"],
                                                   "arguments": arguments(c)}} for c in calls]
        return {"message": message}


class GenerateReply(OllamaReply):
    pass


def arguments(call: dict):
    try:
        return json.loads(call["arguments"] or "{}")
    except json.JSONDecodeError:  # (cut off by num_predict)
        return {}
