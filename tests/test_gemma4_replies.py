"""Gemma 4's replies through the server: its thinking channel (<|channel>thought ... <channel|>) told apart as each
API's reasoning, and its tool calls (<|tool_call>call:NAME{key:<|"|>text<|"|>}<tool_call|>, a syntax of its own) told
as each API's calls, through the official clients; the grammar of a required call; and the markers, which Gemma 4's
tokenizer.json calls special, kept in the text. The template is Gemma 4's own (tests/fixtures/templates/gemma4.jinja);
the HTTP app runs over test_apis' scripted scheduler: its replies are the text Gemma 4 writes."""

import json
import os
import shutil

import pytest
from conftest import fixture_path
from test_apis import anthropic_client, ollama_client, openai_client
from test_reasoning import app_client  # (test_apis' scripted app, its model's vocabulary the vocabulary's size)

from dense_engine.formats.vocab import load_vocabulary
from dense_engine.runtime import reasoning, tools

HERE = os.path.dirname(os.path.abspath(__file__))
MARKERS = ["<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>", "<|tool_call>",
           "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>']
THOUGHT, ANSWER = "The user asks for a capital.\nFrance's is Paris.", "The capital of France is Paris."
REPLY = f"<|channel>thought\n{THOUGHT}<channel|>{ANSWER}"
CALL = '<|tool_call>call:get_weather{city:<|"|>Oslo, Norway<|"|>,days:3}<tool_call|>'
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast.",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    """A folder as Gemma 4's are saved: its markers special tokens of tokenizer.json, <turn|> the end of text, the
    template in chat_template.jinja (the fixture's small tokenizer under them)."""
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("gemma4")
    tokenizer = Tokenizer.from_file(os.path.join(fixture_path("llama"), "tokenizer.json"))
    tokenizer.add_special_tokens(MARKERS)
    tokenizer.save(str(folder / "tokenizer.json"))
    shutil.copy(os.path.join(HERE, "fixtures", "templates", "gemma4.jinja"), folder / "chat_template.jinja")
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<turn|>"}))
    return load_vocabulary(str(folder), None)


def test_the_markers_stay_in_the_text_and_a_call_ends_the_turn(vocab):
    ids = vocab.encode("<|turn>model\n" + REPLY + "<turn|>", special=False)
    assert vocab.decode(ids) == "model\n" + REPLY  # (<|turn> and <turn|>: special, skipped as transformers does)
    assert vocab.tokenizer.token_to_id("<|tool_response>") in vocab.stop_ids
    assert vocab.tokenizer.token_to_id("<turn|>") in vocab.stop_ids
    assert reasoning.markers(vocab.chat_template) == reasoning.CHANNEL
    assert tools.reply_format(vocab.chat_template) == "gemma4"


@pytest.mark.parametrize("text, want", [
    ('{city:<|"|>Oslo, {Norway}<|"|>,days:3,hourly:false,at:null,temps:[-1.5,2e3],where:{lat:59.9}}',
     {"city": "Oslo, {Norway}", "days": 3, "hourly": False, "at": None, "temps": [-1.5, 2000.0],
      "where": {"lat": 59.9}}),
    ('{ <|"|>a key<|"|>: [ ], b : { } }', {"a key": [], "b": {}}),
])
def test_gemma_values_read_as_json_values(text, want):
    assert tools.gemma_value(text) == want


@pytest.mark.parametrize("text", ["{city:Oslo}", "{a:1,}", '{a:<|"|>x}', "{a 1}", "{a:1} more", "[1 2]"])
def test_what_is_not_a_gemma_value_is_refused(text):
    with pytest.raises(ValueError):
        tools.gemma_value(text)


def test_the_switch_reaches_the_template_and_the_thinking_is_told_apart(vocab):
    http, scheduler = app_client(vocab, REPLY)
    client = openai_client(http)
    message = client.chat.completions.create(model="m", messages=ASK).choices[0].message
    # thinking off (the template's default): the prompt closes an empty thought channel
    assert vocab.decode(scheduler.jobs[-1].prompt).endswith("model\n<|channel>thought\n<channel|>")
    assert message.content == ANSWER and message.model_extra["reasoning_content"] == THOUGHT
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    chunks = list(client.chat.completions.create(model="m", messages=ASK, stream=True, extra_body=on))
    think = vocab.tokenizer.token_to_id("<|think|>")  # (special: not in the decoded text)
    assert think in scheduler.jobs[-1].prompt and vocab.decode(scheduler.jobs[-1].prompt).endswith("model\n")
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ANSWER
    whole = anthropic_client(http).messages.create(model="m", max_tokens=200, messages=ASK,
                                                   thinking={"type": "enabled", "budget_tokens": 512})
    assert [b.type for b in whole.content] == ["thinking", "text"] and whole.content[0].thinking == THOUGHT
    assert think in scheduler.jobs[-1].prompt
    said = ollama_client(http).chat(model="m", messages=ASK, think=True)
    assert said.message.thinking == THOUGHT and said.message.content == ANSWER


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_is_told_as_a_call_after_the_thinking(vocab, stream):
    http, _ = app_client(vocab, f"<|channel>thought\nThe user wants the weather.<channel|>{CALL}<|tool_response>")
    reply = openai_client(http).chat.completions.create(model="m", messages=ASK, tools=TOOLS, stream=stream)
    if stream:
        deltas = [c.choices[0].delta for c in reply if c.choices]
        calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
        assert [c.function.name for c in calls if c.function.name] == ["get_weather"]
        arguments = "".join(c.function.arguments or "" for c in calls)
        thought = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
        assert not "".join(d.content or "" for d in deltas)
    else:
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
        arguments, thought = message.tool_calls[0].function.arguments, message.model_extra["reasoning_content"]
    assert json.loads(arguments) == {"city": "Oslo, Norway", "days": 3} and thought == "The user wants the weather."


def test_calls_between_text_and_two_at_once(vocab):
    second = '<|tool_call>call:get_weather{city:<|"|>Bergen<|"|>}<tool_call|>'
    http, _ = app_client(vocab, f"Let me look.{CALL}{second}")
    for parallel, cities in ((True, ["Oslo, Norway", "Bergen"]), (False, ["Oslo, Norway"])):  # (False: the default)
        asked = {"parallel_tool_calls": True} if parallel else {}
        message = openai_client(http).chat.completions.create(model="m", messages=ASK, tools=TOOLS, **asked)
        message = message.choices[0].message
        assert message.content == "Let me look."
        assert [json.loads(c.function.arguments)["city"] for c in message.tool_calls] == cities
    http, _ = app_client(vocab, '<|tool_call>call:get_time{}<tool_call|> and <|tool_call>call:get_weather{city}')
    message = openai_client(http).chat.completions.create(model="m", messages=ASK, tools=TOOLS).choices[0].message
    assert not message.tool_calls  # (a tool not offered, a call that does not parse: the text as written)
    assert message.content == '<|tool_call>call:get_time{}<tool_call|> and <|tool_call>call:get_weather{city}'


def test_a_call_and_its_result_go_back_in_the_templates_own_syntax(vocab):
    http, scheduler = app_client(vocab, ANSWER)
    client = openai_client(http)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Oslo", "days": 3}'}}
    client.chat.completions.create(model="m", tools=TOOLS, messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    prompt = vocab.tokenizer.decode(scheduler.jobs[-1].prompt, skip_special_tokens=False)
    assert '<|tool>declaration:get_weather{description:<|"|>The forecast.<|"|>' in prompt
    assert ('<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:3}<tool_call|>'
            '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>') in prompt
    with anthropic_client(http).messages.stream(model="m", max_tokens=200, messages=ASK, tools=[
            {"name": "get_weather", "input_schema": WEATHER}]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == ANSWER


def test_a_required_call_holds_to_gemmas_syntax_and_the_tools_parameters(vocab):
    """The grammar the server builds for tool_choice required (and after the opener, when the model may call):
    Gemma's markers as their tokens, the function's name, its parameters' names, Gemma's values."""
    http, scheduler = app_client(vocab, CALL)
    client = openai_client(http)
    client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required")
    required = scheduler.jobs[-1].constraint

    def takes(constraint, text: str) -> bool:  # (its matcher alone, from the start)
        matcher = constraint.matcher
        matcher.reset()
        ids = vocab.encode(text, special=False)
        return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()

    assert required.opens == vocab.tokenizer.token_to_id("<|channel>")  # (a thought may come first: then the call)
    assert takes(required, CALL)
    second = '<|tool_call>call:get_weather{city:<|"|>x<|"|>}<tool_call|>'
    assert not takes(required, CALL + second)  # (one call unless the request asks for more)
    client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=True)
    assert takes(scheduler.jobs[-1].constraint, CALL + second)
    assert not takes(required, CALL.replace("city", "town"))  # (not a parameter)
    assert not takes(required, CALL.replace("get_weather", "get_time"))  # (not a tool)
    assert not takes(required, 'call:get_weather{city:Oslo}<tool_call|>')
    assert tools.gemma_value(CALL[len(tools.GEMMA_CALL + "get_weather"):-len(tools.GEMMA_CLOSE)]) == {
        "city": "Oslo, Norway", "days": 3}  # (what the grammar takes, the reader reads)
    client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    lazy = scheduler.jobs[-1].constraint
    assert lazy.trigger == "<|tool_call>" and takes(lazy, CALL[len("<|tool_call>"):])


def test_chat_shows_gemmas_answer_and_its_thought_after_it():
    import io

    from rich.console import Console

    from dense_engine.cli import terminal

    plain = io.StringIO()
    view = terminal.ReplyView(Console(file=plain, force_terminal=False, width=300), markdown=False, thinking=False,
                              pair=reasoning.CHANNEL)
    for i in range(0, len(REPLY), 3):  # a few characters a token
        view.write(REPLY[i:i + 3])
    view.finish("stats")
    assert plain.getvalue() == f"{ANSWER}\nthought: {' '.join(THOUGHT.split())}\nstats\n"
    assert reasoning.split(REPLY, False, reasoning.CHANNEL) == (THOUGHT, ANSWER)
    assert reasoning.split("<|channel>thought\n<channel|>" + ANSWER, False, reasoning.CHANNEL) == ("", ANSWER)
