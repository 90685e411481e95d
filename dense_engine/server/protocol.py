"""What a request asks, checked: OpenAI's chat and completions bodies -> one frozen Settings record and its prompts,
or BadRequest (a 4xx with OpenAI's error body naming the parameter). No HTTP here and no model: the vocabulary, the
context length and whether the server speculates are all it needs to know."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass

import torch

from dense_engine.formats.vocab import Vocabulary
from dense_engine.runtime import dry, grammar, reasoning, tools
from dense_engine.runtime.sampling import Defaults, SamplerSettings
from dense_engine.system.errors import UsageError

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
# Parameters that change results and are not implemented: refused by name (400), never ignored. Parameters this
# server does not know at all are ignored with one log line, as llama-server and vLLM do (front-ends send many).
REFUSED = {"functions": bool, "function_call": lambda v: v not in (None, "none"),
           "best_of": lambda v: v not in (None, 1), "suffix": lambda v: v not in (None, ""),
           "prediction": lambda v: v is not None, "audio": lambda v: v is not None,
           "modalities": lambda v: v not in (None, ["text"]),
           # samplers of llama-server's not served here: refused when they would act, accepted when off (front-ends
           # send their defaults)
           "mirostat": lambda v: v not in (None, 0),
           "xtc_probability": lambda v: v not in (None, 0, 0.0), "top_n_sigma": lambda v: v not in (None, -1, 0)}
IGNORED = ("model", "user", "metadata", "store", "service_tier", "guided_decoding_backend",
           "guided_whitespace_pattern")  # no effect on the text
SHARED = {"n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
          "stream_options", "logprobs", "response_format", "logit_bias", "presence_penalty", "frequency_penalty",
          "min_p", "typical_p", "repetition_penalty", "repeat_penalty", "repeat_last_n", "structured_outputs",
          "guided_json", "guided_regex", "guided_choice", "guided_grammar", "grammar", "json_schema", "dry_multiplier",
          "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers"}
# What shapes a reply (one at most): OpenAI's response_format, vLLM's structured_outputs and guided_* fields,
# llama-server's grammar (GBNF) and json_schema
SHAPES = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "grammar", "json_schema")
KNOWN = {"chat": {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                  "reasoning_effort"}, "completion": {
    "prompt", "echo"}}
# The bounds of a request (README, Serve): past one, a 400 naming the field. The body's size: serve.py --max-body-mb.
MAX_DEPTH = 64  # JSON nesting of a body
MAX_STOPS, MAX_STOP_CHARS = 16, 500  # stop strings, and the characters of each
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_TOOLS, MAX_TOOLS_CHARS = 64, 256_000  # tools, and their JSON's characters in all
MAX_SCHEMA_DEPTH = 32  # nesting of a JSON schema (response_format, a tool's parameters)
MAX_GRAMMAR_CHARS = 100_000  # a regex or a grammar
MAX_MESSAGES = 4096
MAX_PROMPTS = 64  # a completion's prompts (times n: a request's choices)
MAX_N = 8  # choices a prompt (n)
CHARS_PER_TOKEN = 32  # a prompt of more characters than this times the context cannot fit: refused before tokenizing
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # (json.loads pairs the valid ones into one character)


class BadRequest(Exception):
    """A request the server refuses: 4xx with OpenAI's error body naming the parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ToolCalling:
    """The tools a chat request offers: their names, the reply format the template's family writes calls in, whether
    several calls may come at once, and the grammar of a required call (None: the model may answer in text); when
    it may, the grammar of what follows a call's opener (lazy: from the opener on, grammar.Lazy)."""
    tools: list
    names: frozenset
    format: str
    parallel: bool
    grammar: str | None
    lazy: str | None = None


