"""OpenAI's Responses API (/v1/responses), what the OpenAI Agents SDK and newer OpenAI client code call: a translator
of its request into a chat completion's body (input items -> messages, flat function tools -> chat tools,
text.format -> response_format, max_output_tokens -> max_tokens), and a Reply that tells the same pieces as
Responses events (response.created ... response.output_text.delta ... response.function_call_arguments.delta ...
response.completed) or folds them into one Response. A response is kept (unless `store: false`) in a bounded
in-memory store, so that `previous_response_id` continues its conversation and GET /v1/responses/{id} reads it."""

from __future__ import annotations

import copy
import threading
import uuid
from collections import OrderedDict

from dense_engine.server.protocol import BadRequest, check_fields, joined_text
from dense_engine.server.responses import Piece, Reply, sse_event

STORED_RESPONSES = 1024  # responses kept for previous_response_id, the least recently used dropped first
# fields that change nothing here (accepted, as OpenAI's clients send them); fields that would change the result
# and are not served: refused by name
IGNORED = {"model", "include", "truncation", "reasoning", "metadata", "user", "service_tier", "store",
           "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
           "context_management", "max_tool_calls", "stream_options"}
REFUSED = {"background": lambda v: v not in (None, False), "conversation": lambda v: v is not None,
           "prompt": lambda v: v is not None, "top_logprobs": lambda v: v not in (None, 0)}
PASSED = {"temperature", "top_p", "top_k", "seed", "stop", "stream", "parallel_tool_calls", "logit_bias",
          "presence_penalty", "frequency_penalty", "min_p", "typical_p", "repetition_penalty", "repeat_penalty",
          "repeat_last_n", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
          "dry_sequence_breakers"}  # (the samplers beyond OpenAI's: vLLM's and llama-server's names, as in chat)
FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}  # chat -> ours


class Store:
    """id -> (the Response, the conversation it ends: chat messages), at most `limit`, least recently used out."""

    def __init__(self, limit: int) -> None:
        self.limit, self.items, self.lock = limit, OrderedDict(), threading.Lock()

    def put(self, key: str, response: dict, messages: list[dict]) -> None:
        with self.lock:
            self.items[key] = (response, messages)
            while len(self.items) > self.limit:
                self.items.popitem(last=False)

    def entry(self, key: str, forget: bool = False):
        with self.lock:
            found = self.items.pop(key, None) if forget else self.items.get(key)
            if found is not None and not forget:
                self.items.move_to_end(key)
            return found

    def get(self, key: str, forget: bool = False) -> dict | None:
        found = self.entry(key, forget)
        return None if found is None else ({"id": key, "object": "response", "deleted": True} if forget else found[0])


STORE = Store(STORED_RESPONSES)


def translate(body: dict, server) -> tuple[str, dict, dict]:
    """A Responses request -> ("chat", the chat completion's body, what the reply needs of the request)."""
    check_fields(body, IGNORED | PASSED | {"input", "instructions", "tools", "tool_choice", "text",
                                           "max_output_tokens", "previous_response_id"}, REFUSED)
    earlier, previous = [], body.get("previous_response_id")
    if previous is not None:
        found = STORE.entry(previous) if isinstance(previous, str) else None
        if found is None:
            raise BadRequest(f"'previous_response_id': no stored response '{previous}' (a response made with "
                             "store: false, or one the server no longer holds)", "previous_response_id",
                             code="previous_response_not_found")
        earlier = found[1]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", "instructions")
    conversation = earlier + input_messages(body.get("input"))
    chat = {name: body[name] for name in PASSED if name in body}
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    if body.get("tools") is not None:
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict) or not isinstance(text.get("format", {}), dict):
            raise BadRequest("'text' must be an object {\"format\": {...}}", "text")
        chat["response_format"] = response_format(text.get("format") or {"type": "text"})
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:  # (the template's reasoning_effort)
        chat["reasoning_effort"] = reasoning["effort"]
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise BadRequest("'store' must be true or false", "store")
    meta = {"conversation": conversation, "instructions": instructions, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"), "store": store, "previous_response_id": previous,
            "text": text or {"format": {"type": "text"}}, "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls", False), "metadata": body.get("metadata") or {},
            "fields": FIELDS}
    return "chat", chat, meta


