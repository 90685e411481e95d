"""tools.py: function calling for serve.py: tools rendered through the checkpoint's chat template, the model's reply
parsed into OpenAI tool calls, and the grammar that makes a reply a call when the request requires one.

Three reply formats, picked from what the chat template writes:
  hermes   <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>   (Qwen2.5/3, Hermes, SmolLM3, Granite;
                                                                          and the generic rendering below)
  llama3   {"name": ..., "parameters": {...}}                             (Llama 3.1-3.3's JSON tool calls)
  mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]           (Mistral)
A template that does not render tools gets them in a system message that asks for the hermes format, and tool
results as user messages in <tool_response> tags. Stands on grammar.py.
"""

from __future__ import annotations

import json
import re

from dense_engine.runtime import grammar

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
JSON_OPTIONS = {"whitespace_flexible": False}


def reply_format(template: str | None) -> str:
    template = template or ""
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
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": arguments_object(
                c["function"]["arguments"])}, ensure_ascii=False) + "\n</tool_call>" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()})
        else:
            out.append(m)
    if not tools:  # (earlier calls and results, no tools offered now)
        return out, None
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": out[0]["content"] + "\n\n" + system}] + out[1:], None
    return [{"role": "system", "content": system}] + out, None


def arguments_object(arguments):
    """OpenAI sends a call's arguments as a JSON string; chat templates expect the object."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def parse_calls(text: str, fmt: str, names: set[str]) -> list[dict]:
    """The calls in a reply, [{"name", "arguments": object}], or [] when it is text (or names no known function)."""
    found = []
    if fmt == "hermes":
        found = [load(body) for body in HERMES_CALL.findall(text)]
    else:
        body = text.strip().removeprefix("[TOOL_CALLS]").removeprefix("<|python_tag|>").strip()
        value = load(body)
        found = value if isinstance(value, list) else [value]
    calls = []
    for call in found:
        if not isinstance(call, dict) or call.get("name") not in names:
            return []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append({"name": call["name"], "arguments": arguments if isinstance(arguments, dict) else {}})
    return calls


def load(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def call_grammar(tools: list[dict], only: str | None, fmt: str, parallel: bool) -> str:
    """The grammar of a reply that is a call (of `only`, or of any tool), valid against its parameters' schema;
    more than one when parallel."""
    functions = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    key = "parameters" if fmt == "llama3" else "arguments"
    choices = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 key: f.get("parameters") or {"type": "object"}},
                "required": ["name", key], "additionalProperties": False} for f in functions]
    schema = {"x-guidance": JSON_OPTIONS, **(choices[0] if len(choices) == 1 else {"anyOf": choices})}
    call = "call: %json " + json.dumps(schema)
    if fmt == "hermes":
        one = '"<tool_call>\\n" call "\\n</tool_call>"'
        start = f"start: {one} (\"\\n\" {one})*" if parallel else f"start: {one}"
    elif fmt == "mistral":
        start = 'start: "[" call ("," call)* "]"' if parallel else 'start: "[" call "]"'
    else:
        start = "start: call"
    return grammar.llguidance().LLMatcher.grammar_from_lark(start + "\n" + call)