@dataclass(frozen=True)
class Settings:
    """One request's settings, checked: a prompt per choice (token ids), how to sample, when to stop, what to report."""
    prompts: list[list[int]]
    max_tokens: int
    sampler: SamplerSettings  # (its seed: always set, a random one when the body has none)
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives per token (0: the chosen one's alone); None: no logprobs
    echo: bool  # (completions) the prompt and its logprobs before the reply
    grammar: str | None  # a response_format's or a required tool call's
    calling: ToolCalling | None
    n: int = 1  # choices a prompt: prompts holds each prompt n times in a row (choice index = prompt * n + j)
    trigger: str | None = None  # the grammar holds from this text on (grammar.Lazy): a call's opener, </think>
    thinking: bool | None = None  # (chat) the reply's reasoning told apart; True: the prompt opened it (reasoning.py)


def decode_body(raw: bytes) -> dict:
    """A request's JSON body as Python values, or BadRequest: an object, nested at most MAX_DEPTH deep, no NaN or
    Infinity anywhere, lone surrogates (valid JSON escapes, invalid text) replaced by U+FFFD in every string."""
    def no_constants(name: str):
        raise BadRequest(f"the body is not valid JSON ({name} is not a number JSON allows)")

    try:
        body = json.loads(raw, parse_constant=no_constants)
    except RecursionError:
        raise BadRequest(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON ({getattr(e, 'msg', 'not UTF-8')})") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return clean(body, 0)


def clean(value, depth: int):
    """value with lone surrogates replaced in its strings; BadRequest when it nests deeper than MAX_DEPTH."""
    if depth > MAX_DEPTH:
        raise BadRequest(f"the body nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        return LONE_SURROGATE.sub("\ufffd", value) if LONE_SURROGATE.search(value) else value
    if isinstance(value, list):
        return [clean(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {clean(k, depth + 1): clean(v, depth + 1) for k, v in value.items()}
    return value


def depth_of(value) -> int:
    """How deep lists and objects nest in value (a scalar: 0)."""
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    return 0


def parse_request(body, kind: str, vocab: Vocabulary, max_seq_len: int, speculative: bool = False) -> Settings:
    """The settings of a JSON body (chat: messages rendered by the checkpoint's template; completion: the prompt as
    `chat.py --complete` tokenizes it), or BadRequest. The checks run in the order a reader meets the parameters."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    check_names(body, kind)
    thinking = None
    if kind == "chat":
        prompt, calling, thinking = chat_prompt(body, vocab, max_seq_len)
        prompts, logprobs, echo = [prompt], chat_logprobs(body), False
    else:
        prompts, calling = completion_prompts(body.get("prompt"), vocab, max_seq_len), None
        logprobs, echo = number(body, "logprobs", int, None, low=0, high=20), flag(body, "echo")
    n = number(body, "n", int, 1, low=1, high=MAX_N)
    if len(prompts) * n > MAX_PROMPTS:
        raise BadRequest(f"{len(prompts)} prompts x n {n} choices: at most {MAX_PROMPTS} choices a request", "n")
    prompts = [prompt for prompt in prompts for _ in range(n)]  # (each choice its own seed: make_jobs)
    if speculative:
        refuse_shaping(body, logprobs, echo)
    max_tokens = token_limit(body, prompts, "messages" if kind == "chat" else "prompt", max_seq_len, echo)
    stop, stream = stop_strings(body), flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise BadRequest("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    seed = number(body, "seed", int, None)
    seed = seed if seed is not None else int(torch.randint(2**62, ()))
    top_p = number(body, "top_p", float, None, low=0, high=1, low_open=True)
    top_k = number(body, "top_k", int, None, low=0)
    shape, trigger = requested_grammar(body, calling), None
    if shape is None and calling is not None and calling.lazy is not None:  # the model may call: from the opener on
        shape, trigger = calling.lazy, tools.OPENERS[calling.format]
    elif shape is not None and thinking is not None:  # a thinking model's grammar holds after its thinking
        trigger = reasoning.markers(vocab.chat_template).close
    bias = logit_bias(body.get("logit_bias"), vocab.size)
    presence = number(body, "presence_penalty", float, 0.0, low=-2, high=2)
    frequency = number(body, "frequency_penalty", float, 0.0, low=-2, high=2)
    min_p = number(body, "min_p", float, None, low=0, high=1)
    typical_p = number(body, "typical_p", float, None, low=0, high=1, low_open=True)
    if body.get("repetition_penalty") is not None and body.get("repeat_penalty") is not None:
        raise BadRequest("'repetition_penalty' and 'repeat_penalty' are one setting: send one of them",
                         "repeat_penalty")
    name = "repeat_penalty" if body.get("repeat_penalty") is not None else "repetition_penalty"
    repetition = number(body, name, float, None, low=0, high=10, low_open=True)
    repeat_last_n = number(body, "repeat_last_n", int, 64, low=-1)
    dry_fields = dry_settings(body)
    temperature = number(body, "temperature", float, None, low=0, high=2)
    # what the request does not say: the checkpoint's recommendation, else llama.cpp's defaults (sampling.Defaults)
    sampler, _ = Defaults.of_vocab(vocab).settings(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
        repetition_penalty=repetition, repeat_last_n=repeat_last_n, **dry_fields, presence_penalty=presence,
        frequency_penalty=frequency, logit_bias=bias, seed=seed)
    return Settings(prompts=prompts, max_tokens=max_tokens, sampler=sampler, stop=stop, stream=stream,
                    include_usage=options.get("include_usage", False), logprobs=logprobs, echo=echo, grammar=shape,
                    calling=calling, n=n, thinking=thinking, trigger=trigger)


def dry_settings(body: dict) -> dict:
    """llama-server's DRY fields, checked, as SamplerSettings' keywords (dry_multiplier 0 or absent: off)."""
    multiplier = number(body, "dry_multiplier", float, 0.0, low=0, high=100)
    base = number(body, "dry_base", float, 1.75, low=1, high=10)
    allowed = number(body, "dry_allowed_length", int, 2, low=1, high=1024)
    window = number(body, "dry_penalty_last_n", int, -1, low=-1)
    breakers = body.get("dry_sequence_breakers")
    breakers = list(dry.BREAKERS) if breakers is None else breakers
    if not isinstance(breakers, list) or len(breakers) > MAX_STOPS or not all(
            isinstance(b, str) and 0 < len(b) <= MAX_STOP_CHARS for b in breakers):
        raise BadRequest(f"'dry_sequence_breakers' must be a list of up to {MAX_STOPS} non-empty strings",
                         "dry_sequence_breakers")
    return {"dry_multiplier": multiplier, "dry_base": base, "dry_allowed_length": allowed,
            "dry_penalty_last_n": window, "dry_sequence_breakers": tuple(breakers)}


def check_names(body: dict, kind: str) -> None:
    """Refuse what changes results and is not implemented; note what is unknown (and ignored)."""
    check_fields(body, KNOWN[kind] | SHARED | set(IGNORED), REFUSED)


def check_fields(body: dict, known, refused: dict | None = None) -> None:
    """Any API's fields: a refused one that would act (its test says so) is a 400 naming it; one not known is
    noted in the log and ignored, as llama-server and vLLM do (front-ends send many)."""
    refused = refused or {}
    for name, value in body.items():
        if name in refused and refused[name](value):
            raise BadRequest(f"'{name}' is not supported by this server", name)
        if name not in known and name not in refused:
            note_unknown(name)


def note_unknown(name: str, what: str = "parameter") -> None:
    print(f"note: ignoring the unknown {what} '{name}'", file=sys.stderr, flush=True)


def chat_prompt(body: dict, vocab: Vocabulary, max_seq_len: int) -> tuple[list[int], ToolCalling | None, bool | None]:
    """The messages (and the tools offered) rendered by the checkpoint's chat template, as token ids; the tools; and
    for a template that thinks, whether the prompt leaves the thinking open (None: no thinking to tell apart).
    chat_template_kwargs and reasoning_effort are the template's own variables (enable_thinking, ...)."""
    messages = chat_messages(body.get("messages"))
    refuse_long_text(sum(len(m["content"] or "") for m in messages), "messages", max_seq_len)
    if not vocab.chat_template:
        raise BadRequest("this checkpoint has no chat template: use /v1/completions", "messages")
    keep = ("role", "content", "tool_calls", "tool_call_id", "name")
    messages = [{k: ("system" if k == "role" and v == "developer" else v) for k, v in m.items() if k in keep}
                for m in messages]
    calling, render_tools = tool_calling(body, vocab), None
    if calling is not None:
        messages, render_tools = tools.template_messages(messages, calling.tools, vocab.chat_template)
    elif any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        messages = tools.template_messages(messages, [], vocab.chat_template)[0]
    try:
        text = vocab.render(messages, render_tools, template_options(body))
    except UsageError as e:
        raise BadRequest(str(e), "messages") from None
    pair = reasoning.markers(vocab.chat_template)
    thinking = reasoning.opened(text, pair) if pair is not None else None
    return vocab.encode(text, special=False), calling, thinking


def template_options(body: dict) -> dict:
    """chat_template_kwargs (vLLM's and llama-server's: {"enable_thinking": false}, ...) and reasoning_effort, as
    the template's variables."""
    options = body.get("chat_template_kwargs") or {}
    if not isinstance(options, dict) or not all(isinstance(k, str) and k.isidentifier() for k in options) or \
            set(options) & {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}:
        raise BadRequest("'chat_template_kwargs' must be an object of the template's own variables (names)",
                         "chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in ("minimal", "low", "medium", "high", "none"):
        raise BadRequest("'reasoning_effort' must be one of none, minimal, low, medium, high", "reasoning_effort")
    return {**({"reasoning_effort": effort} if effort is not None else {}), **options}


def chat_messages(messages) -> list[dict]:
    """The messages, checked: objects with a role and a string content (an assistant's tool calls: content null)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"'messages' has {len(messages)} messages; at most {MAX_MESSAGES} a request", "messages")
    messages = [dict(m, content=message_text(m, i)) if isinstance(m, dict) else m for i, m in enumerate(messages)]
    for i, m in enumerate(messages):
        calls = isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")
        if not isinstance(m, dict) or not (isinstance(m.get("content"), str) or calls and m["content"] is None):
            raise BadRequest(f"messages[{i}] must be an object with a string 'content'", f"messages[{i}]")
        if m.get("role") not in CHAT_ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.get('role')!r}",
                             f"messages[{i}].role")
        if calls and not (isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                          and isinstance(c["function"].get("name"), str)
                                                          for c in calls)):
            raise BadRequest(f"messages[{i}].tool_calls must be a list of {{id, type, function: {{name, "
                             "arguments}}}", f"messages[{i}].tool_calls")
    return messages


def message_text(message: dict, i: int):
    """A message's content as one string: text content parts ([{"type": "text", "text": ...}]) joined; any other
    part refused by name. Other shapes are left for the caller's check."""
    content = message.get("content")
    if not isinstance(content, list):
        return content
    return joined_text(content, ("text",), "\n", lambda j: f"messages[{i}].content[{j}]")  # (as vLLM joins them)


def joined_text(parts: list, kinds: tuple, sep: str, name) -> str:
    """Text parts ({"type": one of kinds, "text": ...}, any API's) joined by sep; any other part refused by name
    (name(j): the field of part j)."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise BadRequest(f"{name(j)}: only text parts are supported, got type {kind!r}", name(j))
        texts.append(part["text"])
    return sep.join(texts)


def chat_logprobs(body: dict) -> int | None:
    logprobs = body.get("logprobs")
    if logprobs not in (None, True, False):
        raise BadRequest("'logprobs' must be true or false", "logprobs")
    top = number(body, "top_logprobs", int, None, low=0, high=20)
    if top is not None and not logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if logprobs else None


def tool_calling(body: dict, vocab: Vocabulary) -> ToolCalling | None:
    """The request's tools, checked, or None when there are none or tool_choice is "none"."""
    given, choice = body.get("tools"), body.get("tool_choice")
    if given in (None, []):
        if choice not in (None, "none"):
            raise BadRequest("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(given, list) or not all(
            isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and isinstance(t["function"].get("parameters", {}), dict)
            for t in given):
        raise BadRequest("'tools' must be a list of {type: function, function: {name, description, parameters}}",
                         "tools")
    if len(given) > MAX_TOOLS or len(json.dumps(given)) > MAX_TOOLS_CHARS:
        raise BadRequest(f"'tools' may hold at most {MAX_TOOLS} functions and {MAX_TOOLS_CHARS} characters of JSON",
                         "tools")
    if any(depth_of(t["function"].get("parameters", {})) > MAX_SCHEMA_DEPTH for t in given):
        raise BadRequest(f"a tool's 'parameters' schema nests deeper than {MAX_SCHEMA_DEPTH} levels", "tools")
    names = frozenset(t["function"]["name"] for t in given)
    choice = "auto" if choice is None else choice
    only = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (choice in ("none", "auto", "required") or only in names):
        raise BadRequest("'tool_choice' must be none, auto, required or a function of 'tools' "
                         f"({', '.join(sorted(names))})", "tool_choice")
    if choice == "none":
        return None
    parallel = body.get("parallel_tool_calls", False)  # (llama-server's default: one call unless asked for more)
    if not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    fmt = tools.reply_format(vocab.chat_template)
    forced = lazy = None
    try:
        if choice == "required" or only:
            forced = tools.call_grammar(given, only, fmt, parallel and not only, token_id=vocab.tokenizer.token_to_id)
        elif tools.OPENERS[fmt] is not None:  # (llama3's call is a whole reply: no opener to wait for)
            lazy = tools.call_grammar(given, None, fmt, parallel, opened=True, token_id=vocab.tokenizer.token_to_id)
    except UsageError as e:
        raise BadRequest(str(e), "tool_choice", status=500, kind="server_error") from None
    return ToolCalling(given, names, fmt, parallel, forced, lazy)


def completion_prompts(prompt, vocab: Vocabulary, max_seq_len: int) -> list[list[int]]:
    """A completion's prompts as token ids: a string, a list of strings (one choice each), a list of token ids, or
    a list of lists of ids (what evaluation harnesses send)."""
    def ids(value) -> bool:
        return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)

    if isinstance(prompt, str) or ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or ids(p) for p in prompt):
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of lists of "
                         "token ids", "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise BadRequest(f"'prompt' has {len(prompt)} prompts; at most {MAX_PROMPTS} a request", "prompt")
    refuse_long_text(max((len(p) for p in prompt if isinstance(p, str)), default=0), "prompt", max_seq_len)
    for p in prompt:
        if not isinstance(p, str) and not all(0 <= i < vocab.size for i in p):
            raise BadRequest(f"'prompt' has a token id outside 0..{vocab.size - 1}", "prompt")
    return [vocab.encode(p, special=True) if isinstance(p, str) else list(p) for p in prompt]


def refuse_long_text(chars: int, where: str, max_seq_len: int) -> None:
    """A text that cannot fit the context whatever its tokens, refused before the work of tokenizing it."""
    if chars > CHARS_PER_TOKEN * max_seq_len:
        raise BadRequest(f"'{where}' holds {chars} characters: more than the context holds ({max_seq_len} tokens)",
                         where, code="context_length_exceeded")


def refuse_shaping(body: dict, logprobs: int | None, echo: bool) -> None:
    """What speculative decoding does not serve (its tokens come from the draft and the check, not one sampler)."""
    shaping = {"logprobs": logprobs is not None, "echo": echo,
               **{name: True for name in shapes_given(body)},
               "logit_bias": bool(body.get("logit_bias")), "presence_penalty": bool(body.get("presence_penalty")),
               "frequency_penalty": bool(body.get("frequency_penalty"))}
    name = next((k for k, v in shaping.items() if v), None)
    if name is not None:
        raise BadRequest(f"'{name}' is not served with speculative decoding (--draft, --lookup)", name)


def token_limit(body: dict, prompts: list[list[int]], where: str, max_seq_len: int, echo: bool) -> int:
    """max_tokens (or max_completion_tokens), clamped to the context the longest prompt leaves ("length" there); 0
    only with echo (an evaluation harness's log-likelihoods)."""
    for prompt in prompts:
        if not prompt:
            raise BadRequest("the prompt is empty", where)
        if len(prompt) >= max_seq_len:
            raise BadRequest(f"the prompt has {len(prompt)} tokens; the context holds {max_seq_len}", where,
                             code="context_length_exceeded")
    room = max_seq_len - max(len(p) for p in prompts)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return min(number(body, name, int, room, low=0 if echo else 1), room)


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop) or \
            len(stop) > MAX_STOPS:
        raise BadRequest(f"'stop' must be a string or a list of up to {MAX_STOPS} non-empty strings of at most "
                         f"{MAX_STOP_CHARS} characters", "stop")
    return stop


def shapes_given(body: dict) -> list[str]:
    """The fields of SHAPES the body sets (a text response_format shapes nothing)."""
    return [name for name in SHAPES if body.get(name) not in (None, "", {"type": "text"})]


def requested_grammar(body: dict, calling: ToolCalling | None) -> str | None:
    """The grammar the request asks its reply to follow (a required tool call's, or one of SHAPES), compiled; None
    when nothing shapes it. Two shapes at once are refused: they would not both hold."""
    given = shapes_given(body)
    if calling is not None and calling.grammar is not None:
        # a response_format shapes text, and a required call's reply has none (agents send both on every step)
        given = [name for name in given if name != "response_format"]
        if given:
            raise BadRequest(f"'{given[0]}' and a required tool call cannot both shape the reply", given[0])
        return calling.grammar
    if len(given) > 1:
        raise BadRequest(f"'{given[0]}' and '{given[1]}' cannot both shape the reply", given[1])
    if not given:
        return None
    name, value = given[0], body[given[0]]
    if name == "response_format":
        return response_grammar(value)
    if name == "structured_outputs":
        named = ("json", "regex", "choice", "grammar", "json_object")
        kinds = [k for k in named if value.get(k) not in (None, False)] if isinstance(value, dict) else []
        if len(kinds) != 1:
            raise BadRequest("'structured_outputs' must hold one of json, regex, choice, grammar or json_object",
                             name)
        kind = kinds[0]
        name, value = f"structured_outputs.{kind}", value[kind]
        kind = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                "grammar": "guided_grammar", "json_object": "json_object"}[kind]
    else:
        kind = name
    try:
        if kind == "json_object":
            return grammar.json_grammar(None)
        if kind in ("guided_json", "json_schema"):
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, dict) or depth_of(schema) > MAX_SCHEMA_DEPTH:
                raise ValueError(f"a JSON schema is an object nested at most {MAX_SCHEMA_DEPTH} levels")
            return grammar.json_grammar(schema)
        if kind == "guided_choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError("a choice is a non-empty list of non-empty strings")
            return grammar.choice_grammar(value)
        if not isinstance(value, str) or len(value) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"a grammar is a string of at most {MAX_GRAMMAR_CHARS} characters")
        return grammar.regex_grammar(value) if kind == "guided_regex" else grammar.lark_grammar(value)
    except (ValueError, json.JSONDecodeError) as e:
        raise BadRequest(f"'{name}' cannot be used: {e}", name) from None
    except UsageError as e:
        raise BadRequest(str(e), name, status=500, kind="server_error") from None


