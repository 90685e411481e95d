"""tools.py: function calling for serve.py: tools rendered through the checkpoint's chat template, the model's reply
read into tool calls as it is written (CallStream), and the grammar that makes a reply a call when the request
requires one.

Five reply formats, picked from what the chat template writes:
  hermes   <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>   (Qwen2.5/3, Hermes, SmolLM3, Granite;
                                                                          and the generic rendering below)
  llama3   {"name": ..., "parameters": {...}}                             (Llama 3.1-3.3's JSON tool calls)
  mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]           (Mistral 7B v0.3, Nemo)
  mistral_args  [TOOL_CALLS]NAME[ARGS]{...}, a [CALL_ID]id before [ARGS]  (Ministral 3, Devstral; Mistral Small 3.2)
  gemma4   <|tool_call>call:NAME{city:<|"|>Oslo<|"|>,days:3}<tool_call|>  (Gemma 4: its own value syntax)
A template that does not render tools gets them in a system message that asks for the hermes format, and tool
results as user messages in <tool_response> tags. Stands on grammar.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from dense_engine.runtime import grammar


def reply_format(template: str | None) -> str:
    template = template or ""
    if GEMMA_CALL in template:
        return "gemma4"
    if "[TOOL_CALLS]" in template and "[ARGS]" in template:
        return "mistral_args"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template or "tools" not in template:
        return "hermes"
    return "llama3"


def template_messages(messages: list[dict], tools: list[dict], template: str | None) -> tuple[list[dict], list | None]:
    """(messages, tools) to render. A template that renders tools gets them as transformers passes them, with each
    assistant call's arguments as an object; another gets a system message describing them (hermes format)."""
    def with_objects(m: dict) -> dict:
        calls = [{**c, "function": {**c["function"], "arguments": arguments_object(c["function"]["arguments"])}}
                 for c in m.get("tool_calls") or []]
        return {**m, "tool_calls": calls, "content": m.get("content") or ""} if calls else m

    if template and "[CALL_ID]" in template:  # (Mistral Small 3.2's template takes only ids of 9 letters and digits)
        messages = [{**m, **({"tool_call_id": nine(m["tool_call_id"])} if m.get("tool_call_id") else {}),
                     **({"tool_calls": [{**c, "id": nine(c.get("id") or "")} for c in m["tool_calls"]]}
                        if m.get("tool_calls") else {})} for m in messages]
    if template and "tools" in template:
        return [with_objects(m) for m in messages], tools or None
    described = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    system = ("You can call functions. To call one, reply with only:\n<tool_call>\n{\"name\": <function name>, "
              "\"arguments\": <arguments as a JSON object>}\n</tool_call>\nThe functions:\n" + described)
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                            "arguments": arguments_object(c["function"]["arguments"])},
                                                           ensure_ascii=False) + "\n</tool_call>"
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()})
        else:
            out.append(m)
    if not tools:  # (earlier calls and results, no tools offered now)
        return out, None
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": out[0]["content"] + "\n\n" + system}] + out[1:], None
    return [{"role": "system", "content": system}] + out, None


def nine(call_id: str) -> str:
    """A call's id as 9 letters and digits (the same for the same id: a call and its result stay paired)."""
    return call_id if len(call_id) == 9 and call_id.isalnum() else hashlib.sha256(call_id.encode()).hexdigest()[:9]


