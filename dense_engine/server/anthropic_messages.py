"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), what the `anthropic` SDK and Claude-style
coding agents speak: a translator of its request into a chat completion's body (system blocks -> a system message,
content blocks -> messages, tool_use / tool_result -> tool calls and tool messages, input_schema -> parameters,
stop_sequences -> stop), and a Reply that tells the pieces as Anthropic's events (message_start,
content_block_start / delta / stop with text_delta, thinking_delta and input_json_delta, message_delta with the
stop_reason,
message_stop) or folds them into one message. Errors are Anthropic's bodies: {"type": "error", "error": {...}}."""

from __future__ import annotations

import json

from dense_engine.server.protocol import BadRequest, chat_prompt, check_fields, joined_text
from dense_engine.server.responses import Piece, Reply, sse_event

IGNORED = {"model", "metadata", "service_tier", "container", "context_management", "anthropic_version"}
REFUSED = {"mcp_servers": bool}
PASSED = {"temperature", "top_p", "top_k", "stream", "min_p", "typical_p", "repetition_penalty", "seed"}
KNOWN = {"max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "thinking"}
FIELDS = {"stop": "stop_sequences"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


def error_body(e: BadRequest) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "invalid_request_error"), "message": str(e)}}


def translate(body: dict, server) -> tuple[str, dict, dict]:
    """A Messages request -> ("chat", the chat completion's body, what the reply needs)."""
    check_fields(body, IGNORED | PASSED | KNOWN, REFUSED)
    if body.get("max_tokens") is None:
        raise BadRequest("max_tokens: Field required", "max_tokens")
    chat = {name: body[name] for name in PASSED if name in body}
    chat["max_tokens"] = body["max_tokens"]
    chat["messages"] = system_messages(body.get("system")) + messages(body.get("messages"))
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    thinking = body.get("thinking")
    if thinking is not None:  # the template's switch (enable_thinking): a thinking model thinks or answers at once
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise BadRequest("thinking: must be {\"type\": \"enabled\" | \"disabled\" | \"adaptive\"}", "thinking")
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
        choice = body.get("tool_choice") or {"type": "auto"}
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise BadRequest("tool_choice: must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none",
                               "tool": {"type": "function", "function": {"name": choice.get("name")}}}[choice["type"]]
        chat["parallel_tool_calls"] = choice.get("disable_parallel_tool_use") is False  # (one call unless it says)
    return "chat", chat, {"fields": FIELDS}


def count_tokens(body: dict, server) -> dict:
    """/v1/messages/count_tokens: the prompt's tokens as /v1/messages would render them."""
    _, chat, _ = translate({**body, "max_tokens": 1}, server)
    prompt = chat_prompt(chat, server.vocab, server.max_seq_len)[0]
    return {"input_tokens": len(prompt)}


def system_messages(system) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, list):
        system = block_text(system, "system")
    if not isinstance(system, str):
        raise BadRequest("system: must be a string or a list of text blocks", "system")
    return [{"role": "system", "content": system}]


