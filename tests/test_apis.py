"""The other APIs clients point at a local model, each through its official client: OpenAI's Responses API
(`openai`, and an `openai-agents` agent), Anthropic's Messages API (`anthropic`), Ollama's API (`ollama`), and
llama-server's /infill. First against the HTTP app with a scripted scheduler (its replies are the pieces a model
would write: text, tool-call text), streamed and whole, with bad input in each API's own error shape; then against
a real server process, where every API's greedy text equals the chat endpoint's for the same conversation."""

import json
import queue
import threading
import time
import types
from typing import Literal

import pytest
import torch
from conftest import answer, fixture_path

from dense_engine.formats.vocab import load_vocabulary

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")
pytest.importorskip("starlette.testclient")

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


class ScriptedScheduler:
    """What the HTTP app sees of a scheduler: each submitted request gets the tokens of a scripted text, one every
    `delay` seconds, through the scheduler's own finish() (its stop strings, max_tokens, the text it sends), then
    `reason` if nothing ended it before."""

    def __init__(self, vocab, text: str, delay: float = 0.0, reason: str = "stop") -> None:
        self.vocab, self.text, self.delay, self.reason = vocab, text, delay, reason
        self.draft, self.waiting, self.jobs = None, queue.Queue(), []
        config = types.SimpleNamespace(vocab_size=512, max_position_embeddings=4096, hidden_size=64,
                                       num_hidden_layers=2)
        self.model = types.SimpleNamespace(config=config, device=torch.device("cpu"), parameters=list,
                                           buffers=list)

    def submit(self, job) -> None:
        from dense_engine.server.scheduler import finish

        self.jobs.append(job)

        def play() -> None:
            for token in self.vocab.encode(self.text, special=False):
                time.sleep(self.delay)
                reason = finish(self.vocab, job, token)
                if reason:
                    return job.end(reason)
            finish(self.vocab, job, min(self.vocab.stop_ids)) if self.reason == "stop" else None
            job.end(self.reason)

        threading.Thread(target=play, daemon=True).start()


@pytest.fixture(scope="module")
def vocab():
    return load_vocabulary(fixture_path("llama"), None)


def app_client(vocab, text, delay=0.0, reason="stop", api_key=None):
    """(a TestClient of the HTTP app over a scripted scheduler, that scheduler)."""
    from starlette.testclient import TestClient

    from dense_engine.server import app
    from dense_engine.server.metrics import Metrics

    server = types.SimpleNamespace(adapters=[], vocab=vocab, max_seq_len=4096, name="llama", error=None,
                                   ready=threading.Event(),
                                   metrics=Metrics(), scheduler=ScriptedScheduler(vocab, text, delay, reason),
                                   args=types.SimpleNamespace(api_key=api_key, max_queue=64, cors_origin=None,
                                                              quant="none", ckpt="llama"))
    server.ready.set()
    return TestClient(app.make_app(server)), server.scheduler


def openai_client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def anthropic_client(http, key="unused"):
    return anthropic.Anthropic(base_url="http://testserver", api_key=key, http_client=http, max_retries=0)


def ollama_client(http):
    client = ollama.Client(host="http://testserver")
    client._client = http  # (the app in this process, not a socket)
    return client


# ---- the Responses API