def arguments_object(arguments):
    """OpenAI sends a call's arguments as a JSON string; chat templates expect the object."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def load(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def call_grammar(tools: list[dict], only: str | None, fmt: str, parallel: bool, opened: bool = False,
                 token_id=lambda text: None) -> str:
    """The grammar of a reply that is a call (of `only`, or of any tool), valid against its parameters' schema;
    more than one when parallel. opened: of what follows the call's opener (OPENERS: the trigger of a lazy grammar,
    grammar.Lazy, when the model may answer in text instead). token_id: the vocabulary's id of a marker's token."""
    functions = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    if fmt == "gemma4":
        return gemma_grammar(functions, parallel, opened, token_id)
    mark = marker(token_id)
    if fmt == "mistral_args":  # each call: its opener, the name, [ARGS], the arguments' JSON
        schemas = [{"x-guidance": grammar.JSON_OPTIONS, **grammar.held(f.get("parameters") or {"type": "object"})}
                   for f in functions]
        calls = [f'call{i}: {json.dumps(f["name"])} ({mark("[CALL_ID]")} /[A-Za-z0-9]{{9}}/)? {mark("[ARGS]")} '
                 f'%json {json.dumps(schema)}' for i, (f, schema) in enumerate(zip(functions, schemas))]
        one = "(" + " | ".join(f"call{i}" for i in range(len(functions))) + ")"
        first = one if opened else f"{mark('[TOOL_CALLS]')} {one}"
        start = f"start: {first} ({mark('[TOOL_CALLS]')} {one})*" if parallel else f"start: {first}"
        return grammar.llguidance().LLMatcher.grammar_from_lark("\n".join([start] + calls))
    key = "parameters" if fmt == "llama3" else "arguments"
    choices = [{"type": "object",
                "properties": {"name": {"const": f["name"]},
                               key: grammar.held(f.get("parameters") or {"type": "object"})},
                "required": ["name", key], "additionalProperties": False} for f in functions]
    schema = {"x-guidance": grammar.JSON_OPTIONS, **(choices[0] if len(choices) == 1 else {"anyOf": choices})}
    call = "call: %json " + json.dumps(schema)
    if fmt == "hermes":
        one = '"<tool_call>\\n" call "\\n</tool_call>"'
        first = '"\\n" call "\\n</tool_call>"' if opened else one
        start = f"start: {first} (\"\\n\" {one})*" if parallel else f"start: {first}"
    elif fmt == "mistral":
        start = 'start: "[" call ("," call)* "]"' if parallel else 'start: "[" call "]"'
    else:
        start = "start: call"
    return grammar.llguidance().LLMatcher.grammar_from_lark(start + "\n" + call)


# ----------------------------------------------------------------------------------------------------------------
# Gemma 4's calls: call:NAME{key:value,...} between <|tool_call> and <tool_call|>; a value is a string between <|"|>
# quotes (nothing escaped), a {key:value} object with bare keys, a [list], or JSON's numbers, true, false and null.

GEMMA_CALL, GEMMA_CLOSE, GEMMA_QUOTE = "<|tool_call>call:", "<tool_call|>", '<|"|>'
GEMMA_SCALAR = re.compile(r"\s*(true|false|null|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)")
GEMMA_KEY = re.compile(r"\s*([^:{}\[\],<\s]+)\s*:")
GEMMA_HEAD = re.compile(r"\s*call:([^{]*)\{")


def gemma_value(text: str):
    """A value written in Gemma 4's syntax, as Python's; ValueError if it is not one."""
    value, at = gemma_read(text, 0)
    if text[at:].strip():
        raise ValueError(f"text after the value: {text[at:at + 20]!r}")
    return value


def gemma_read(text: str, at: int):
    """(the value that starts at `at`, where it ends)."""
    at = len(text) - len(text[at:].lstrip())
    if text.startswith(GEMMA_QUOTE, at):
        end = text.find(GEMMA_QUOTE, at + len(GEMMA_QUOTE))
        if end < 0:
            raise ValueError("a string not closed")
        return text[at + len(GEMMA_QUOTE):end], end + len(GEMMA_QUOTE)
    if text.startswith(("{", "["), at):
        closing, out = ("}", {}) if text[at] == "{" else ("]", [])
        at += 1
        while True:
            rest = text[at:].lstrip()
            if rest.startswith(closing) and not out:
                return out, len(text) - len(rest) + 1
            if isinstance(out, dict):
                key = GEMMA_KEY.match(text, at)
                quoted = not key and rest.startswith(GEMMA_QUOTE)
                if quoted:
                    name, at = gemma_read(text, at)
                    key = re.compile(r"\s*:").match(text, at)
                if key is None:
                    raise ValueError(f"no key at {text[at:at + 20]!r}")
                out[name if quoted else key.group(1)], at = gemma_read(text, key.end())
            else:
                value, at = gemma_read(text, at)
                out.append(value)
            rest = text[at:].lstrip()
            at = len(text) - len(rest) + 1
            if rest.startswith(closing):
                return out, at
            if not rest.startswith(","):
                raise ValueError(f"expected ',' or '{closing}' at {rest[:20]!r}")
    scalar = GEMMA_SCALAR.match(text, at)
    if scalar is None:
        raise ValueError(f"no value at {text[at:at + 20]!r}")
    return json.loads(scalar.group(1)), scalar.end()


def marker(token_id):
    """A marker in a grammar: the one token it is in the vocabulary (<[id]>: the tokenizer holds such tokens apart
    from text), else its text."""
    def mark(text: str) -> str:
        i = token_id(text)
        return f"<[{i}]>" if i is not None else json.dumps(text)
    return mark


def gemma_grammar(functions: list[dict], parallel: bool, opened: bool, token_id) -> str:
    """call_grammar's for gemma4: each function's name, then an object whose top-level keys are its parameters'
    (any of Gemma's values: its syntax has no schema to check them against), then the closer."""
    mark = marker(token_id)
    rules = []
    for i, f in enumerate(functions):
        keys = list((f.get("parameters") or {}).get("properties") or {})
        key = " | ".join(json.dumps(k) for k in keys) if keys else "KEY"
        rules += [f'call{i}: "call:" {json.dumps(f["name"])} "{{" (pair{i} ("," pair{i})*)? "}}"',
                  f'pair{i}: ({key}) ":" value']
    body = "(" + " | ".join(f"call{i}" for i in range(len(functions))) + ") " + mark(GEMMA_CLOSE)
    one = mark(OPENERS["gemma4"]) + " " + body
    first = body if opened else one
    rules += [f"start: {first} ({one})*" if parallel else f"start: {first}",
              'value: string | object | list | NUMBER | "true" | "false" | "null"',
              f"string: {mark(GEMMA_QUOTE)} /[^\\xff]*/ {mark(GEMMA_QUOTE)}",  # (a marker token's bytes start 0xFF)
              'object: "{" (KEY ":" value ("," KEY ":" value)*)? "}"',
              'list: "[" (value ("," value)*)? "]"',
              r"KEY: /[^:{}\[\],<\s\xff]+/",
              r"NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"]
    return grammar.llguidance().LLMatcher.grammar_from_lark("\n".join(rules))


# ----------------------------------------------------------------------------------------------------------------
# Tool calls read as the model writes them: a stream of text pieces in, ("text", s) / ("call", i, name) /
# ("arguments", i, piece) / ("end", i, name) out. A call's name is told as soon as it is written, its arguments
# piece by piece as they come (the JSON value as the model writes it), and no call text reaches the content. Text that
# could still open a call (a partial "<tool_call>", a llama3 reply's first "{") is held back, at most that many
# characters.

HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
OPENERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": None, "gemma4": "<|tool_call>",
           "mistral_args": "[TOOL_CALLS]"}
