"""The HTTP app (Starlette): routes as small functions over the server's state. A completion: parse the body
(protocol.py) in a worker thread, one scheduler Request per prompt whose events come back on an asyncio queue, and
those events read once (responses.ClientEvents) into a stream of chunks or one body (a Reply of the route's format).
Errors are the APIs' own bodies (BadRequest) with their status; a bug of ours is a 500 and the server goes on."""

from __future__ import annotations

import asyncio
import math
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dense_engine.runtime import caches, grammar, reasoning
from dense_engine.server import anthropic_messages, embeddings, infill, ollama_api, openai_responses, slots
from dense_engine.server.protocol import BadRequest, Settings, decode_body, parse_request
from dense_engine.server.records import Request, Shaping
from dense_engine.server.responses import ChatReply, ClientEvents, CompletionReply


@dataclass(frozen=True)
class API:
    """A route's API: its translator (its body -> the kind protocol.py parses, that body in OpenAI's chat or
    completions form, and what the reply needs of its own request), its Reply, the prefix of a reply's id."""
    translate: Callable  # (body, server) -> (kind, OpenAI body, meta)
    reply: type
    id_prefix: str


def as_is(kind: str) -> Callable:
    return lambda body, server: (kind, body, {})


APIS = {"/v1/chat/completions": API(as_is("chat"), ChatReply, "chatcmpl-"),
        "/v1/completions": API(infill.completions_body, CompletionReply, "cmpl-"),
        "/v1/responses": API(openai_responses.translate, openai_responses.ResponsesReply, "resp_"),
        "/v1/messages": API(anthropic_messages.translate, anthropic_messages.MessagesReply, "msg_"),
        "/infill": API(infill.translate, infill.InfillReply, "infill-"),
        "/api/chat": API(ollama_api.translate_chat, ollama_api.ChatReply, ""),
        "/api/generate": API(ollama_api.translate_generate, ollama_api.GenerateReply, "")}
COMPLETION_ROUTES = tuple(APIS)


def error_body(path: str, e: BadRequest) -> dict:
    """The error body in the shape of the API a path belongs to."""
    if path.startswith("/v1/messages"):
        return anthropic_messages.error_body(e)
    if path.startswith("/api/"):
        return ollama_api.error_body(e)
    return e.body()


def make_jobs(settings: Settings, server, sink, adapters: tuple[float, ...] = ()) -> list[Request]:
    """A scheduler Request per prompt of the settings, each with its own seeded noise; their events go to sink.
    adapters: the scales of the LoRA adapters served by name (picked_adapters)."""
    vocab, model = server.vocab, server.scheduler.model
    V = model.config.vocab_size
    sampler = settings.sampler
    jobs = [Request(prompt, settings.max_tokens, sampler, settings.stop,
                    torch.Generator(model.device).manual_seed((sampler.seed + i) % 2**63), sink, index=i,
                    logprobs=settings.logprobs, echo=settings.echo,
                    shaping=Shaping(constraint(settings, vocab, V), sampler.dry_for(vocab)), adapters=adapters)
            for i, prompt in enumerate(settings.prompts)]
    # n choices of a prompt (consecutive): the later ones copy the first one's prefill (not an echo's, whose logprobs
    # need every position; not a state model's, whose state is where its row ends)
    if settings.n > 1 and not settings.echo and not caches.has_state(model):
        for i, job in enumerate(jobs):
            job.follows = jobs[i - i % settings.n] if i % settings.n else None
    return jobs


def constraint(settings: Settings, vocab, V: int):
    """A reply's grammar: from its first token, or lazily from a trigger (a call's opener; a thinking model's
    </think>, which a reply that does not open its thinking with <think> never writes: the grammar then holds from
    its first token)."""
    if not settings.grammar:
        return None
    tokenizer = grammar.tokenizer_for(vocab, V)
    after_thinking = settings.trigger in reasoning.CLOSES and not settings.thinking
    opens = vocab.tokenizer.token_to_id(reasoning.markers(vocab.chat_template).token) if after_thinking else None
    if settings.trigger is None or after_thinking and opens is None:
        return grammar.Constraint(settings.grammar, tokenizer, V)
    return grammar.Lazy(settings.grammar, tokenizer, V, settings.trigger, opens)


