"""A thinking model's reasoning told apart from its answer (runtime/reasoning.py), in every API through its official
client: chat completions' reasoning_content (whole and streamed deltas), the Responses API's reasoning items,
Anthropic's thinking blocks, Ollama's message.thinking; the thinking opened by the model or by the prompt, and
switched off through each API's own field (chat_template_kwargs, thinking, think) reaching the template. The HTTP app
runs over a scripted scheduler (test_apis.py): its replies are the text a thinking model writes."""

import json
import re
import types

import pytest
from conftest import fixture_path
from test_apis import CALL, WEATHER, anthropic_client, ollama_client, openai_client
from test_apis import app_client as scripted_app

from dense_engine.formats.vocab import load_vocabulary
from dense_engine.runtime import reasoning

# Qwen3's switches, written small: enable_thinking false closes an empty thinking in the prompt; think_in_prompt
# opens one there (as Qwen3.5's and DeepSeek-R1's templates do), so that the reply starts inside it
TEMPLATE = ("{% if reasoning_effort is defined %}effort: {{ reasoning_effort }}\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% elif think_in_prompt is defined and think_in_prompt %}<think>\n{% endif %}{% endif %}")
THOUGHT, ANSWER = "The user asks for a capital.\nFrance's is Paris.", "The capital of France is Paris."
REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"


@pytest.fixture(scope="module")
def vocab():
    vocab = load_vocabulary(fixture_path("llama"), None)
    vocab.tokenizer.add_tokens(["<think>", "</think>"])  # (Qwen3's: added, not special: they stay in the text)
    vocab.chat_template = TEMPLATE
    return vocab


ASK = [{"role": "user", "content": "What is the capital of France?"}]


def app_client(vocab, text, **kw):
    """test_apis' app over a scripted scheduler, its model's vocabulary the thinking one's (two tokens added)."""
    http, scheduler = scripted_app(vocab, text, **kw)
    scheduler.model.config.vocab_size = vocab.size
    return http, scheduler


# ---- the split itself


@pytest.mark.parametrize("text, opened, want", [
    (REPLY, False, (THOUGHT + "\n", ANSWER)),
    (f"{THOUGHT}\n</think>\n\n{ANSWER}", True, (THOUGHT + "\n", ANSWER)),  # opened by the prompt
    (ANSWER, False, ("", ANSWER)),  # a reply without thinking
    (f"{ANSWER} <think>not a thought</think>", False, ("", f"{ANSWER} <think>not a thought</think>")),  # (mid-answer)
    ("<think>\ncut off by max_tokens", False, ("cut off by max_tokens", "")),
    ("\n\n<think>a</think>b", False, ("a", "b")),
    ("<thin", False, ("", "<thin")),  # (held back, then told at the end: not a marker)
])
def test_a_reply_splits_the_same_whole_and_in_every_pair_of_pieces(text, opened, want):
    assert reasoning.split(text, opened) == want
    for at in range(len(text) + 1):  # every place a piece may end; and a character at a time
        for pieces in ([text[:at], text[at:]], list(text)):
            stream = reasoning.ThinkStream(opened)
            told = [p for piece in pieces for p in stream.feed(piece)] + stream.finish()
            assert ("".join(t for kind, t in told if kind == "thinking"),
                    "".join(t for kind, t in told if kind == "text")) == want, (at, pieces)


def test_only_a_template_with_the_markers_thinks_and_a_prompt_may_open_it():
    assert reasoning.thinks(TEMPLATE) and not reasoning.thinks("{{ messages }}") and not reasoning.thinks(None)
    assert reasoning.opened("<|im_start|>assistant\n<think>\n") and not reasoning.opened("<think></think>\n\n")


# ---- each API, through its official client