MISTRAL_HEAD = re.compile(r"\s*([^\[\]\s{]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")  # NAME([CALL_ID]id)[ARGS]
HERMES_CLOSE = "</tool_call>"
MAX_HEAD = 512  # characters after an opener with no {"name": "...", "arguments": yet: it is text after all


@dataclass
class ValueScan:
    """Where a JSON value (an object, list, string or number) ends in text that comes in pieces."""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False

    def end(self, text: str) -> int | None:
        """The index past the value's last character in this piece (a number: of what ends it), or None: it goes
        on in the next piece."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif c == '"':
                self.in_string, self.started = True, True
            elif c in "{[":
                self.depth, self.started = self.depth + 1, True
            elif c in "}]":
                if self.depth == 0:  # (a number's end: the call's closing brace)
                    return i
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif c in ", \n\t\r" and self.depth == 0 and self.started:
                return i
            else:
                self.started = True
        return None


class CallStream:
    """One reply's tool calls, read as its text comes (feed, then finish at its end). names: the tools offered (a
    call of another name is text); parallel False: only the first call is told."""

    def __init__(self, fmt: str, names, parallel: bool = True) -> None:
        self.fmt, self.names, self.parallel = fmt, names, parallel
        self.opener = OPENERS[fmt]
        self.part = "start" if fmt == "llama3" else "text"
        self.buf, self.calls, self.name = "", 0, None
        self.value: ValueScan | None = None  # where the arguments being read end

    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        return self.run(False)

    def finish(self) -> list[tuple]:
        return self.run(True)

    def run(self, final: bool) -> list[tuple]:
        out = []
        while True:
            before = (self.part, len(self.buf))
            getattr(self, "read_" + self.part)(out, final)
            if (self.part, len(self.buf)) == before:
                return [e for e in out if e[-1]]  # (no empty pieces)

    def told(self) -> bool:  # whether the call being read is told (parallel False: the first alone)
        return self.parallel or self.calls == 1

    # the parts of a reply, each read by its read_<part>

    def read_text(self, out, final) -> None:
        at = self.buf.find(self.opener)
        if at >= 0:
            out.append(("text", self.buf[:at]))
            self.buf, self.part = self.buf[at + len(self.opener):], "open" if self.fmt == "mistral" else "head"
            return
        keep = 0 if final else next((n for n in range(min(len(self.opener) - 1, len(self.buf)), 0, -1)
                                     if self.opener.startswith(self.buf[-n:])), 0)
        out.append(("text", self.buf[:len(self.buf) - keep]))
        self.buf = self.buf[len(self.buf) - keep:]

    def read_plain(self, out, final) -> None:  # text to the end
        out.append(("text", self.buf))
        self.buf = ""

    def read_start(self, out, final) -> None:  # (llama3) a call is the whole reply: "{" or <|python_tag|> first
        s = self.buf.lstrip()
        tag = "<|python_tag|>"
        if s.startswith((tag, "{")):
            self.buf, self.part = s.removeprefix(tag), "head"
        elif s and not tag.startswith(s) or final:
            self.part = "plain"

    def read_open(self, out, final) -> None:  # (mistral) [TOOL_CALLS] then a JSON list of calls
        s = self.buf.lstrip()
        if s.startswith("["):
            self.buf, self.part = s[1:], "head"
        elif s or final:
            self.buf, self.part = self.opener + self.buf, "plain"

    def read_head(self, out, final) -> None:
        if self.fmt == "gemma4":
            return self.gemma_call(out, final)
        if self.fmt == "mistral_args":
            return self.mistral_head(out, final)
        m = HEAD.match(self.buf)
        if m:
            name = json.loads('"' + m.group(1) + '"')
            if name in self.names:
                self.calls += 1
                self.name = name
                if self.told():
                    out.append(("call", self.calls - 1, name))
                self.buf, self.part, self.value = self.buf[m.end():], "arguments", None
                return
        closed = self.fmt == "hermes" and HERMES_CLOSE in self.buf
        if m or closed or final or len(self.buf) > MAX_HEAD:
            self.whole_call(out, closed)

    def whole_call(self, out, closed: bool) -> None:
        """A call not in the usual order ("arguments" first), or text after all: read whole, or told as text."""
        body = self.buf[:self.buf.find(HERMES_CLOSE)] if closed else self.buf
        value = load(body.strip().rstrip(",]").strip()) if self.fmt != "hermes" or closed else None
        arguments = value.get("arguments", value.get("parameters")) if isinstance(value, dict) else None
        if isinstance(value, dict) and value.get("name") in self.names and arguments is not None:
            self.calls += 1
            if self.told():
                out += [("call", self.calls - 1, value["name"]),
                        ("arguments", self.calls - 1, json.dumps(arguments, ensure_ascii=False)),
                        ("end", self.calls - 1, value["name"])]
            self.buf = self.buf[len(body) + len(HERMES_CLOSE):] if closed else ""
            self.part = "between"
            return
        self.as_text(out)

    def as_text(self, out) -> None:
        """What followed the opener is no call: the opener is text, and so is the rest of the reply unless calls
        come between text (hermes, gemma4; then look for the next opener)."""
        opened = "" if self.fmt == "llama3" else self.opener + ("[" if self.fmt == "mistral" else "")
        self.buf = opened + self.buf
        self.part = "plain" if self.fmt not in ("hermes", "gemma4", "mistral_args") or self.calls else "text"
        if self.part == "text":
            out.append(("text", self.buf[:len(self.opener)]))
            self.buf = self.buf[len(self.opener):]

    def mistral_head(self, out, final) -> None:
        """(mistral_args) NAME, maybe [CALL_ID]id, then [ARGS]: the call told, its JSON arguments next."""
        head = MISTRAL_HEAD.match(self.buf)
        if head is None and ("[ARGS]" in self.buf or final or len(self.buf) > MAX_HEAD) or \
                head is not None and head.group(1) not in self.names:
            return self.as_text(out)
        if head is None:
            return
        self.calls += 1
        self.name = head.group(1)
        if self.told():
            out.append(("call", self.calls - 1, self.name))
        self.buf, self.part, self.value = self.buf[head.end():], "arguments", None

    def gemma_call(self, out, final) -> None:
        """(gemma4) call:NAME{...} up to <tool_call|>, read whole; its arguments told as JSON."""
        head, at = GEMMA_HEAD.match(self.buf), self.buf.find(GEMMA_CLOSE)
        start = self.buf.lstrip()[:len("call:")]
        if not "call:".startswith(start) or head and head.group(1) not in self.names or \
                head is None and (at >= 0 or len(self.buf) > MAX_HEAD):
            return self.as_text(out)
        if at < 0 and not final:
            return
        try:
            arguments = gemma_value(self.buf[head.end() - 1:at if at >= 0 else len(self.buf)]) if head else None
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            return self.as_text(out)
        self.calls += 1
        if self.told():
            out += [("call", self.calls - 1, head.group(1)),
                    ("arguments", self.calls - 1, json.dumps(arguments, ensure_ascii=False)),
                    ("end", self.calls - 1, head.group(1))]
        self.buf, self.part = self.buf[at + len(GEMMA_CLOSE):] if at >= 0 else "", "between"

    def read_arguments(self, out, final) -> None:
        """The arguments' JSON value, told as it comes, up to its end (an object, list, string or number)."""
        if self.value is None:
            s = self.buf.lstrip()
            if not s:
                self.buf = ""
                return
            self.buf, self.value = s, ValueScan()
        end = self.value.end(self.buf)
        piece, self.buf = (self.buf, "") if end is None else (self.buf[:end], self.buf[end:])
        if self.told():
            out.append(("arguments", self.calls - 1, piece))
        if end is not None:
            self.part = "between" if self.fmt == "mistral_args" else "tail"  # (nothing closes its call)
            if self.told():
                out.append(("end", self.calls - 1, self.name))

    def read_tail(self, out, final) -> None:  # what closes a call: hermes' </tool_call>, else the object's "}"
        close = HERMES_CLOSE if self.fmt == "hermes" else "}"
        at = self.buf.find(close)
        if at >= 0:
            self.buf, self.part = self.buf[at + len(close):], "between"
        elif final:
            self.buf = ""

    def read_between(self, out, final) -> None:  # after a call: another one, or the end
        s = self.buf.lstrip()
        if not s:  # (whitespace after a call is no content)
            self.buf = "" if final else self.buf
            return
        if self.fmt in ("hermes", "gemma4", "mistral_args"):
            if s.startswith(self.opener):
                self.buf, self.part = s[len(self.opener):], "head"
            elif s and not self.opener.startswith(s) or final:
                self.part = "text"
        elif self.fmt == "mistral":
            if s.startswith(","):
                self.buf, self.part = s[1:], "head"
            elif s.startswith("]"):
                self.buf, self.part = s[1:], "plain"
            elif s or final:
                self.part = "plain"
        else:
            s = s.lstrip(";,").lstrip()
            if s.startswith("{"):
                self.buf, self.part = s, "head"
            elif s or final:
                self.part = "plain"