def make_app(server):
    """The ASGI app: the routes below (each finds the server's state as request.app.state.server), the APIs' error
    bodies, then the API key and the log line (Guard) and, when asked for, CORS outermost."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    routes = [Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
              Route("/lora-adapters", lora_adapters),
              *(Route(path, completion, methods=["POST"]) for path in APIS),
              Route("/v1/messages/count_tokens", anthropic_count_tokens, methods=["POST"]),
              Route("/v1/responses/{id}", openai_responses_get, methods=["GET", "DELETE"]),
              Route("/api/tags", ollama_tags), Route("/api/ps", ollama_tags), Route("/api/version", ollama_version),
              Route("/api/show", ollama_show, methods=["POST"]),
              Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
              Route("/slots/{id}", slot_files, methods=["POST"]),
              *(Route(path, pooled, methods=["POST"]) for path in embeddings.ROUTES)]
    app = Starlette(routes=routes, exception_handlers={BadRequest: bad_request, HTTPException: http_error,
                                                        Exception: crash})
    app.state.server = server
    app = Guard(app, server.args.api_key, server.metrics)
    origins = getattr(server.args, "cors_origin", None)
    if origins:  # outermost: a browser's preflight is answered before the API key is asked for
        from starlette.middleware.cors import CORSMiddleware

        app = CORSMiddleware(app, allow_origins=origins, allow_methods=["GET", "POST", "OPTIONS"],
                             allow_headers=["*"])
    return app


def state(request):
    return request.app.state.server


async def health(request):
    server = state(request)
    if server.error:
        return json_response({"status": "error", "error": server.error}, 500)
    ready = server.ready.is_set()
    return json_response({"status": "ok"} if ready else {"status": "loading"}, 200 if ready else 503)


async def models(request):
    """The model, and each LoRA adapter served by name as a model of its own (vLLM's list: `parent` the base)."""
    server, now = state(request), int(time.time())
    base = {"id": server.name, "object": "model", "created": now, "owned_by": "dense-engine"}
    return json_response({"object": "list", "data": [base] + [{**base, "id": name, "parent": server.name}
                                                              for name, _, _ in server.adapters]})


async def lora_adapters(request):
    """llama-server's GET /lora-adapters: the adapters a request's `lora` field picks by id, with their scales."""
    return json_response([{"id": i, "name": name, "path": path, "scale": scale}
                          for i, (name, path, scale) in enumerate(state(request).adapters)])


def picked_adapters(server, body: dict) -> tuple[float, ...]:
    """The scales of the LoRA adapters served by name (--lora NAME=DIR) that a request picks, () for none: its
    `model` naming one (at its flag's scale; another name is the base model, as any client's name), then
    llama-server's `lora` field, [{"id": i, "scale": s}] by GET /lora-adapters' ids (the adapters it leaves out: 0)."""
    served = server.adapters
    scales = [scale if name == body.get("model") else 0.0 for name, _, scale in served]
    if "lora" in body:
        picks = body["lora"]
        if not isinstance(picks, list) or len(picks) > len(served) or not all(
                isinstance(p, dict) and set(p) <= {"id", "scale"} and "id" in p for p in picks):
            raise BadRequest(f"'lora' must be a list of {{\"id\": ..., \"scale\": ...}} objects, one per adapter "
                             f"at most ({len(served)} served by name: GET /lora-adapters)", "lora")
        scales = [0.0] * len(served)
        for i, pick in enumerate(picks):
            at, scale = pick["id"], pick.get("scale", 1.0)
            if type(at) is not int or not 0 <= at < len(served):
                raise BadRequest(f"lora[{i}].id must be the id of an adapter served by name (0..{len(served) - 1}), "
                                 f"got {at!r}", f"lora[{i}].id")
            if type(scale) not in (int, float) or not math.isfinite(scale):
                raise BadRequest(f"lora[{i}].scale must be a number, got {scale!r}", f"lora[{i}].scale")
            scales[at] = float(scale)
    return tuple(scales) if any(scales) else ()


async def completion(request):
    """A completion of any API: its body translated into OpenAI's form and parsed, its jobs submitted, their events
    read into the API's reply, streamed or whole."""
    from starlette.responses import StreamingResponse

    api, server, body = APIS[request.url.path], state(request), await ready_json(request)
    if server.scheduler is None:
        raise BadRequest(f"this server {'reranks' if server.embedder.pooling is None else 'embeds'} (--embedding, "
                         f"--rerank): it generates no text", status=501)
    refuse_if_full(server, 1)  # (before the work of parsing it)
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def sink(event) -> None:  # (called on the scheduler's thread)
        loop.call_soon_threadsafe(events.put_nowait, event)

    # the translating, the template's rendering, the tokenizing and a grammar's compiling run in a worker thread:
    # the event loop keeps streaming the other requests' tokens meanwhile
    settings, jobs, meta = await asyncio.to_thread(parse_jobs, server, api, body, sink)
    if settings is None:
        return json_response(meta)
    refuse_if_full(server, len(jobs))
    head = {"id": api.id_prefix + uuid.uuid4().hex[:24], "created": int(time.time()),
            "model": body.get("model") if isinstance(body.get("model"), str) else server.name,
            "system_fingerprint": None}
    for job in jobs:
        server.scheduler.submit(job)
    request.scope.setdefault("state", {})["job"] = jobs[0]
    reader = ClientEvents(jobs, server.vocab, settings.calling, settings.thinking)
    reply = api.reply(head, jobs, server.vocab, settings, meta)
    if settings.stream:
        return StreamingResponse(streamed(reader, reply, events, jobs), media_type=reply.media_type,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    if not await whole(request, reader, reply, events, jobs):
        return json_response({}, 499)
    return json_response(reply.body())


def parse_jobs(server, api: API, body: dict, sink) -> tuple[Settings | None, list[Request], dict]:
    """The request translated and parsed, and its jobs; (None, [], the answer) for one that needs no model."""
    adapters = picked_adapters(server, body)
    kind, body, meta = api.translate({k: v for k, v in body.items() if k != "lora"}, server)
    if kind is None:
        return None, [], body
    try:
        settings = parse_request(body, kind, server.vocab, server.max_seq_len, server.scheduler.draft is not None)
    except BadRequest as e:
        raise renamed(e, meta.get("fields", {})) from None
    return settings, make_jobs(settings, server, sink, adapters), meta


def renamed(e: BadRequest, fields: dict) -> BadRequest:
    """An error of the translated body in the names of the API's own fields (chat's max_tokens -> Responses'
    max_output_tokens, ...)."""
    message, param = str(e), e.param
    for ours, theirs in fields.items():
        message = re.sub(rf"'{re.escape(ours)}'|\b{re.escape(ours)}(\[\d+\])+", f"'{theirs}'", message)
        if param is not None and re.match(rf"{re.escape(ours)}($|\[|\.)", param):
            param = theirs
    return BadRequest(message, param, e.status, e.kind, e.code)


async def pooled(request):
    """An embedding or a ranking (embeddings.py)."""
    return json_response(await embeddings.ROUTES[request.url.path](request, await ready_json(request)))


async def anthropic_count_tokens(request):
    server, body = state(request), await ready_json(request)
    return json_response(await asyncio.to_thread(anthropic_messages.count_tokens, body, server))


async def openai_responses_get(request):
    """GET /v1/responses/{id}: a stored response; DELETE: forget it."""
    found = openai_responses.STORE.get(request.path_params["id"], request.method == "DELETE")
    if found is None:
        raise BadRequest(f"no stored response with id '{request.path_params['id']}'", "response_id", status=404,
                         code="not_found")
    return json_response(found)


async def ollama_tags(request):
    return json_response(ollama_api.tags(state(request), running=request.url.path == "/api/ps"))


async def ollama_version(request):
    return json_response(ollama_api.version())


async def ollama_show(request):
    return json_response(ollama_api.show(state(request), await ready_json(request)))


async def tokenize(request):
    """llama-server's shape: {"content": text, "add_special": false, "with_pieces": false} -> {"tokens": [...]}."""
    vocab, body = state(request).vocab, await ready_json(request)
    content = body.get("content")
    if not isinstance(content, str):
        raise BadRequest("'content' must be a string", "content")
    ids = vocab.encode(content, special=bool(body.get("add_special", False)))
    if body.get("with_pieces"):
        return json_response({"tokens": [{"id": i, "piece": vocab.tokenizer.id_to_token(i)} for i in ids]})
    return json_response({"tokens": ids})


async def detokenize(request):
    """{"tokens": [ids]} -> {"content": text}."""
    vocab, body = state(request).vocab, await ready_json(request)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab.size
                                            for i in ids):
        raise BadRequest(f"'tokens' must be a list of token ids in 0..{vocab.size - 1}", "tokens")
    return json_response({"content": vocab.tokenizer.decode(ids, skip_special_tokens=False)})


async def slot_files(request):
    """POST /slots/{id}?action=save|restore|erase: llama-server's slot files (slots.py)."""
    server, body = state(request), await ready_json(request)
    return json_response(await slots.act(server, request.path_params["id"], request.query_params.get("action"), body))


async def metrics(request):
    from starlette.responses import Response

    text, media_type = state(request).metrics.text()
    return Response(text, media_type=media_type)


async def ready_json(request) -> dict:
    """The body, read up to --max-body-mb (413 past it, before the rest is read), decoded in a worker thread (a
    large or deep body never holds the event loop)."""
    server = state(request)
    if not server.ready.is_set():
        raise BadRequest("the model is loading; try again shortly", status=503, kind="server_error")
    megabytes = getattr(server.args, "max_body_mb", 16)
    limit = megabytes << 20
    too_large = BadRequest(f"the body is larger than {megabytes} MiB (serve.py --max-body-mb)", status=413,
                           code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return await asyncio.to_thread(decode_body, b"".join(chunks))


async def bad_request(request, e: BadRequest):
    return error_response(e, request.url.path)


async def http_error(request, e):
    message = "not found" if e.status_code == 404 else e.detail
    return error_response(BadRequest(f"{request.method} {request.url.path}: {message}", status=e.status_code),
                          request.url.path)


async def crash(request, e: Exception):  # a bug of ours: one line in the log, a 500 body, the server goes on
    print(f"error: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    return error_response(BadRequest(f"internal error: {type(e).__name__}", status=500, kind="server_error"),
                          request.url.path)


def json_response(content, status: int = 200, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(content, status_code=status, headers=headers)


async def streamed(reader: ClientEvents, reply, events: asyncio.Queue, jobs: list[Request]):
    """The reply's chunks as its pieces come (server-sent events, or Ollama's lines), then its last ones."""
    try:
        for chunk in reply.start():
            yield reply.frame(chunk)
        while reader.open:
            for piece in reader.feed(await events.get()):
                for chunk in reply.chunks(piece):
                    yield reply.frame(chunk)
        for chunk in reply.end():
            yield reply.frame(chunk)
        if reply.done_line:
            yield reply.done_line
    finally:  # the client went away (or the stream ended): the rows are freed at the next step
        for job in jobs:
            job.cancelled = job.finish_reason is None


async def whole(request, reader: ClientEvents, reply, events: asyncio.Queue, jobs: list[Request]) -> bool:
    """Fold every piece into the reply; False when the client went away first (its rows are freed at the next
    step, and no one is answered)."""
    gone = asyncio.ensure_future(disconnected(request))
    try:
        while reader.open:
            got = asyncio.ensure_future(events.get())
            await asyncio.wait([got, gone], return_when=asyncio.FIRST_COMPLETED)
            if gone.done():
                got.cancel()
                for job in jobs:
                    job.cancelled = True
                return False
            for piece in reader.feed(got.result()):
                reply.fold(piece)
        return True
    finally:
        gone.cancel()


async def disconnected(request) -> None:
    """Returns when the client of a non-streamed request goes away (its body is read: the next message of the
    connection is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def refuse_if_full(server, incoming: int) -> None:
    waiting = server.scheduler.waiting.qsize()
    if waiting + incoming > server.args.max_queue:
        raise BadRequest(f"the server is busy ({waiting} requests wait for a row); try again shortly",
                         status=503, kind="server_error", code="queue_full")


def error_response(e: BadRequest, path: str = ""):
    return json_response(error_body(path, e), e.status, {"Retry-After": "1"} if e.status == 503 else None)


class Guard:
    """ASGI middleware: the API key (when --api-key is set) and one log line per request (method, path, status,
    tokens, time)."""

    def __init__(self, app, api_key: str | None, metrics=None) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [0]
        scope.setdefault("state", {})
        if self.api_key is not None and scope["path"] != "/health":
            headers = dict(scope.get("headers") or [])
            bearer = headers.get(b"authorization", b"").decode("latin-1") == f"Bearer {self.api_key}"
            if not bearer and headers.get(b"x-api-key", b"").decode("latin-1") != self.api_key:  # (Anthropic's)
                response = error_response(BadRequest("invalid or missing API key (Authorization: Bearer KEY, or "
                                                     "x-api-key: KEY)", status=401, code="invalid_api_key"),
                                          scope["path"])
                await response(scope, receive, send)
                log(scope, 401, None, start)
                return

        async def watched(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log(scope, status[0], scope["state"].get("job"), start)
                if self.metrics is not None and scope["path"] in COMPLETION_ROUTES:
                    self.metrics.requests.labels(str(status[0])).inc()

        await self.app(scope, receive, watched)


def log(scope, status: int, job: Request | None, start: float) -> None:
    tokens = f"{len(job.prompt)}+{len(job.generated)} tokens" if job is not None else "-"
    print(f"{scope['method']} {scope['path']} {status} {tokens} {(time.perf_counter() - start) * 1000:.0f} ms",
          file=sys.stderr, flush=True)