def input_messages(given) -> list[dict]:
    """`input` (a string, or items: messages, function_call, function_call_output) as chat messages."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise BadRequest("'input' must be a string or a non-empty list of items", "input")
    messages = []
    for i, item in enumerate(given):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": item_text(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str):
                raise BadRequest(f"input[{i}]: a function_call has a string 'name' and 'arguments'", f"input[{i}]")
            call = {"id": item.get("call_id") or item.get("id") or "call", "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and ("tool_calls" in last or not last["content"]):
                last.setdefault("tool_calls", []).append(call)  # (parallel calls: one assistant message)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": item_text(item.get("output"), f"input[{i}].output")})
        elif kind == "reasoning":  # (a reasoning model's items sent back: nothing of this server's)
            continue
        else:
            raise BadRequest(f"input[{i}]: items of type {kind!r} are not supported (message, function_call, "
                             "function_call_output)", f"input[{i}].type")
    return messages


def item_text(content, where: str) -> str:
    """A message's content (a string, or input_text / output_text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content must be a string or a list of text parts", where)
    return joined_text(content, ("input_text", "output_text", "text"), "", lambda j: f"{where}.content[{j}]")


def chat_tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadRequest(f"tools[{i}]: only function tools {{type: function, name, parameters}} are served, "
                             f"got type {kind!r}", f"tools[{i}]")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice):
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                     "tool_choice")


def response_format(fmt: dict) -> dict:
    """text.format -> chat's response_format (json_schema's fields sit one level up in the Responses API)."""
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


