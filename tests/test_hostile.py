"""Hostile and careless bodies against the HTTP app (a scheduler that answers at once: no model): a few thousand
generated chat and completions bodies, valid and broken, each a 200 or a 4xx in OpenAI's error shape, never a 5xx,
and the app answers a plain request after them. (The probes against a real server: tests/test_serve.py.)"""

import json
import queue
import random
import threading
import types

import pytest
import torch
from conftest import fixture_path

from dense_engine.formats.vocab import load_vocabulary

HI = [{"role": "user", "content": "hi"}]


class AnsweringScheduler:
    """Answers every job at once: one piece of text, then the end."""

    def __init__(self) -> None:
        self.draft, self.waiting = None, queue.Queue()
        self.model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=512), device=torch.device("cpu"))

    def submit(self, job) -> None:
        job.generated = [5]
        job.send("text", "ok", [])
        job.end("stop")


@pytest.fixture(scope="module")
def client():
    from starlette.testclient import TestClient

    from dense_engine.server import app
    from dense_engine.server.metrics import Metrics

    server = types.SimpleNamespace(adapters=[], vocab=load_vocabulary(fixture_path("llama"), None), max_seq_len=256,
                                   name="llama", scheduler=AnsweringScheduler(), error=None, ready=threading.Event(),
                                   metrics=Metrics(),
                                   args=types.SimpleNamespace(api_key=None, max_queue=64, cors_origin=None,
                                                              max_body_mb=1))
    server.ready.set()
    with TestClient(app.make_app(server), raise_server_exceptions=False) as c:
        yield c


WEIRD = [None, True, False, 0, -1, 1, 2, 2**70, -2**70, 0.5, 1e308, -1e308, float("nan"), float("inf"),
         float("-inf"), "", "x", "\ud800", "a\udfffb", "\x00", "x" * 600, [], [1], ["a"], [[1]], {}, {"a": 1},
         {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "response_format", "logit_bias",
          "presence_penalty", "frequency_penalty", "tools", "tool_choice", "parallel_tool_calls", "n", "user",
          "unknown_field"]


def message(rng: random.Random):
    return rng.choice([{"role": rng.choice(["user", "system", "assistant", "tool", "robot", 5]),
                        "content": rng.choice(WEIRD + ["hello"] * 5)},
                       {"role": "user", "content": [{"type": rng.choice(["text", "image_url"]), "text": "t"}]},
                       rng.choice(WEIRD)])


def body(rng: random.Random, kind: str) -> dict:
    out = {"messages": [message(rng) for _ in range(rng.randint(0, 3))] or rng.choice([HI, []])} if kind == "chat" \
        else {"prompt": rng.choice(WEIRD + ["the cat", [1, 2, 3], ["a", "b"], [[1, 2], [3]]] * 2)}
    for name in rng.sample(FIELDS, rng.randint(0, 5)):
        out[name] = rng.choice(WEIRD + [HI, 8, 0.7, "stop", ["a", "b"], {"include_usage": True}])
    return out


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_generated_bodies_get_a_200_or_a_4xx_never_a_5xx(client, kind):
    rng, route = random.Random(kind), "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    statuses = {}
    for _ in range(1500):
        sent = body(rng, kind)
        data = json.dumps(sent, allow_nan=True).encode("utf-8", "surrogatepass")
        response = client.post(route, content=data, headers={"Content-Type": "application/json"})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (sent, response.text)
        if response.status_code != 200:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        elif not sent.get("stream") is True:
            assert response.json()["choices"]
    assert statuses.get(200, 0) > 20 and sum(v for k, v in statuses.items() if 400 <= k < 500) > 500
    plain = {"messages": HI, "max_tokens": 4} if kind == "chat" else {"prompt": "the cat", "max_tokens": 4}
    assert client.post(route, json=plain).status_code == 200


def test_a_body_past_the_limit_is_413_and_nan_deep_or_surrogate_bodies_are_handled(client):
    huge = json.dumps({"messages": HI, "user": "x" * (1 << 20)})
    answer = client.post("/v1/chat/completions", content=huge, headers={"Content-Type": "application/json"})
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"
    for raw, words in [(b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN"),
                       (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -Infinity}', "-Infinity"),
                       (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper"),
                       (b'{"messages": ' + b"[" * 70 + b"]" * 70 + b"}", "nests deeper")]:
        answer = client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
        assert answer.status_code == 400 and words in answer.json()["error"]["message"]
    lone = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    for route in ("/v1/chat/completions", "/tokenize"):
        raw = lone if route != "/tokenize" else b'{"content": "a\\ud800b"}'
        assert client.post(route, content=raw, headers={"Content-Type": "application/json"}).status_code == 200


# The other APIs: their own fields, each API's own error shape
API_FIELDS = {
    "/v1/responses": ["input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "temperature",
                      "top_p", "stream", "previous_response_id", "store", "background", "include", "reasoning",
                      "parallel_tool_calls", "min_p", "guided_regex"],
    "/v1/messages": ["messages", "system", "max_tokens", "tools", "tool_choice", "stop_sequences", "temperature",
                     "top_p", "top_k", "stream", "thinking", "metadata"],
    "/api/chat": ["messages", "tools", "format", "options", "stream", "keep_alive", "think"],
    "/api/generate": ["prompt", "suffix", "system", "raw", "format", "options", "stream", "template", "images"],
    "/infill": ["input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "temperature", "stream"],
}
API_VALUES = [HI, "hi", [{"type": "function_call_output", "call_id": "x", "output": "o"}],
              [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}],
              {"temperature": 2, "num_predict": 3}, {"temperature": "hot"}, {"format": {"type": "json_schema"}},
              [{"type": "function", "name": "f"}], [{"name": "f", "input_schema": {"type": "object"}}],
              {"type": "any"}, {"type": "enabled"}, "json", 8]


def api_error_is_its_shape(route: str, answer: dict) -> bool:
    if route == "/v1/messages":
        return answer["type"] == "error" and set(answer["error"]) == {"type", "message"} and answer["error"]["message"]
    if route.startswith("/api/"):
        return set(answer) == {"error"} and isinstance(answer["error"], str) and answer["error"]
    return set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]


@pytest.mark.parametrize("route", list(API_FIELDS))
def test_every_api_answers_hostile_bodies_with_a_4xx_in_its_own_shape(client, route):
    rng, statuses = random.Random(route), {}
    for _ in range(400):
        sent = {"model": "m"}
        for name in rng.sample(API_FIELDS[route], rng.randint(1, 5)):
            sent[name] = rng.choice(WEIRD + API_VALUES)
        data = json.dumps(sent, allow_nan=True).encode("utf-8", "surrogatepass")
        response = client.post(route, content=data, headers={"Content-Type": "application/json"})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (sent, response.text)
        if response.status_code != 200:
            assert api_error_is_its_shape(route, response.json()), (sent, response.text)
    assert sum(v for k, v in statuses.items() if 400 <= k < 500) > 100
    plain = {"/v1/responses": {"input": "hi"}, "/v1/messages": {"messages": HI, "max_tokens": 4},
             "/api/chat": {"messages": HI, "stream": False}, "/api/generate": {"prompt": "hi", "stream": False},
             "/infill": {"input_prefix": "a"}}[route]
    assert client.post(route, json={"model": "m", **plain}).status_code == (400 if route == "/infill" else 200)
