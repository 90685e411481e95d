"""The replies' translators without HTTP: scripted scheduler events (text pieces with logprob entries, tool-call
text, an echoed prompt, two prompts' events interleaved, an error) -> responses.ClientEvents -> each format's Reply,
streamed and whole; the bytes equal those the server sent for the same events before its split into rooms
(tests/fixtures/server_replies.json, recorded from the old serve.py over HTTP; a streamed reply with tools was
recorded again when calls came to be streamed as they are written), and the HTTP app sends them too."""

import json
import os
import queue
import threading
import time
import types

import pytest
import torch
from conftest import FIXTURES, fixture_path

from dense_engine.formats.vocab import load_vocabulary

GOLDEN = os.path.join(FIXTURES, "server_replies.json")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CREATED = 1700000000


def lp(t, k=2):
    """A logprob entry: (token, its logprob, the alternatives)."""
    return (t, -0.25 * (t % 7) - 0.1, [(t, -0.1), (t + 1, -1.5)][:k])


CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
# case -> (route, body, script: choice index -> its events (kind, text, logprob entries))
CASES = {
    "chat": (CHAT, {"messages": HI, "max_tokens": 5},
             {0: [("text", "Hello", []), ("text", " world", []), ("done", "stop", [])]}),
    "chat_length": (CHAT, {"messages": HI, "max_tokens": 2},
                    {0: [("text", "Hel", []), ("text", "lo", []), ("done", "length", [])]}),
    "chat_logprobs": (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 2},
                      {0: [("text", "ab", [lp(65), lp(66)]), ("text", "c", [lp(67)]), ("done", "stop", [lp(68)])]}),
    "chat_tool_call": (CHAT, {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER]},
                       {0: [("text", CALL[:20], []), ("text", CALL[20:], []), ("done", "stop", [])]}),
    "chat_tool_text": (CHAT, {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER],
                              "logprobs": True},
                       {0: [("text", "It is", [lp(70)]), ("text", " sunny", [lp(71)]), ("done", "stop", [])]}),
    "chat_error": (CHAT, {"messages": HI},
                   {0: [("text", "Hi", []), ("error", "internal error: RuntimeError: a device fell over", [])]}),
    "completion": (COMPLETION, {"prompt": "the cat", "max_tokens": 3},
                   {0: [("text", " sat", []), ("text", " on", []), ("done", "length", [])]}),
    "completion_echo": (COMPLETION, {"prompt": "the cat sat", "max_tokens": 2, "echo": True, "logprobs": 1},
                        {0: [("text", "", [lp(80, 1)]), ("text", " mat", [lp(81, 1)]), ("done", "length", [])]}),
    "completion_echo_only": (COMPLETION, {"prompt": "the cat sat", "max_tokens": 0, "echo": True, "logprobs": 0},
                             {0: [("done", "length", [])]}),
    "completion_two": (COMPLETION, {"prompt": ["one", "two"], "max_tokens": 3, "logprobs": 1},
                       {0: [("text", " a", [lp(90, 1)]), ("done", "stop", [])],
                        1: [("text", " b", [lp(91, 1)]), ("text", " c", [lp(92, 1)]), ("done", "length", [])]}),
}
VARIANTS = [(name, stream, usage) for name in CASES for stream in (False, True)
            for usage in ((False, True) if stream else (False,))]


def key(name: str, stream: bool, usage: bool) -> str:
    return f"{name}{'_stream' if stream else ''}{'_usage' if usage else ''}"


def play(jobs, script) -> None:
    """Each job's scripted events, the jobs' interleaved, as the scheduler would send them (a job's fields set as
    the scheduler sets them: its generated tokens, an echoed prompt's logprob entries, the finish reason)."""
    scripts = {job.index: list(script[job.index]) for job in jobs}
    for job in jobs:
        job.generated = [5] * sum(1 for kind, _, _ in scripts[job.index] if kind == "text")
        if job.echo:
            job.prompt_entries = [None] + [lp(t, job.logprobs or 0) for t in job.prompt[1:]]
    while any(scripts.values()):
        for job in jobs:
            if scripts[job.index]:
                kind, text, entries = scripts[job.index].pop(0)
                job.finish_reason = text if kind == "done" else "error" if kind == "error" else None
                job.send(kind, text, entries)