def test_chat_completions_tell_reasoning_content_whole_and_streamed(vocab):
    http, scheduler = app_client(vocab, REPLY)
    client = openai_client(http)
    whole = client.chat.completions.create(model="m", messages=ASK, max_tokens=200)
    message = whole.choices[0].message
    assert message.content == ANSWER and message.model_extra["reasoning_content"] == THOUGHT + "\n"
    chunks = list(client.chat.completions.create(model="m", messages=ASK, max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert thought == THOUGHT + "\n" and "".join(d.content or "" for d in deltas) == ANSWER
    first_answer = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not d.model_extra.get("reasoning_content") for d in deltas[first_answer:])  # (the thinking first)
    # the template's switch, as vLLM and llama-server take it: the prompt closes an empty thinking
    client.chat.completions.create(model="m", messages=ASK, extra_body={"chat_template_kwargs": {
        "enable_thinking": False}})
    assert vocab.decode(scheduler.jobs[-1].prompt).endswith("<think>\n\n</think>\n\n")
    assert not vocab.decode(scheduler.jobs[0].prompt).endswith("</think>\n\n")
    for bad in ({"chat_template_kwargs": ["x"]}, {"chat_template_kwargs": {"messages": []}},
                {"reasoning_effort": "extreme"}):
        response = http.post("/v1/chat/completions", json={"model": "m", "messages": ASK, **bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == next(iter(bad)), bad


def test_a_prompt_that_opens_the_thinking_is_read_from_inside_it(vocab):
    http, scheduler = app_client(vocab, f"{THOUGHT}\n</think>\n\n{ANSWER}")
    message = openai_client(http).chat.completions.create(
        model="m", messages=ASK, extra_body={"chat_template_kwargs": {"think_in_prompt": True}}).choices[0].message
    assert vocab.decode(scheduler.jobs[-1].prompt).endswith("<think>\n")
    assert message.content == ANSWER and message.model_extra["reasoning_content"] == THOUGHT + "\n"


def test_a_tool_call_after_the_thinking_is_a_call(vocab):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    http, _ = app_client(vocab, f"<think>\nThe user wants the weather.\n</think>\n\n{CALL}")
    client = openai_client(http)
    whole = client.chat.completions.create(model="m", messages=ASK, tools=tools)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert message.model_extra["reasoning_content"] == "The user wants the weather.\n"
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=tools, stream=True))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert "".join(call[0].function.arguments or "" for call in calls) == '{"city": "Oslo"}'


def test_the_responses_api_tells_a_reasoning_item_before_the_message(vocab):
    http, scheduler = app_client(vocab, REPLY)
    client = openai_client(http)
    whole = client.responses.create(model="m", input="What is the capital of France?", reasoning={"effort": "low"})
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == THOUGHT + "\n" and whole.output_text == ANSWER
    events = list(client.responses.create(model="m", input="What is the capital of France?", stream=True))
    kinds = [e.type for e in events]
    once = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert once == ["response.created", "response.in_progress", "response.output_item.added",
                    "response.reasoning_text.delta", "response.reasoning_text.done", "response.output_item.done",
                    "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                    "response.output_text.done", "response.content_part.done", "response.output_item.done",
                    "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT + "\n"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    assert final.output[0].content[0].text == THOUGHT + "\n" and final.output[0].status == "completed"
    assert vocab.decode(scheduler.jobs[0].prompt).startswith("effort: low\n")  # (reasoning.effort: the template's)


def test_anthropic_messages_tell_a_thinking_block(vocab):
    http, scheduler = app_client(vocab, REPLY)
    client = anthropic_client(http)
    whole = client.messages.create(model="m", max_tokens=200, messages=ASK,
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == THOUGHT + "\n" and whole.content[1].text == ANSWER
    with client.messages.stream(model="m", max_tokens=200, messages=ASK) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == THOUGHT + "\n"
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas.index("text_delta") > max(i for i, d in enumerate(deltas) if d == "thinking_delta")
    client.messages.create(model="m", max_tokens=200, messages=ASK, thinking={"type": "disabled"})
    assert vocab.decode(scheduler.jobs[-1].prompt).endswith("<think>\n\n</think>\n\n")


def test_ollama_tells_message_thinking(vocab):
    http, scheduler = app_client(vocab, REPLY)
    client = ollama_client(http)
    whole = client.chat(model="m", messages=ASK, think=True)
    assert whole.message.thinking == THOUGHT + "\n" and whole.message.content == ANSWER
    parts = list(client.chat(model="m", messages=ASK, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHT + "\n"
    assert "".join(p.message.content or "" for p in parts) == ANSWER
    client.chat(model="m", messages=ASK, think=False)
    assert vocab.decode(scheduler.jobs[-1].prompt).endswith("<think>\n\n</think>\n\n")
    generated = client.generate(model="m", prompt="What is the capital of France?")
    assert generated.thinking == THOUGHT + "\n" and generated.response == ANSWER
    assert "thinking" in client.show("m").capabilities


# ---- chat.py


def test_chat_shows_the_answer_and_the_thinking_folded_to_one_dim_line_after_it():
    import io

    from rich.console import Console

    from dense_engine.cli import terminal

    plain = io.StringIO()
    view = terminal.ReplyView(Console(file=plain, force_terminal=False, width=300), markdown=False, thinking=False)
    for i in range(0, len(REPLY), 3):  # a few characters a token
        view.write(REPLY[i:i + 3])
    view.finish("stats")
    assert plain.getvalue() == f"{ANSWER}\nthought: {' '.join(THOUGHT.split())}\nstats\n"
    styled = io.StringIO()
    console = Console(file=styled, force_terminal=True, width=300, color_system="truecolor")
    view = terminal.ReplyView(console, markdown=True, thinking=True)  # (the prompt opened it)
    for i in range(0, len(REPLY) - 7, 4):
        view.write(REPLY[7:][i:i + 4])
    view.finish("stats")
    shown = styled.getvalue()
    assert "\x1b[2mthought: The user asks" in shown  # dim
    final = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown)
    assert final.rindex("The capital of France is Paris.") < final.rindex("thought: The user asks")
    assert terminal.folded("a\n\nb  c " + "x" * 300, 10) == "a b c xxx\u2026"


def test_slash_think_sets_the_templates_switch(vocab):
    import io

    from rich.console import Console

    from dense_engine.cli import repl

    out = io.StringIO()
    talk = repl.Conversation("chat")
    repl.command(None, vocab, talk, "/think off", Console(file=out), "ckpt", "", False, None)
    assert talk.options == {"enable_thinking": False} and "thinking off" in out.getvalue()
    ids, _ = repl.fit_conversation(types.SimpleNamespace(settings=types.SimpleNamespace(max_new_tokens=8),
                                                         max_seq_len=512), vocab, None, ASK, talk.options)
    assert vocab.decode(ids).endswith("<think>\n\n</think>\n\n")
    plain = load_vocabulary(fixture_path("llama"), None)  # (a template without thinking)
    repl.command(None, plain, talk, "/think on", Console(file=out), "ckpt", "", False, None)
    assert "no thinking to switch" in out.getvalue() and talk.options == {"enable_thinking": False}


def test_a_one_shot_prints_the_answer_and_then_the_thinking_on_one_line(vocab, capsys):
    import io

    from rich.console import Console

    import chat
    from dense_engine.cli.terminal import Notes

    def reply(ids, write):  # what a thinking model's session writes, a few characters a token
        assert vocab.decode(ids).endswith("assistant\n")
        for i in range(0, len(REPLY), 5):
            write(REPLY[i:i + 5])
        return [], types.SimpleNamespace(line=lambda: "stats")

    session = types.SimpleNamespace(max_seq_len=512, reply=reply, stop=None)
    args = types.SimpleNamespace(prompt="What is the [b]capital[/b] of France?", system=None, prompt_cache=None,
                                 stats=False)
    notes = io.StringIO()
    chat.one_shot(session, vocab, args, "chat", Notes(Console(file=notes, width=300)), 0.0)
    assert capsys.readouterr().out == ANSWER + "\n"  # (a pipe: the answer, its line closed)
    assert notes.getvalue() == f"thought: {' '.join(THOUGHT.split())}\n"


# ---- grammars that start later: a call in a reply that may be text, an answer after the thinking


def walk(constraint, vocab, text: str) -> list[bool]:
    """For each token of text: whether the constraint allowed it, then it is consumed."""
    allowed = []
    for token in vocab.encode(text, special=False):
        allowed.append(bool(constraint.bias("cpu")[token] == 0))
        constraint.consume(token)
    return allowed


def test_a_call_grammar_holds_from_the_calls_opener_on(vocab):
    from dense_engine.runtime import grammar, tools

    tool = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    lazy = tools.call_grammar(tool, None, "hermes", False, opened=True)
    V = vocab.size
    free = grammar.Lazy(lazy, grammar.tokenizer_for(vocab, V), V, tools.OPENERS["hermes"])
    assert all(walk(free, vocab, "Let me look that up. ")) and not free.done  # text: anything goes
    compact = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'  # (compact JSON)
    assert all(walk(free, vocab, compact)) and free.matcher.is_accepting()  # then a call the schema allows
    bad = grammar.Lazy(lazy, grammar.tokenizer_for(vocab, V), V, tools.OPENERS["hermes"])
    steps = walk(bad, vocab, 'Sure. <tool_call>\n{"name":"get_weather","arguments":{"town":"Oslo"}}')
    assert all(steps[:6]) and not all(steps)  # ("town": not a property the schema names)


def test_a_thinking_models_grammar_holds_after_its_thinking_or_from_the_first_token(vocab):
    from dense_engine.runtime import grammar

    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
    g, V = grammar.json_grammar(schema), vocab.size
    think = vocab.tokenizer.token_to_id("<think>")

    def lazy():
        return grammar.Lazy(g, grammar.tokenizer_for(vocab, V), V, reasoning.THINK.close, opens=think)

    thinker = lazy()
    assert all(walk(thinker, vocab, "<think>\nIt is Paris, surely.\n</think>"))  # the thinking: free
    assert all(walk(thinker, vocab, '{"capital":"Paris"}')) and thinker.matcher.is_accepting()
    assert not walk(thinker, vocab, "x")[0]
    direct = lazy()  # no thinking: the grammar from the first token (but <think> may open one)
    assert bool(direct.bias("cpu")[think] == 0) and not walk(lazy(), vocab, "Hello")[0]
    assert all(walk(direct, vocab, '{"capital":"Rome"}')) and direct.matcher.is_accepting()
    opened = grammar.Lazy(g, grammar.tokenizer_for(vocab, V), V, reasoning.THINK.close)  # (the prompt opened it)
    assert all(walk(opened, vocab, 'It is Paris.</think>{"capital":"Paris"}'))


def test_settings_make_the_grammar_lazy_where_the_model_may_write_text_or_think_first(vocab):
    from dense_engine.server import app, protocol

    tools_ = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    body = {"messages": ASK, "tools": tools_}
    auto = protocol.parse_request(body, "chat", vocab, 512)
    assert auto.trigger == "<tool_call>" and isinstance(app.constraint(auto, vocab, vocab.size), grammar_lazy())
    required = protocol.parse_request({**body, "tool_choice": "required"}, "chat", vocab, 512)
    assert required.trigger == reasoning.THINK.close and required.thinking is False
    assert app.constraint(required, vocab, vocab.size).opens == vocab.tokenizer.token_to_id("<think>")
    shaped = protocol.parse_request({"messages": ASK, "response_format": {"type": "json_object"},
                                     "chat_template_kwargs": {"think_in_prompt": True}}, "chat", vocab, 512)
    assert shaped.trigger == reasoning.THINK.close and shaped.thinking is True
    assert app.constraint(shaped, vocab, vocab.size).opens is None
    plain = load_vocabulary(fixture_path("llama"), None)  # (no thinking, no tools: a grammar from the first token)
    fixed = protocol.parse_request({"messages": ASK, "response_format": {"type": "json_object"}}, "chat", plain, 512)
    assert fixed.trigger is None and not isinstance(app.constraint(fixed, plain, plain.size), grammar_lazy())


def grammar_lazy():
    from dense_engine.runtime import grammar

    return grammar.Lazy


# ---- gpt-oss's channels (harmony): the analysis channel is the reasoning, the final channel the answer

# (harmony's turns, written small: each message <|start|>role<|channel|>...<|message|>...<|end|>; the reply's
# analysis message, then its final one, which the template writes back as the thinking and the content)
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}{% if m['role'] == 'assistant' %}"
    "{% if m.get('thinking') %}<|channel|>analysis<|message|>{{ m['thinking'] }}<|end|><|start|>assistant"
    "{% endif %}<|channel|>final<|message|>{{ m['content'] }}<|end|>{% else %}<|message|>{{ m['content'] }}<|end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")  # (cf. gpt-oss's own)
HARMONY_REPLY = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>"
                 f"{ANSWER}")
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>"]


@pytest.fixture(scope="module")
def harmony():
    """The fixture's vocabulary with harmony's tokens added as gpt-oss's tokenizer.json has them (special), and
    decoded as text as the engine loads them (with_markers_shown); <|return|> (the reply's end) stays special."""
    from tokenizers import AddedToken

    from dense_engine.formats.vocab import with_markers_shown

    vocab = load_vocabulary(fixture_path("llama"), None)
    vocab.tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    vocab.tokenizer = with_markers_shown(vocab.tokenizer)
    vocab.chat_template = HARMONY_TEMPLATE
    return vocab


@pytest.mark.parametrize("text, want", [
    (HARMONY_REPLY, (THOUGHT, ANSWER)),
    (f"<|channel|>final<|message|>{ANSWER}", ("", ANSWER)),  # (a reply straight to its final channel)
    (f"<|channel|>analysis<|message|>{THOUGHT}", (THOUGHT, "")),  # (cut off by max_tokens)
    (ANSWER, ("", ANSWER)),
])
def test_a_harmony_reply_splits_the_same_whole_and_in_every_pair_of_pieces(text, want):
    pair = reasoning.markers(HARMONY_TEMPLATE)
    assert pair is reasoning.HARMONY and reasoning.split(text, False, pair) == want
    for at in range(len(text) + 1):
        for pieces in ([text[:at], text[at:]], list(text)):
            stream = reasoning.ThinkStream(False, pair)
            told = [p for piece in pieces for p in stream.feed(piece)] + stream.finish()
            assert ("".join(t for kind, t in told if kind == "thinking"),
                    "".join(t for kind, t in told if kind == "text")) == want, (at, pieces)


def test_gpt_oss_channels_are_the_reasoning_and_the_answer_in_every_api(harmony):
    """Its markers are read from the decoded text (special in its tokenizer, shown as text), and its channels told
    apart in chat completions, the Responses API, Anthropic's messages and Ollama's chat."""
    ids = harmony.tokenizer.encode(HARMONY_REPLY, add_special_tokens=False).ids
    assert harmony.decode(ids) == HARMONY_REPLY and harmony.decode(harmony.encode("<|return|>", False)) == ""
    http, scheduler = app_client(harmony, HARMONY_REPLY)
    message = openai_client(http).chat.completions.create(model="m", messages=ASK, max_tokens=200).choices[0].message
    assert message.content == ANSWER and message.model_extra["reasoning_content"] == THOUGHT
    assert harmony.decode(scheduler.jobs[-1].prompt).endswith("<|end|><|start|>assistant")
    response = openai_client(http).responses.create(model="m", input="What is the capital of France?")
    assert [item.type for item in response.output] == ["reasoning", "message"] and response.output_text == ANSWER
    blocks = anthropic_client(http).messages.create(model="m", max_tokens=200, messages=ASK).content
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in blocks] == [
        ("thinking", THOUGHT), ("text", ANSWER)]
    chat = ollama_client(http).chat(model="m", messages=ASK, think=True)
    assert chat.message.thinking == THOUGHT and chat.message.content == ANSWER
