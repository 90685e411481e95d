"""serve.py as a real server process on a free port, driven by the official `openai` client (and raw HTTP where a
client would not send such a request): chat and completion, streams equal to the whole answers, stop strings,
usage, concurrent requests equal to the same requests one at a time (and to chat.py's stdout), a request joining a
running batch, bad requests, a client going away, the API key, SIGTERM."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, fixture_path

openai = pytest.importorskip("openai")
LLAMA = fixture_path("llama")  # a ChatML template; greedy text of random weights


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *flags, env=None) -> None:
        self.port = free_port()
        self.log = []
        self.process = subprocess.Popen([sys.executable, os.path.join(ROOT, "serve.py"), "--ckpt", LLAMA, "--port",
                                         str(self.port), *flags], stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, **(env or {})})
        threading.Thread(target=lambda: self.log.extend(self.process.stderr), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"
        end = time.monotonic() + 240
        while time.monotonic() < end and self.process.poll() is None:
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("the server did not start: " + "".join(self.log))

    def request(self, method: str, path: str, body=None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        raw = response.read()
        conn.close()
        return response.status, json.loads(raw) if raw.startswith(b"{") else raw

    def get(self, path):
        return self.request("GET", path)

    def client(self, key="unused"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server("--max-batch", "4")  # (the cache folder the other tests share: kernels built once)
    yield s
    s.stop()


def chat(client, content, **settings):
    return client.chat.completions.create(model="anything", messages=[{"role": "user", "content": content}],
                                          **{"temperature": 0, "max_tokens": 24, **settings})


@pytest.mark.slow
def test_chat_equals_chat_py_and_streams_equal_whole_answers(server):
    client = server.client()
    whole = chat(client, "hi there")
    text = whole.choices[0].message.content
    cli = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", LLAMA, "--prompt", "hi there",
                          "--temperature", "0", "--max-new-tokens", "24"], capture_output=True, text=True)
    assert cli.returncode == 0 and text == cli.stdout
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.object == "chat.completion"
    usage = whole.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens and usage.completion_tokens <= 24
    assert (whole.choices[0].finish_reason == "length") == (usage.completion_tokens == 24)
    chunks = list(chat(client, "hi there", stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == usage.model_dump()
    models = client.models.list()
    assert models.data[0].id == "llama"


def test_completions_equal_chat_py_complete(server):
    client = server.client()
    out = client.completions.create(model="x", prompt="the cat sat", max_tokens=16, temperature=0)
    cli = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", LLAMA, "--prompt", "the cat sat",
                          "--complete", "--temperature", "0", "--max-new-tokens", "16", "--no-compile"],
                         capture_output=True, text=True)
    assert out.choices[0].text == cli.stdout and out.object == "text_completion"
    streamed = client.completions.create(model="x", prompt="the cat sat", max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text


def test_stop_strings_end_the_text_before_them(server):
    client = server.client()
    text = chat(client, "hi there", max_tokens=24).choices[0].message.content
    assert len(text) >= 6
    stop = text[3:6]
    cut = chat(client, "hi there", stop=[stop, "never-there"])
    assert cut.choices[0].message.content == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, "hi there", stop=stop, stream=True)
                       if c.choices)
    assert streamed == cut.choices[0].message.content


def test_concurrent_requests_equal_their_answers_alone(server):
    """More requests than rows, of different lengths and settings, at once: each greedy answer is the one it gets
    alone, and the same seed gives the same sampled text."""
    client = server.client()
    prompts = [f"question {i} " * (1 + i % 5) for i in range(7)]
    alone = [chat(client, p, max_tokens=8 + 4 * (i % 3)).choices[0].message.content for i, p in enumerate(prompts)]
    sampled = chat(client, "tell me", temperature=0.9, top_p=0.9, seed=7, max_tokens=16).choices[0].message.content
    results, threads = {}, []

    def ask(i):
        results[i] = chat(client, prompts[i], max_tokens=8 + 4 * (i % 3)).choices[0].message.content

    def ask_sampled():
        results["s"] = chat(client, "tell me", temperature=0.9, top_p=0.9, seed=7,
                            max_tokens=16).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    threads.append(threading.Thread(target=ask_sampled))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(prompts))] == alone
    assert results["s"] == sampled


def test_a_request_joining_a_running_batch_finishes_first(server):
    """A short request sent while a long one streams joins the running decode and is done long before it."""
    client = server.client()
    done, started = {}, threading.Event()

    def long():
        for chunk in chat(client, "a long one", max_tokens=100, stream=True):
            started.set()
        done["long"] = time.monotonic()

    t = threading.Thread(target=long)
    t.start()
    assert started.wait(60)
    short = chat(client, "short", max_tokens=2)
    done["short"] = time.monotonic()
    t.join()
    assert done["short"] < done["long"] and short.usage.completion_tokens <= 2


@pytest.mark.parametrize("body, status, param, words", [
    (b"{not json", 400, None, "not valid JSON"),
    ({"model": "m"}, 400, "messages", "'messages' must be"),
    ({"messages": "hello"}, 400, "messages", "'messages' must be"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0]", "string 'content'"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, 400, "max_tokens", "at least 1"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 9}, 400, "max_tokens", "left after"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}, 400, "max_tokens", "an integer"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature", "a number"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n", "not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, "logprobs", "not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, 400, "frobnicate", "unrecognized"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages", "the context holds"),
])
def test_bad_requests_get_openais_error_body_and_the_server_goes_on(server, body, status, param, words):
    got, answer = server.request("POST", "/v1/chat/completions", body)
    assert got == status
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["param"] == param
    assert words in answer["error"]["message"]
    assert server.get("/health")[0] == 200


def test_unknown_routes_are_404_with_the_same_body(server):
    got, answer = server.get("/v1/nothing")
    assert got == 404 and answer["error"]["type"] == "invalid_request_error"


def test_a_client_that_goes_away_frees_its_row(server):
    """Disconnecting mid-stream ends that request at once: its row serves the next ones (every row is freed)."""
    for _ in range(5):  # more than --max-batch rows' worth: a leaked row would leave the last ones waiting
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps({
            "messages": [{"role": "user", "content": "go on"}], "max_tokens": 100, "temperature": 0, "stream": True}),
            {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.readline()  # the first event
        conn.close()
    time.sleep(1)
    start = time.monotonic()
    chat(server.client(), "still there?", max_tokens=4)
    assert time.monotonic() - start < 20
    assert any("POST /v1/chat/completions 200" in line for line in server.log)  # one log line per request


@pytest.mark.slow
def test_api_key_and_sigterm(tmp_path):
    s = Server("--api-key", "sesame", "--no-compile")
    try:
        with pytest.raises(openai.AuthenticationError):
            chat(s.client("wrong"), "hi")
        assert s.request("POST", "/v1/completions", {"prompt": "x"})[0] == 401
        assert chat(s.client("sesame"), "hi", max_tokens=2).choices[0].message.content is not None
        assert s.get("/health")[0] == 200  # (health needs no key)
    finally:
        start = time.monotonic()
        assert s.stop() == 0 and time.monotonic() - start < 15


@pytest.mark.slow
def test_torchrun_serves_from_rank_0_with_the_others_following(server, tmp_path):
    """Two ranks: the same greedy answers as one process; SIGTERM to rank 0 ends every rank (and torchrun) with 0."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           **({"GLOO_SOCKET_IFNAME": "lo"} if os.path.isdir("/sys/class/net/lo") else {})}
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            os.path.join(ROOT, "serve.py"), "--ckpt", LLAMA, "--port", str(port), "--no-compile"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                answer = chat(client, "hi there")
                break
            except (openai.APIConnectionError, openai.InternalServerError):
                time.sleep(0.5)
        assert answer.choices[0].message.content == chat(server.client(), "hi there").choices[0].message.content
        ranks = subprocess.run(["pgrep", "-f", f"serve.py --ckpt {LLAMA} --port {port}"], capture_output=True,
                               text=True).stdout.split()
        rank0 = next(p for p in ranks if b"LOCAL_RANK=0" in open(f"/proc/{p}/environ", "rb").read().split(b"\0"))
        os.kill(int(rank0), signal.SIGTERM)
        assert run.wait(timeout=30) == 0
    finally:
        if run.poll() is None:
            run.kill()
