"""embeddings.py: the routes of a server started to embed (--embedding, or a folder with sentence-transformers'
modules.json) or to rerank (--rerank). Embeddings: OpenAI's /v1/embeddings (float or base64, `dimensions`), Ollama's
/api/embed and /api/embeddings, llama-server's /embedding; an extra field `prompt_name` puts one of the folder's
named prompts before each text (Qwen3-Embedding's "query" instruction), as sentence-transformers' encode does.
Reranking: /v1/rerank and /rerank in llama-server's and Jina's shape ({query, documents, top_n, return_documents};
results best first with relevance_score). A request's texts run in batches (runtime/embedding.py) on a worker
thread, one request at a time: the model is this server's alone (it runs no generation).
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time

import numpy as np

from dense_engine.formats.pooling import Pooling
from dense_engine.runtime import embedding
from dense_engine.server.protocol import BadRequest, check_fields

MAX_INPUTS = 2048  # texts a request (OpenAI's limit)


class Embedder:
    """The model, its vocabulary, and what this server does with them: pool (an embedding model) or rank pairs (a
    reranker); max_tokens: the most tokens a text may have (the context, or the folder's max_seq_length: cut there)."""

    def __init__(self, model, vocab, pooling: Pooling | None, reranker: embedding.Reranker | None,
                 max_tokens: int) -> None:
        self.model, self.vocab, self.pooling, self.reranker = model, vocab, pooling, reranker
        embedding.plain_linears(model)
        self.cutting = None  # cuts a text at max_seq_length keeping its special tokens, as sentence-transformers
        # does (Qwen3-Embedding's final EOS is the token its pooling reads)
        if pooling is not None and pooling.max_tokens:
            from tokenizers import Tokenizer

            self.cutting = Tokenizer.from_str(vocab.tokenizer.to_str())
            self.cutting.enable_truncation(pooling.max_tokens)
        self.max_tokens = max_tokens
        self.lock = threading.Lock()

    def tokens(self, inputs, name: str, prompt: str = "", cut: bool = True) -> list[list[int]]:
        """Each input's ids (a text, tokenized with the tokenizer's own special tokens as sentence-transformers
        does, or ids as given); a text past the folder's max_seq_length is cut there, past the context refused."""
        vocab, cap = self.vocab, self.pooling.max_tokens if self.pooling and self.pooling.max_tokens else None
        tokenizer = self.cutting if cut and self.cutting is not None else vocab.tokenizer
        single = isinstance(inputs, str) or isinstance(inputs, list) and inputs and all(
            isinstance(t, int) and not isinstance(t, bool) for t in inputs)
        items = [inputs] if single else inputs
        if not isinstance(items, list) or not items or len(items) > MAX_INPUTS or not all(
                isinstance(t, str) or isinstance(t, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                                  for i in t) for t in items):
            raise BadRequest(f"'{name}' must be a text, a list of up to {MAX_INPUTS} texts, or token ids", name)
        out = []
        for n, item in enumerate(items):
            ids = tokenizer.encode(prompt + item, add_special_tokens=True).ids if isinstance(item, str) else \
                item[:cap] if cap and cut else item
            if not ids:
                raise BadRequest(f"'{name}' {n} is empty", name)
            if any(not 0 <= i < vocab.size for i in ids):
                raise BadRequest(f"'{name}' {n}: token ids must be in 0..{vocab.size - 1}", name)
            if len(ids) > self.max_tokens:
                raise BadRequest(f"'{name}' {n} has {len(ids)} tokens; at most {self.max_tokens}", name)
            out.append(ids)
        return out

    def vectors(self, body: dict, name: str, dimensions=None, cut: bool = True) -> tuple[np.ndarray, int]:
        """([N, C] float32 vectors, the tokens read) of a request's inputs."""
        if self.pooling is None:
            raise BadRequest("this server reranks (--rerank): use /v1/rerank", name, status=501)
        prompt_name = body.get("prompt_name", self.pooling.default_prompt)
        if prompt_name is not None and prompt_name not in self.pooling.prompts:
            raise BadRequest(f"'prompt_name' must be one of the folder's prompts: "
                             f"{', '.join(sorted(self.pooling.prompts)) or 'it names none'}", "prompt_name")
        C = self.model.config.hidden_size
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                       or not 0 < dimensions <= C):
            raise BadRequest(f"'dimensions' must be an integer in 1..{C}", "dimensions")
        texts = self.tokens(body.get(name), name, self.pooling.prompts.get(prompt_name, ""), cut)
        with self.lock:
            vectors = embedding.embed(self.model, texts, self.pooling, dimensions)
        return vectors.numpy(), sum(map(len, texts))


