"""The replies of Mistral's 2025-26 templates through the server: Ministral 3's reasoning ([THINK] ... [/THINK]) told
apart, and the calls of Ministral 3, Devstral and Mistral Small 3.2 ([TOOL_CALLS]NAME[ARGS]{...}, Small 3.2 with a
[CALL_ID] between) told as calls, streamed, through the official clients; the grammar of a required call; the ids a
client sends back made the 9 letters and digits Small 3.2's template takes; the markers, which Mistral's
tokenizer.json calls special, kept in the text. The templates are the models' own (tests/fixtures/templates/); the
HTTP app runs over test_apis' scripted scheduler: its replies are the text these models write."""

import json
import os

import pytest
from conftest import fixture_path
from test_apis import anthropic_client, ollama_client, openai_client
from test_reasoning import app_client  # (test_apis' scripted app, its model's vocabulary the vocabulary's size)

from dense_engine.formats.vocab import load_vocabulary
from dense_engine.runtime import reasoning, tools

HERE = os.path.dirname(os.path.abspath(__file__))
MARKERS = ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CONTENT]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]",
           "[/THINK]"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast.",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
THOUGHT = "The user wants the weather.\nI should call the tool."
CALL = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 3}'


def folder_vocab(tmp_path_factory, template: str):
    """A folder as Mistral's are saved: its markers special tokens of tokenizer.json, </s> the end of text."""
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp(template.split(".")[0])
    tokenizer = Tokenizer.from_file(os.path.join(fixture_path("llama"), "tokenizer.json"))
    tokenizer.add_special_tokens(MARKERS + ["</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    with open(os.path.join(HERE, "fixtures", "templates", template)) as f:
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"chat_template": f.read(), "bos_token": "<s>", "eos_token": "</s>"}))
    return load_vocabulary(str(folder), None)


@pytest.fixture(scope="module")
def ministral(tmp_path_factory):
    return folder_vocab(tmp_path_factory, "ministral3.jinja")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return folder_vocab(tmp_path_factory, "mistral-small-3.2.jinja")


def test_the_formats_are_read_from_the_templates_and_the_markers_stay_in_the_text(ministral, small):
    assert tools.reply_format(ministral.chat_template) == tools.reply_format(small.chat_template) == "mistral_args"
    assert reasoning.markers(ministral.chat_template) == reasoning.BRACKETS
    assert reasoning.markers(small.chat_template) is None
    ids = ministral.encode("[INST]hi[/INST][THINK]a[/THINK]b" + CALL, special=False)
    assert ministral.decode(ids) == "hi[THINK]a[/THINK]b" + CALL  # ([INST]: special, skipped)


@pytest.mark.parametrize("stream", [False, True])
def test_the_reasoning_and_a_call_after_it(ministral, stream):
    http, scheduler = app_client(ministral, f"[THINK]{THOUGHT}[/THINK]{CALL}")
    reply = openai_client(http).chat.completions.create(model="m", messages=ASK, tools=TOOLS, stream=stream)
    if stream:
        deltas = [c.choices[0].delta for c in reply if c.choices]
        calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
        assert [c.function.name for c in calls if c.function.name] == ["get_weather"]
        assert len(calls) > 2  # (the arguments in pieces as they come)
        arguments = "".join(c.function.arguments or "" for c in calls)
        thought = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    else:
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
        arguments, thought = message.tool_calls[0].function.arguments, message.model_extra["reasoning_content"]
    assert json.loads(arguments) == {"city": "Oslo", "days": 3} and thought == THOUGHT
    prompt = ministral.tokenizer.decode(scheduler.jobs[-1].prompt, skip_special_tokens=False)
    assert prompt.startswith("<s>[SYSTEM_PROMPT]# HOW YOU SHOULD THINK")
    assert '[AVAILABLE_TOOLS][{"type": "function"' in prompt


def test_calls_after_text_two_at_once_a_call_id_and_what_is_not_a_call(ministral, small):
    second = '[TOOL_CALLS]get_weather[ARGS]{"city": "Bergen"}'
    http, _ = app_client(ministral, f"Let me look.{CALL}{second}")
    message = openai_client(http).chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                                          parallel_tool_calls=True).choices[0].message
    assert message.content == "Let me look."
    assert [json.loads(c.function.arguments)["city"] for c in message.tool_calls] == ["Oslo", "Bergen"]
    http, _ = app_client(small, '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}')
    said = ollama_client(http).chat(model="m", messages=ASK, tools=TOOLS)
    assert said.message.tool_calls[0].function.arguments == {"city": "Oslo"}
    http, _ = app_client(ministral, "[TOOL_CALLS]get_time[ARGS]{} and [TOOL_CALLS] nothing")
    message = openai_client(http).chat.completions.create(model="m", messages=ASK, tools=TOOLS).choices[0].message
    assert not message.tool_calls and message.content == "[TOOL_CALLS]get_time[ARGS]{} and [TOOL_CALLS] nothing"


def test_a_clients_call_ids_go_back_as_small_3_2s_template_takes_them(small):
    http, scheduler = app_client(small, "It is sunny.")
    client = openai_client(http)
    call = {"id": "call_0123456789abcdef01234567", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    answer = client.chat.completions.create(model="m", tools=TOOLS, messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}])
    assert answer.choices[0].message.content == "It is sunny."
    prompt = small.tokenizer.decode(scheduler.jobs[-1].prompt, skip_special_tokens=False)
    nine = tools.nine(call["id"])
    assert len(nine) == 9 and f'[TOOL_CALLS]get_weather[CALL_ID]{nine}[ARGS]{{"city": "Oslo"}}' in prompt
    assert f"[TOOL_RESULTS]{nine}[TOOL_CONTENT]sunny[/TOOL_RESULTS]" in prompt
    with anthropic_client(http).messages.stream(model="m", max_tokens=50, messages=ASK, tools=[
            {"name": "get_weather", "input_schema": WEATHER}]) as stream:
        assert stream.get_final_message().content[0].text == "It is sunny."


def test_a_required_call_holds_to_the_format_and_the_tools_schema(ministral):
    http, scheduler = app_client(ministral, CALL)
    client = openai_client(http)
    client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required")
    required = scheduler.jobs[-1].constraint
    assert required.opens == ministral.tokenizer.token_to_id("[THINK]")  # (a thought may come first)

    def takes(constraint, text: str) -> bool:  # (its matcher alone, from the start)
        matcher = constraint.matcher
        matcher.reset()
        return all(matcher.consume_token(i) for i in ministral.encode(text, special=False)) and matcher.is_accepting()

    second = '[TOOL_CALLS]get_weather[ARGS]{"city": "x"}'
    assert takes(required, CALL) and not takes(required, CALL + second)  # (one call unless asked for more)
    client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=True)
    assert takes(scheduler.jobs[-1].constraint, CALL + second)
    assert not takes(required, CALL.replace('"days": 3', '"days": "3"'))  # (the schema: an integer)
    assert not takes(required, CALL.replace('"city": "Oslo", ', ""))  # (city is required)
    assert not takes(required, CALL.replace("get_weather", "get_time"))
    client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    lazy = scheduler.jobs[-1].constraint
    assert lazy.trigger == "[TOOL_CALLS]" and takes(lazy, CALL[len("[TOOL_CALLS]"):])