def item_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class ResponsesReply(Reply):
    """The pieces as Responses output items: a message (output_text) for text, a function_call per call, in the
    order they come. Streamed: the API's events with their sequence numbers; whole: the Response they build (the
    same items: fold runs the stream's steps and drops the events)."""
    done_line = ""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.items, self.writing, self.sequence, self.final = [], None, 0, None  # writing: the open message
        self.reasoning = None  # the open reasoning item's index

    def frame(self, chunk: dict) -> str:
        return sse_event(chunk)

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **copy.deepcopy(fields)}

    def response(self, status: str, error: dict | None = None) -> dict:
        meta, done = self.meta, status in ("completed", "incomplete")
        job = self.jobs[0]
        prompt, generated = len(job.prompt), len(job.generated)
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": generated,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + generated}
        return {"id": self.head["id"], "object": "response", "created_at": self.head["created"], "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": meta.get("instructions"), "max_output_tokens": meta.get("max_output_tokens"),
                "model": self.head["model"], "output": copy.deepcopy(self.items),
                "parallel_tool_calls": meta.get("parallel_tool_calls", False),
                "previous_response_id": meta.get("previous_response_id"), "reasoning": {"effort": None,
                                                                                       "summary": None},
                "store": meta.get("store", True),
                "temperature": self.settings.sampler.temperature if self.settings else 1.0,
                "text": meta.get("text", {"format": {"type": "text"}}), "tool_choice": meta.get("tool_choice", "auto"),
                "tools": meta.get("tools", []), "top_p": self.settings.sampler.top_p if self.settings else None,
                "truncation": "disabled", "usage": usage if done else None, "user": None,
                "metadata": meta.get("metadata", {})}

    def start(self) -> list[dict]:
        snapshot = self.response("in_progress")
        return [self.event("response.created", response=snapshot), self.event("response.in_progress",
                                                                                response=snapshot)]

    def end(self) -> list[dict]:
        return []

    def chunks(self, piece: Piece) -> list[dict]:
        if piece.kind == "error":
            return [self.event("response.failed", response=self.response(
                "failed", {"code": "server_error", "message": piece.text}))]
        if piece.kind == "thinking":  # a reasoning item, its text as reasoning_text
            out = self.open_reasoning()
            item = self.items[self.reasoning]
            item["content"][0]["text"] += piece.text
            return out + [self.event("response.reasoning_text.delta", item_id=item["id"],
                                     output_index=self.reasoning, content_index=0, delta=piece.text)]
        return self.close_reasoning() + self.told(piece)

    def told(self, piece: Piece) -> list[dict]:
        """A piece of the answer: its text, calls, or the end."""
        if piece.kind == "text":
            out = self.open_message()
            item = self.items[self.writing]
            item["content"][0]["text"] += piece.text
            return out + [self.event("response.output_text.delta", item_id=item["id"], output_index=self.writing,
                                     content_index=0, delta=piece.text, logprobs=[])]
        if piece.kind == "call":
            out = self.close_message()
            self.track(piece)
            call = self.calls[piece.index][piece.call]
            self.items.append({"type": "function_call", "id": item_id("fc_"), "call_id": call["id"],
                               "name": call["name"], "arguments": "", "status": "in_progress"})
            call["item"] = len(self.items) - 1
            return out + [self.event("response.output_item.added", output_index=call["item"],
                                     item=self.items[call["item"]])]
        if piece.kind == "arguments":
            self.track(piece)
            at = self.calls[piece.index][piece.call]["item"]
            self.items[at]["arguments"] += piece.text
            return [self.event("response.function_call_arguments.delta", item_id=self.items[at]["id"],
                               output_index=at, delta=piece.text)]
        if piece.kind == "end":
            return self.close_call(self.calls[piece.index][piece.call]["item"])
        if piece.kind == "done":
            out = self.close_message()
            for at, item in enumerate(self.items):  # (a call cut off by the length)
                if item["status"] == "in_progress":
                    out += self.close_call(at)
            status = "incomplete" if self.jobs[0].finish_reason == "length" else "completed"
            self.final = self.response(status)
            self.keep()
            return out + [self.event("response." + status, response=self.final)]
        return []

    def open_reasoning(self) -> list[dict]:
        if self.reasoning is not None:
            return []
        self.items.append({"type": "reasoning", "id": item_id("rs_"), "summary": [], "status": "in_progress",
                           "content": [{"type": "reasoning_text", "text": ""}]})
        self.reasoning = len(self.items) - 1
        return [self.event("response.output_item.added", output_index=self.reasoning, item=self.items[-1])]

    def close_reasoning(self) -> list[dict]:
        if self.reasoning is None:
            return []
        at, self.reasoning = self.reasoning, None
        item = self.items[at]
        item["status"] = "completed"
        return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                           text=item["content"][0]["text"]),
                self.event("response.output_item.done", output_index=at, item=item)]

    def open_message(self) -> list[dict]:
        if self.writing is not None:
            return []
        self.items.append({"type": "message", "id": item_id("msg_"), "status": "in_progress", "role": "assistant",
                           "content": []})
        self.writing = len(self.items) - 1
        item = self.items[self.writing]
        out = [self.event("response.output_item.added", output_index=self.writing, item=item)]
        item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        return out + [self.event("response.content_part.added", item_id=item["id"], output_index=self.writing,
                                 content_index=0, part=item["content"][0])]

    def close_message(self) -> list[dict]:
        if self.writing is None:
            return []
        at, self.writing = self.writing, None
        item = self.items[at]
        item["status"] = "completed"
        part = item["content"][0]
        return [self.event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=at, item=item)]

    def close_call(self, at: int) -> list[dict]:
        item = self.items[at]
        item["status"] = "completed"
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=at, item=item)]

    def keep(self) -> None:
        """The response and its conversation (for previous_response_id), unless store is false."""
        if not self.meta.get("store", True):
            return
        text = "".join(part["text"] for item in self.items if item["type"] == "message" for part in item["content"])
        calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                          "arguments": item["arguments"]}}
                 for item in self.items if item["type"] == "function_call"]
        said = {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}
        STORE.put(self.head["id"], self.final, self.meta.get("conversation", []) + [said])

    def fold(self, piece: Piece) -> None:
        if piece.kind == "error":
            raise BadRequest(piece.text, status=500, kind="server_error")
        self.chunks(piece)

    def body(self) -> dict:
        return self.final