def embedder(request) -> Embedder:
    server = request.app.state.server
    if getattr(server, "embedder", None) is None:
        raise BadRequest("this server generates text: start it with --embedding (or --rerank) for this route",
                         status=501)
    return server.embedder


async def openai_embeddings(request, body: dict) -> dict:
    check_fields(body, {"model", "input", "encoding_format", "dimensions", "user", "prompt_name"})
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise BadRequest("'encoding_format' must be float or base64", "encoding_format")
    vectors, used = await asyncio.to_thread(embedder(request).vectors, body, "input", body.get("dimensions"))
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64" else v.tolist()}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model_name(request, body),
            "usage": {"prompt_tokens": used, "total_tokens": used}}


async def ollama_embed(request, body: dict) -> dict:
    check_fields(body, {"model", "input", "truncate", "dimensions", "keep_alive", "options", "prompt_name"})
    start = time.perf_counter()
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise BadRequest("truncate must be true or false", "truncate")
    vectors, used = await asyncio.to_thread(embedder(request).vectors, body, "input", body.get("dimensions"),
                                            truncate)
    return {"model": model_name(request, body), "embeddings": vectors.tolist(),
            "total_duration": int((time.perf_counter() - start) * 1e9), "load_duration": 0, "prompt_eval_count": used}


async def ollama_embeddings(request, body: dict) -> dict:
    """Ollama's older route: {"prompt": text} -> {"embedding": [...]}."""
    check_fields(body, {"model", "prompt", "keep_alive", "options", "prompt_name"})
    if not isinstance(body.get("prompt"), str):
        raise BadRequest("prompt must be a text", "prompt")
    vectors, _ = await asyncio.to_thread(embedder(request).vectors, body, "prompt")
    return {"embedding": vectors[0].tolist()}


async def llama_embedding(request, body: dict) -> list:
    """llama-server's /embedding: {"content": text or texts} -> [{"index", "embedding": [vector]}] (a list of one
    pooled vector each)."""
    check_fields(body, {"model", "content", "input", "prompt_name"})
    name = "content" if "content" in body else "input"
    vectors, _ = await asyncio.to_thread(embedder(request).vectors, body, name)
    return [{"index": i, "embedding": [v.tolist()]} for i, v in enumerate(vectors)]


async def rerank(request, body: dict) -> dict:
    check_fields(body, {"model", "query", "documents", "top_n", "return_documents", "instruction"})
    server = embedder(request)
    if server.reranker is None:
        raise BadRequest("this server embeds (--embedding): start it with --rerank for this route", status=501)
    query, documents, instruction = body.get("query"), body.get("documents"), body.get("instruction")
    if not isinstance(query, str):
        raise BadRequest("'query' must be a text", "query")
    texts = [d.get("text") if isinstance(d, dict) else d for d in documents] if isinstance(documents, list) else None
    if not texts or len(texts) > MAX_INPUTS or not all(isinstance(t, str) for t in texts):
        raise BadRequest(f"'documents' must be a list of 1 to {MAX_INPUTS} texts (or {{text}} objects)", "documents")
    if instruction is not None and not isinstance(instruction, str):
        raise BadRequest("'instruction' must be a text", "instruction")
    top_n = body.get("top_n", len(texts))
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise BadRequest("'top_n' must be a positive integer", "top_n")
    returned = body.get("return_documents", False)
    if not isinstance(returned, bool):
        raise BadRequest("'return_documents' must be true or false", "return_documents")
    pairs = [server.reranker.pair(server.vocab, query, t, instruction) for t in texts]
    for n, ids in enumerate(pairs):
        if len(ids) > server.max_tokens:
            raise BadRequest(f"'documents' {n} with the query is {len(ids)} tokens; at most {server.max_tokens}",
                             "documents")

    def scores() -> list[float]:
        with server.lock:
            return server.reranker.scores(server.model, pairs)

    ranked = sorted(enumerate(await asyncio.to_thread(scores)), key=lambda pair: -pair[1])[:top_n]
    used = sum(map(len, pairs))
    return {"model": model_name(request, body), "object": "list",
            "usage": {"prompt_tokens": used, "total_tokens": used},
            "results": [{"index": i, "relevance_score": score, **({"document": {"text": texts[i]}} if returned else {})}
                        for i, score in ranked]}


def model_name(request, body: dict) -> str:
    return body.get("model") if isinstance(body.get("model"), str) else request.app.state.server.name


ROUTES = {"/v1/embeddings": openai_embeddings, "/api/embed": ollama_embed, "/api/embeddings": ollama_embeddings,
          "/embedding": llama_embedding, "/embeddings": llama_embedding, "/v1/rerank": rerank, "/rerank": rerank}