def response_grammar(response_format) -> str | None:
    """The grammar of `response_format`: None for text, any JSON object, or JSON valid against a schema."""
    if response_format in (None, {"type": "text"}):
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    try:
        if kind == "json_object":
            return grammar.json_grammar(None)
        spec = response_format.get("json_schema") if kind == "json_schema" else None
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise BadRequest("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                             "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\"}}",
                             "response_format")
        if depth_of(spec.get("schema") or {}) > MAX_SCHEMA_DEPTH:
            raise BadRequest(f"'response_format': the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels",
                             "response_format")
        return grammar.json_grammar(spec.get("schema") or {})
    except ValueError as e:
        raise BadRequest(f"'response_format': the JSON schema cannot be used ({e})", "response_format") from None
    except UsageError as e:
        raise BadRequest(str(e), "response_format", status=500, kind="server_error") from None


def logit_bias(value, size: int) -> dict[int, float]:
    """OpenAI's logit_bias, {"token id": -100..100}, as {id: bias}."""
    if value is None:
        return {}
    if isinstance(value, dict) and len(value) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' has {len(value)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
    out = {}
    if isinstance(value, dict):
        for key, bias in value.items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < size or isinstance(bias, bool) or not isinstance(bias, (int, float)) or \
                    not -100 <= bias <= 100:
                break
            out[token] = float(bias)
        else:
            return out
    raise BadRequest(f"'logit_bias' must map token ids (0..{size - 1}) to numbers in -100..100", "logit_bias")


def flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false", name)
    return value


def number(body: dict, name: str, kind, default, low=None, high=None, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise BadRequest(f"'{name}' must be {'a number' if kind is float else 'an integer'}, got {value!r}", name)
    if low is not None and (value <= low if low_open else value < low):
        raise BadRequest(f"'{name}' must be {'above' if low_open else 'at least'} {low}, got {value}", name)
    if high is not None and value > high:
        raise BadRequest(f"'{name}' must be at most {high}, got {value}", name)
    return kind(value)