def test_responses_text_plain_and_streamed(vocab):
    http, scheduler = app_client(vocab, "Hello world")
    client = openai_client(http)
    whole = client.responses.create(model="m", input="hi", instructions="Be brief.", max_output_tokens=20)
    assert whole.output_text == "Hello world" and whole.status == "completed" and whole.object == "response"
    assert whole.usage.output_tokens == len(scheduler.jobs[0].generated) > 2
    assert whole.usage.input_tokens == len(scheduler.jobs[0].prompt)
    prompt = vocab.decode(scheduler.jobs[0].prompt)
    assert "Be brief." in prompt and prompt.index("Be brief.") < prompt.index("hi")
    events = list(client.responses.create(model="m", input="hi", stream=True))
    kinds = [e.type for e in events]
    once = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # (a delta a token)
    assert once == ["response.created", "response.in_progress", "response.output_item.added",
                    "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                    "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello world"
    assert events[-1].response.output_text == "Hello world"
    assert whole.model_dump()["output"][0]["content"] == events[-1].response.model_dump()["output"][0]["content"]
    cut = openai_client(app_client(vocab, "Hel", reason="length")[0]).responses.create(model="m", input="hi")
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_a_reply_cut_after_its_calls_began_finishes_with_length_on_every_api(vocab):
    """max_tokens cut the reply inside its second call's name (the small default model, its calls allowed in
    parallel, writes call after call): a cut reply, not calls to make."""
    text = CALL + '\n<tool_call>\n{"na'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    chat = openai_client(app_client(vocab, text, reason="length")[0]).chat.completions
    assert chat.create(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools).choices[0] \
        .finish_reason == "length"
    streamed = [c.choices[0].finish_reason for c in chat.create(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, stream=True)
        if c.choices and c.choices[0].finish_reason]
    assert streamed == ["length"]
    message = anthropic_client(app_client(vocab, text, reason="length")[0]).messages.create(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
        tools=[{"name": "get_weather", "input_schema": WEATHER}])
    assert message.stop_reason == "max_tokens"
    whole = openai_client(app_client(vocab, CALL)[0]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools)
    assert whole.choices[0].finish_reason == "tool_calls"  # (a reply that ended after its call)


def test_responses_function_call_then_previous_response_id(vocab):
    http, scheduler = app_client(vocab, CALL)
    client = openai_client(http)
    tools = [{"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER}]
    first = client.responses.create(model="m", input="Weather in Oslo?", tools=tools, tool_choice="auto")
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {
        "city": "Oslo"} and call.status == "completed"
    second = client.responses.create(model="m", previous_response_id=first.id, tools=tools, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    prompt = vocab.decode(scheduler.jobs[-1].prompt)
    assert prompt.index("Weather in Oslo?") < prompt.index('"city": "Oslo"') < prompt.index("sunny, 21 C")
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).id == first.id
    streamed = list(client.responses.create(model="m", input="Weather?", tools=tools, stream=True))
    kinds = [e.type for e in streamed]
    once = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # (the arguments in many deltas)
    assert once[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert kinds.count("response.function_call_arguments.delta") > 3
    assert streamed[-3].arguments == '{"city": "Oslo"}' and streamed[2].item.name == "get_weather"
    unkept = client.responses.create(model="m", input="hi", store=False)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="more", previous_response_id=unkept.id)
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"input": 5}, "input")])
def test_responses_bad_input_is_a_400_naming_the_field(vocab, body, param):
    http, _ = app_client(vocab, "x")
    response = http.post("/v1/responses", json={"model": "m", **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_an_openai_agents_agent_runs_a_turn_with_a_function_tool(vocab):
    agents = pytest.importorskip("agents")
    http, scheduler = app_client(vocab, CALL)
    asked = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return "sunny"

    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(model="m", openai_client=openai.AsyncOpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=AsyncBridge(http), max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(max_tokens=200), tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "Weather in Oslo?")
    assert asked == ["Oslo"] and result.final_output == "sunny"
    assert "get_weather" in vocab.decode(scheduler.jobs[0].prompt)  # (the tool offered in the prompt)


class AsyncBridge:
    """httpx.AsyncClient's surface over a sync TestClient (the Agents SDK calls the async client)."""

    def __new__(cls, http):
        import httpx

        class Transport(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request):
                import asyncio

                body = await request.aread()
                response = await asyncio.to_thread(http.request, request.method, str(request.url),
                                                   headers=dict(request.headers), content=body)
                return httpx.Response(response.status_code, headers=response.headers, content=response.content)

        return httpx.AsyncClient(transport=Transport(), base_url="http://testserver")


# ---- Anthropic's Messages API


def test_messages_text_plain_and_streamed(vocab):
    http, scheduler = app_client(vocab, "Hello world")
    client = anthropic_client(http)
    system = [{"type": "text", "text": "You are terse."}]
    whole = client.messages.create(model="m", max_tokens=20, system=system,
                                   messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert whole.content[0].text == "Hello world" and whole.stop_reason == "end_turn" and whole.type == "message"
    assert whole.usage.output_tokens == len(scheduler.jobs[0].generated) > 2
    assert whole.usage.input_tokens == len(scheduler.jobs[0].prompt)
    assert "You are terse." in vocab.decode(scheduler.jobs[0].prompt)
    with client.messages.stream(model="m", max_tokens=20, messages=[{"role": "user", "content": "hi"}]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == "Hello world" and final.stop_reason == "end_turn"
    counted = client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hi"}], system=system)
    assert counted.input_tokens == len(scheduler.jobs[0].prompt)
    cut = anthropic_client(app_client(vocab, "Hel", reason="length")[0]).messages.create(
        model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert cut.stop_reason == "max_tokens"


def test_messages_stop_sequence_is_reported(vocab):
    http, _ = app_client(vocab, "one, two, END three")
    reply = anthropic_client(http).messages.create(model="m", max_tokens=20, stop_sequences=["END"],
                                                   messages=[{"role": "user", "content": "count"}])
    assert reply.content[0].text == "one, two, " and reply.stop_reason == "stop_sequence"
    assert reply.stop_sequence == "END"


def test_messages_tool_use_round_trip(vocab):
    http, scheduler = app_client(vocab, CALL)
    client = anthropic_client(http)
    tools = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER}]
    first = client.messages.create(model="m", max_tokens=60, tools=tools,
                                   messages=[{"role": "user", "content": "Weather in Oslo?"}])
    use = first.content[0]
    assert first.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    assert use.input == {"city": "Oslo"} and use.id.startswith("toolu_")
    cut = client.messages.create(model="m", max_tokens=48, tools=tools,  # (inside the call's arguments; at 60
                                 # the call is whole and only its closing tag is cut: tool_use, above)
                                 messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert cut.stop_reason == "max_tokens"
    client.messages.create(model="m", max_tokens=60, tools=tools, messages=[
        {"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}])
    prompt = vocab.decode(scheduler.jobs[-1].prompt)
    assert prompt.index('"city": "Oslo"') < prompt.index("sunny, 21 C")
    with client.messages.stream(model="m", max_tokens=60, tools=tools,
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        deltas = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "".join(deltas) == '{"city": "Oslo"}' and final.content[0].input == {"city": "Oslo"}


@pytest.mark.parametrize("body, status, kind", [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),  # no max_tokens
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "sometimes"}}, 400,
     "invalid_request_error")])
def test_messages_bad_input_is_anthropics_error_body(vocab, body, status, kind):
    http, _ = app_client(vocab, "x")
    response = http.post("/v1/messages", json={"model": "m", **body})
    assert response.status_code == status and response.json()["type"] == "error"
    assert response.json()["error"]["type"] == kind and response.json()["error"]["message"]


def test_the_api_key_as_anthropic_sends_it(vocab):
    http, _ = app_client(vocab, "ok", api_key="sekret")
    assert anthropic_client(http, "sekret").messages.create(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]).content[0].text == "ok"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic_client(http, "wrong").messages.create(model="m", max_tokens=5,
                                                        messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"


# ---- Ollama's API


def test_ollama_chat_generate_and_the_model_lists(vocab):
    http, scheduler = app_client(vocab, "Hello world")
    client = ollama_client(http)
    whole = client.chat(model="m", messages=[{"role": "user", "content": "hi"}], stream=False,
                        options={"temperature": 0, "num_predict": 20, "repeat_penalty": 1.1, "min_p": 0.05})
    assert whole.message.content == "Hello world" and whole.done and whole.done_reason == "stop"
    assert whole.eval_count == len(scheduler.jobs[0].generated) > 2
    assert whole.prompt_eval_count == len(scheduler.jobs[0].prompt)
    job = scheduler.jobs[0]
    assert (job.max_tokens, job.sampler.temperature, job.sampler.repetition_penalty, job.sampler.min_p) == \
        (20, 0, 1.1, 0.05)
    lines = list(client.chat(model="m", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert "".join(line.message.content for line in lines) == "Hello world" and len(lines) > 3
    assert lines[-1].done and not any(line.done for line in lines[:-1]) and lines[-1].message.content == ""
    assert client.generate(model="m", prompt="hi", stream=False).response == "Hello world"
    assert "hi" in vocab.decode(scheduler.jobs[-1].prompt) and "<|im_start|>" in vocab.decode(
        scheduler.jobs[-1].prompt) or scheduler.jobs[-1].prompt != vocab.encode("hi", special=True)
    raw = client.generate(model="m", prompt="the cat", raw=True, stream=False)
    assert raw.response == "Hello world" and scheduler.jobs[-1].prompt == vocab.encode("the cat", special=True)
    assert client.generate(model="m", prompt="").done_reason == "load"  # (a client loading the model)
    assert [m.model for m in client.list().models] == ["llama"] and client.ps().models[0].model == "llama"
    shown = client.show("m")
    assert shown.template == vocab.chat_template and "completion" in shown.capabilities
    assert http.get("/api/version").json()["version"]


def test_ollama_tool_call_and_format(vocab):
    http, scheduler = app_client(vocab, CALL)
    client = ollama_client(http)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    whole = client.chat(model="m", messages=[{"role": "user", "content": "Weather?"}], tools=tools, stream=False)
    assert whole.message.tool_calls[0].function.name == "get_weather"
    assert whole.message.tool_calls[0].function.arguments == {"city": "Oslo"} and whole.message.content == ""
    lines = list(client.chat(model="m", messages=[{"role": "user", "content": "Weather?"}], tools=tools, stream=True))
    assert [bool(line.message.tool_calls) for line in lines] == [True, False]  # (the call whole, then done)
    client.chat(model="m", stream=False, tools=tools, messages=[
        {"role": "user", "content": "Weather?"}, whole.message, {"role": "tool", "content": "sunny, 21 C",
                                                                 "tool_name": "get_weather"}])
    prompt = vocab.decode(scheduler.jobs[-1].prompt)
    assert prompt.index('"city": "Oslo"') < prompt.index("sunny, 21 C")
    http, scheduler = app_client(vocab, '{"a": 1}')
    ollama_client(http).chat(model="m", messages=[{"role": "user", "content": "json"}], format="json", stream=False)
    assert scheduler.jobs[0].constraint is not None


def test_ollama_errors_are_its_error_bodies(vocab):
    http, _ = app_client(vocab, "x")
    for path, body in (("/api/chat", {"model": "m", "messages": "hi"}),
                       ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi", "images": ["x"]}]}),
                       ("/api/generate", {"model": "m", "prompt": "hi", "options": {"temperature": -1}}),
                       ("/api/generate", {"model": "m", "prompt": "hi", "format": 5}),
                       ("/api/generate", {"model": "m", "prompt": "def f(", "suffix": "):"})):  # (no FIM tokens)
        response = http.post(path, json=body)
        assert response.status_code == 400 and set(response.json()) == {"error"}, (path, body, response.text)
    assert "options.temperature" in http.post("/api/generate", json={
        "model": "m", "prompt": "hi", "options": {"temperature": -1}}).json()["error"]


# ---- streamed tool calls arrive as they are written


def test_a_streamed_tool_call_arrives_before_the_reply_ends(vocab):
    """A slow model (a token every 20 ms): the call's name and its first argument piece reach the client well
    before the reply's last token is even written, on the chat completions, Responses and Messages streams."""
    text = CALL + "\n" * 200  # (after the call: tokens that end nothing, as a model may write before its end)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    end = len(vocab.encode(text, special=False)) * 0.01

    def timed(events):
        start, seen = time.perf_counter(), []
        for event in events:
            seen.append((time.perf_counter() - start, event))
        return seen

    http, _ = app_client(vocab, text, delay=0.01)
    chat = timed(openai_client(http).chat.completions.create(model="m", messages=[{"role": "user", "content": "w"}],
                                                             tools=tools, stream=True))
    first = next(t for t, c in chat if c.choices and c.choices[0].delta.tool_calls
                 and c.choices[0].delta.tool_calls[0].function.arguments)
    assert first < end / 2 and chat[-1][0] >= end * 0.9
    names = [c.choices[0].delta.tool_calls[0].function.name for _, c in chat
             if c.choices and c.choices[0].delta.tool_calls]
    arguments = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for _, c in chat
                        if c.choices and c.choices[0].delta.tool_calls)
    assert names[0] == "get_weather" and json.loads(arguments) == {"city": "Oslo"}
    assert all(not (c.choices and c.choices[0].delta.content) for _, c in chat)  # (no call text in the content)
    http, _ = app_client(vocab, text, delay=0.01)
    flat = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    responses = timed(openai_client(http).responses.create(model="m", input="w", tools=flat, stream=True))
    assert next(t for t, e in responses if e.type == "response.function_call_arguments.delta") < end / 2
    http, _ = app_client(vocab, text, delay=0.01)
    with anthropic_client(http).messages.stream(model="m", max_tokens=60, messages=[{"role": "user", "content": "w"}],
                                                tools=[{"name": "get_weather", "input_schema": WEATHER}]) as stream:
        messages = timed(stream)
    assert next(t for t, e in messages if e.type == "content_block_delta") < end / 2


# ---- infill


def fim_checkpoint(tmp_path) -> str:
    """The llama fixture with three of its tokens made Qwen2.5-Coder's FIM tokens."""
    import shutil

    folder = tmp_path / "fim"
    shutil.copytree(fixture_path("llama"), folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    for i, name in zip((256, 257, 258), ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")):  # (bytes no merge
        # uses and no test text has)
        del vocab[by_id[i]]
        vocab[name] = i
        tok["added_tokens"].append({"id": i, "content": name, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return str(folder)


def test_the_fim_prompt_is_the_hand_built_one(tmp_path):
    from dense_engine.server import infill

    vocab = load_vocabulary(fim_checkpoint(tmp_path), None)
    assert infill.fim_tokens(vocab) == (256, 257, 258)
    got = infill.fim_prompt(vocab, "def add(a, b):\n    return ", "\n\nprint(add(1, 2))")
    want = vocab.encode("", special=True) + [256] + vocab.encode("def add(a, b):\n    return ", special=False) + \
        [257] + vocab.encode("\n\nprint(add(1, 2))", special=False) + [258]
    assert got == want


# ---- a real server: every API's greedy text is the chat endpoint's


@pytest.fixture(scope="module")
def server():
    from test_serve import Server

    s = Server("--max-batch", "2")
    yield s
    s.stop()


def chat_text(server, messages, **settings):
    reply = server.client().chat.completions.create(model="m", messages=messages, **{"temperature": 0,
                                                                                     "max_tokens": 16, **settings})
    return reply.choices[0].message.content


@pytest.mark.slow
def test_every_api_gives_the_chat_endpoints_greedy_text(server):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi there"}]
    want = chat_text(server, messages)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert client.responses.create(model="m", instructions="Be terse.", input="hi there", temperature=0,
                                   max_output_tokens=16).output_text == want
    streamed = client.responses.create(model="m", instructions="Be terse.", input="hi there", temperature=0,
                                       max_output_tokens=16, stream=True)
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == want
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    greedy = {"temperature": 0}  # (the SDK no longer takes sampling settings as arguments; the API still does)
    reply = claude.messages.create(model="m", system="Be terse.", max_tokens=16, extra_body=greedy,
                                   messages=[{"role": "user", "content": "hi there"}])
    assert reply.content[0].text == want
    with claude.messages.stream(model="m", system="Be terse.", max_tokens=16, extra_body=greedy,
                                messages=[{"role": "user", "content": "hi there"}]) as stream:
        assert "".join(stream.text_stream) == want
    local = ollama.Client(host=server.url)
    options = {"temperature": 0, "num_predict": 16}
    assert local.chat(model="m", messages=messages, options=options, stream=False).message.content == want
    assert "".join(line.message.content for line in local.chat(model="m", messages=messages, options=options,
                                                               stream=True)) == want
    assert local.generate(model="m", system="Be terse.", prompt="hi there", options=options).response == want
    raw = local.generate(model="m", prompt="the cat sat", raw=True, options=options).response
    assert raw == server.client().completions.create(model="m", prompt="the cat sat", max_tokens=16,
                                                     temperature=0).choices[0].text
    penalized = local.chat(model="m", messages=messages, stream=False,
                           options={**options, "repeat_penalty": 0.7, "repeat_last_n": -1}).message.content
    assert penalized == chat_text(server, messages, extra_body={"repetition_penalty": 0.7, "repeat_last_n": -1})
    assert penalized != want  # (a penalty below 1 repeats what the random model said: another text)
    import os
    import subprocess
    import sys

    from conftest import ROOT

    cli = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", fixture_path("llama"), "--prompt",
                          "hi there", "--system", "Be terse.", "--temperature", "0", "--max-new-tokens", "16",
                          "--repeat-penalty", "0.7", "--repeat-last-n", "-1"], capture_output=True, text=True,
                         check=False)
    assert cli.returncode == 0 and cli.stdout == answer(penalized), cli.stderr
    dry = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1}
    served = chat_text(server, messages, max_tokens=24, extra_body=dry)
    cli = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", fixture_path("llama"), "--prompt",
                          "hi there", "--system", "Be terse.", "--temperature", "0", "--max-new-tokens", "24",
                          "--dry-multiplier", "0.8", "--no-compile"], capture_output=True, text=True, check=False)
    assert cli.returncode == 0 and cli.stdout == answer(served), cli.stderr


@pytest.mark.slow
def test_grammars_hold_on_every_reply(server):
    import re

    client = server.client()

    def complete(**extra):
        return client.completions.create(model="m", prompt="answer:", max_tokens=40, temperature=0.9, seed=3,
                                          extra_body=extra).choices[0]

    regex = complete(guided_regex="[0-9]{3}-[a-z]{2}")
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.text) and regex.finish_reason == "stop"
    assert complete(guided_choice=["yes", "no", "maybe"]).text in ("yes", "no", "maybe")
    assert complete(structured_outputs={"choice": ["left", "right"]}).text in ("left", "right")
    assert re.fullmatch("(ab|cd)+!", complete(grammar='root ::= ("ab" | "cd")+ "!"').text)  # GBNF
    assert re.fullmatch("x[0-9]+", complete(guided_grammar='start: "x" NUM\nNUM: /[0-9]+/').text)  # Lark
    value = json.loads(complete(guided_json={"type": "object", "properties": {"n": {"type": "integer"}},
                                             "required": ["n"]}).text)
    assert isinstance(value["n"], int)
    for bad in ({"guided_regex": "[0-9"}, {"grammar": "root ::= ("}, {"guided_choice": []},
                {"guided_regex": "a", "grammar": 'root ::= "a"'}):
        with pytest.raises(openai.BadRequestError) as e:
            complete(**bad)
        assert e.value.body["param"] in bad, bad


@pytest.mark.slow
def test_infill_prompts_equal_the_hand_built_prompts_tokens(tmp_path):
    from test_serve import Server

    from dense_engine.server import infill

    folder = fim_checkpoint(tmp_path)
    vocab = load_vocabulary(folder, None)
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))"
    ids = infill.fim_prompt(vocab, prefix, suffix)
    s = Server("--max-batch", "1", "--no-compile", ckpt=folder)
    try:
        want = s.client().completions.create(model="m", prompt=ids, max_tokens=12, temperature=0).choices[0].text
        status, body = s.request("POST", "/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 12,
                                                     "temperature": 0})
        assert status == 200 and body["content"] == want and body["tokens_evaluated"] == len(ids)
        same = s.client().completions.create(model="m", prompt=prefix, suffix=suffix, max_tokens=12, temperature=0)
        assert same.choices[0].text == want
        local = ollama.Client(host=s.url)
        assert local.generate(model="m", prompt=prefix, suffix=suffix, options={"temperature": 0,
                                                                                 "num_predict": 12}).response == want
    finally:
        s.stop()