def block_text(blocks, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise BadRequest(f"{where}: must be a string or a list of text blocks", where)
    return joined_text(blocks, ("text",), "\n", lambda j: f"{where}.{j}")


def messages(given) -> list[dict]:
    """The messages' content blocks as chat messages: text joined, tool_use as the assistant's tool calls,
    tool_result as tool messages (before the rest of that user turn)."""
    if not isinstance(given, list) or not given:
        raise BadRequest("messages: must be a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(given):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequest(f"messages.{i}.role: must be user or assistant", f"messages.{i}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest(f"messages.{i}.content: must be a string or a list of content blocks",
                             f"messages.{i}.content")
        texts, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            where = f"messages.{i}.content.{j}"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and m["role"] == "assistant" and isinstance(block.get("name"), str):
                calls.append({"id": block.get("id") or "toolu", "type": "function",
                              "function": {"name": block["name"],
                                           "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and m["role"] == "user":
                result = block_text(block.get("content") or "", where + ".content")
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": ("Error: " if block.get("is_error") else "") + result})
            elif kind in ("thinking", "redacted_thinking"):  # (another model's thinking sent back)
                continue
            else:
                raise BadRequest(f"{where}: blocks of type {kind!r} are not supported here (text, tool_use, "
                                 "tool_result)", where)
        if texts or calls:
            out.append({"role": m["role"], "content": "\n".join(texts) if texts or not calls else None,
                        **({"tool_calls": calls} if calls else {})})
    return out


def chat_tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise BadRequest("tools: must be a list of {name, description, input_schema}", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or \
                tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadRequest(f"tools.{i}: only custom tools {{name, description, input_schema}} are served, got "
                             f"type {kind!r}", f"tools.{i}")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


class MessagesReply(Reply):
    """The pieces as content blocks: a text block for text, a tool_use block per call (its input streamed as
    input_json_delta pieces), in the order they come."""
    done_line, call_prefix = "", "toolu_"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.blocks, self.writing = [], None  # writing: the open block's index

    def frame(self, chunk: dict) -> str:
        return sse_event(chunk)

    def stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        job = self.jobs[0]
        if any(b["type"] == "tool_use" for b in self.blocks) and not self.call_cut(0, job.finish_reason):
            return "tool_use", None
        if job.finish_reason == "length":  # (also a tool call that max_tokens cut: not a call to make)
            return "max_tokens", None
        matched = job.output.held.matched if job.output.held is not None else None
        return ("stop_sequence", matched) if matched else ("end_turn", None)

    def message(self, final: bool) -> dict:
        reason, sequence = self.stop() if final else (None, None)
        job = self.jobs[0]
        content = [{k: v for k, v in b.items() if k != "json"} for b in self.blocks] if final else []
        return {"id": self.head["id"], "type": "message", "role": "assistant", "model": self.head["model"],
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": len(job.prompt), "output_tokens": len(job.generated) if final else 0}}

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": self.message(False)}, {"type": "ping"}]

    def end(self) -> list[dict]:
        return []

    def chunks(self, piece: Piece) -> list[dict]:
        if piece.kind == "error":
            return [error_body(BadRequest(piece.text, status=500))]
        if piece.kind in ("text", "thinking"):  # (a thinking block: the reasoning; its signature empty, ours)
            field = piece.kind
            if field == "text":
                self.note_text(piece)
            out = [] if self.writing is not None and self.blocks[self.writing]["type"] == field else \
                self.close() + self.open({"type": field, field: "", **({"signature": ""} if field == "thinking"
                                                                        else {})})
            self.blocks[self.writing][field] += piece.text
            return out + [{"type": "content_block_delta", "index": self.writing,
                           "delta": {"type": f"{field}_delta", field: piece.text}}]
        if piece.kind == "call":
            self.track(piece)
            call = self.calls[piece.index][piece.call]
            return self.close() + self.open({"type": "tool_use", "id": call["id"], "name": call["name"], "input": {},
                                             "json": ""})
        if piece.kind == "arguments":
            self.blocks[self.writing]["json"] += piece.text
            return [{"type": "content_block_delta", "index": self.writing,
                     "delta": {"type": "input_json_delta", "partial_json": piece.text}}]
        if piece.kind == "end":
            self.track(piece)
            return self.close()
        if piece.kind == "done":
            reason, sequence = self.stop()
            return self.close() + [{"type": "message_delta", "delta": {"stop_reason": reason,
                                                                       "stop_sequence": sequence},
                                    "usage": {"output_tokens": len(self.jobs[0].generated)}},
                                   {"type": "message_stop"}]
        return []

    def open(self, block: dict) -> list[dict]:
        self.blocks.append(block)
        self.writing = len(self.blocks) - 1
        shown = {k: v for k, v in block.items() if k != "json"}
        return [{"type": "content_block_start", "index": self.writing, "content_block": shown}]

    def close(self) -> list[dict]:
        if self.writing is None:
            return []
        at, self.writing = self.writing, None
        block = self.blocks[at]
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads(block["json"] or "{}")
            except json.JSONDecodeError:  # (cut off by max_tokens)
                block["input"] = {}
        return [{"type": "content_block_stop", "index": at}]

    def fold(self, piece: Piece) -> None:
        if piece.kind == "error":
            raise BadRequest(piece.text, status=500, kind="server_error")
        self.chunks(piece)

    def body(self) -> dict:
        return self.message(True)