def fake_ids(monkeypatch, modules, first: int = 0) -> None:
    """uuid4().hex as 0, 1, 2, ... in 32 hex digits (the request's id, then its tool calls')."""
    counter = iter(range(first, 10**6))
    fake = types.SimpleNamespace(uuid4=lambda: types.SimpleNamespace(hex=f"{next(counter):032x}"))
    for module in modules:
        monkeypatch.setattr(module, "uuid", fake)


@pytest.fixture(scope="module")
def golden() -> dict:
    with open(GOLDEN) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def vocab():
    return load_vocabulary(fixture_path("llama"), None)


def server_state(vocab):
    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=512), device=torch.device("cpu"))
    return types.SimpleNamespace(adapters=[], vocab=vocab, scheduler=types.SimpleNamespace(model=model),
                                 max_seq_len=4096, name="llama")


@pytest.mark.parametrize("name, stream, usage", VARIANTS)
def test_the_translators_give_the_bytes_the_server_sent_before(name, stream, usage, golden, vocab, monkeypatch):
    from dense_engine.server import app, protocol, responses

    route, body, script = CASES[name]
    kind = "chat" if route == CHAT else "completion"
    sent = dict(body, stream=stream, **({"stream_options": {"include_usage": True}} if usage else {}))
    settings = protocol.parse_request(sent, kind, vocab, 4096)
    events = []
    jobs = app.make_jobs(settings, server_state(vocab), events.append)
    play(jobs, script)
    fake_ids(monkeypatch, [responses], first=1)  # (0: the request's id)
    head = {"id": ("chatcmpl-" if kind == "chat" else "cmpl-") + "0" * 24, "created": CREATED, "model": "llama",
            "system_fingerprint": None}
    reader, reply = responses.ClientEvents(jobs, vocab, settings.calling), responses.FORMATS[kind](head, jobs, vocab)
    want = golden[key(name, stream, usage)]
    if stream:
        chunks = list(reply.start())
        for event in events:
            if not reader.open:
                break
            for piece in reader.feed(event):
                chunks += reply.chunks(piece)
        chunks += [reply.usage_chunk()] if usage else []
        assert want["status"] == 200
        assert "".join(responses.sse(c) for c in chunks) + "data: [DONE]\n\n" == want["body"]
        return
    try:
        for event in events:
            for piece in reader.feed(event):
                reply.fold(piece)
        status, text = 200, json.dumps(reply.body(), ensure_ascii=False, separators=(",", ":"))
    except protocol.BadRequest as e:
        status, text = e.status, json.dumps(e.body(), ensure_ascii=False, separators=(",", ":"))
    assert (status, text) == (want["status"], want["body"])


class ScriptedScheduler:
    """The scheduler the HTTP app sees: it plays the case's script once every job of the request is in."""

    def __init__(self, script) -> None:
        self.script, self.draft, self.jobs, self.waiting = script, None, [], queue.Queue()
        self.model = server_state(None).scheduler.model

    def submit(self, job) -> None:
        import asyncio

        self.jobs.append(job)
        if len(self.jobs) == 1:
            asyncio.get_running_loop().call_soon(lambda: play(self.jobs, self.script))


@pytest.mark.parametrize("name, stream, usage", VARIANTS)
def test_the_http_app_sends_the_same_bytes(name, stream, usage, golden, vocab, monkeypatch):
    pytest.importorskip("starlette.testclient")
    from starlette.testclient import TestClient

    from dense_engine.server import app, responses
    from dense_engine.server.metrics import Metrics

    route, body, script = CASES[name]
    server = server_state(vocab)
    server.scheduler, server.error, server.ready, server.metrics = ScriptedScheduler(script), None, threading.Event(), \
        Metrics()
    server.args = types.SimpleNamespace(api_key=None, max_queue=64, cors_origin=None)
    server.ready.set()
    fake_ids(monkeypatch, [app, responses])
    monkeypatch.setattr(app, "time", types.SimpleNamespace(time=lambda: CREATED, perf_counter=time.perf_counter))
    with TestClient(app.make_app(server)) as client:
        sent = dict(body, stream=stream, **({"stream_options": {"include_usage": True}} if usage else {}))
        response = client.post(route, json=sent)
    want = golden[key(name, stream, usage)]
    assert (response.status_code, response.text) == (want["status"], want["body"])