@pytest.mark.slow
def test_an_agent_turn_against_the_real_model_equals_the_chat_endpoints(tmp_path):
    """An openai-agents agent whose first step must call the tool (a grammar makes the random model's reply a valid
    call), then answers: the tool got a string city, and the answer is the chat endpoint's greedy reply to the same
    conversation (the instructions, the question, the call and its result)."""
    agents = pytest.importorskip("agents")
    asked = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return "sunny, 21 C"

    from test_serve import Server, checkpoint_with_template

    server = Server("--no-compile", "--max-batch", "1", ckpt=checkpoint_with_template(tmp_path, "qwen2.5"))
    try:
        agent_turn(server, agents, get_weather, asked)
    finally:
        server.stop()


def agent_turn(server, agents, get_weather, asked) -> None:
    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(model="m", openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0))
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=300, parallel_tool_calls=False)
    # (the answer as a choice of two words: a reply of random weights that ends by itself, not at max_tokens)
    agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], model=model,
                         model_settings=settings, output_type=Literal["sunny", "rainy"])
    result = agents.Runner.run_sync(agent, "Weather in Oslo?", max_turns=3)
    assert len(asked) == 1 and isinstance(asked[0], str)
    call = next(item.raw_item for item in result.new_items if item.type == "tool_call_item")
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                             "parameters": get_weather.params_json_schema}}
    messages = [{"role": "system", "content": "Answer with the tool."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                          "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    schema = {"type": "object", "properties": {"response": {"enum": ["sunny", "rainy"], "type": "string"}},
              "required": ["response"], "additionalProperties": False}
    shape = {"type": "json_schema", "json_schema": {"name": "final_output", "schema": schema}}
    reply = server.client().chat.completions.create(model="m", messages=messages, tools=[tool], temperature=0,
                                                    max_tokens=300, response_format=shape)
    assert result.final_output == json.loads(reply.choices[0].message.content)["response"]
