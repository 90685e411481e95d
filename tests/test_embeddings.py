"""Embeddings and reranking (server/embeddings.py, runtime/embedding.py) against their references on tiny random
models made with transformers: the vectors of sentence-transformers' own encode on the same folder (each pooling
kind, normalized or not, a named prompt, `dimensions`, the Qwen3-Embedding layout: the decoder's tensors at the top
level, no head), through OpenAI's and Ollama's clients and llama-server's route; the scores of Qwen3-Reranker's
formula computed with transformers; and the errors in each API's shape."""

import json
import os
import shutil
import threading
import types

import numpy as np
import pytest
import torch
from conftest import fixture_path
from test_apis import ollama_client, openai_client

from dense_engine.formats import load
from dense_engine.formats.pooling import read_pooling
from dense_engine.formats.vocab import load_vocabulary
from dense_engine.runtime.embedding import RERANK_INSTRUCTION, RERANK_PREFIX, RERANK_SUFFIX, Reranker
from dense_engine.server.embeddings import Embedder
from dense_engine.system.errors import CheckpointError

TEXTS = ["The capital of France is Paris.", "hi", "A longer text about decoders, embeddings and pooling " * 3,
         "Oslo", "two words"]
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages\nQuery:"
MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
           {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
POOLINGS = {"lasttoken": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def tiny_qwen3(folder, head: bool, seed: int = 0, vocab_size: int = 512) -> None:
    """A random Qwen3 decoder saved by transformers (Qwen3Model: the tensors at the top level, as Qwen3-Embedding's;
    Qwen3ForCausalLM with its head, as Qwen3-Reranker's), the fixture's tokenizer beside it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=not head, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = (Qwen3ForCausalLM if head else Qwen3Model)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)  # (every gain matters)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(fixture_path("llama"), name), os.path.join(folder, name))


@pytest.fixture(scope="module")
def embedding_folder(tmp_path_factory):
    """Qwen3-Embedding's layout: the decoder alone, a tokenizer that ends every text with <|endoftext|> (the token
    last-token pooling reads; a text cut at max_seq_length keeps it), sentence-transformers' modules."""
    from tokenizers import Tokenizer, processors

    folder = tmp_path_factory.mktemp("qwen3_embedding")
    tiny_qwen3(folder, head=False)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", tokenizer.token_to_id("<|endoftext|>"))])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": config.get("eos_token")}))
    (folder / "modules.json").write_text(json.dumps(MODULES))
    (folder / "1_Pooling").mkdir()
    (folder / "2_Normalize").mkdir()
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40, "do_lower_case": False}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None}))
    return folder


def set_pooling(folder, kind: str, normalize: bool) -> None:
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, **{key: key == POOLINGS[kind] for key in POOLINGS.values()},
         "pooling_mode_max_tokens": False, "include_prompt": True}))
    (folder / "modules.json").write_text(json.dumps(MODULES if normalize else MODULES[:2]))


def serve(folder, reranker: bool = False):
    """A TestClient of the HTTP app over an Embedder of the folder (what serve.py builds for --embedding and
    --rerank), and that Embedder."""
    from starlette.testclient import TestClient

    from dense_engine.server import app
    from dense_engine.server.metrics import Metrics

    vocab = load_vocabulary(str(folder), None)
    model = load.from_pretrained(str(folder), dtype=torch.float32, quant="none")
    embedder = Embedder(model, vocab, None if reranker else read_pooling(str(folder)),
                        Reranker.of(vocab) if reranker else None, 256)
    server = types.SimpleNamespace(adapters=[], vocab=vocab, max_seq_len=256, name="tiny", error=None,
                                   ready=threading.Event(),
                                   metrics=Metrics(), scheduler=None, embedder=embedder,
                                   args=types.SimpleNamespace(api_key=None, max_queue=64, cors_origin=None))
    server.ready.set()
    return TestClient(app.make_app(server)), embedder


def close(ours, theirs) -> None:
    ours, theirs = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    cosine = (ours * theirs).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(theirs, axis=-1)
    assert cosine.min() >= 0.9999 and np.abs(ours - theirs).max() <= 1e-4, (cosine.min(), np.abs(ours - theirs).max())


@pytest.mark.parametrize("kind, normalize", [("lasttoken", True), ("mean", False), ("cls", True)])
def test_embeddings_equal_sentence_transformers(embedding_folder, kind, normalize):
    from sentence_transformers import SentenceTransformer

    set_pooling(embedding_folder, kind, normalize)
    reference = SentenceTransformer(str(embedding_folder), device="cpu")
    http, _ = serve(embedding_folder)
    client = openai_client(http)
    answer = client.embeddings.create(model="tiny", input=TEXTS)  # (the client asks for base64, and decodes it)
    close([d.embedding for d in answer.data], reference.encode(TEXTS))
    floats = http.post("/v1/embeddings", json={"model": "tiny", "input": TEXTS[0], "encoding_format": "float"}).json()
    close([floats["data"][0]["embedding"]], reference.encode(TEXTS[:1]))
    lengths = [len(reference.tokenize([t])["input_ids"][0]) for t in TEXTS]
    assert answer.usage.prompt_tokens == sum(lengths) and max(lengths) == 40  # (the long one cut at max_seq_length)
    assert [d.index for d in answer.data] == list(range(len(TEXTS)))


def test_a_named_prompt_dimensions_and_ollamas_routes(embedding_folder):
    from sentence_transformers import SentenceTransformer

    set_pooling(embedding_folder, "lasttoken", True)
    reference = SentenceTransformer(str(embedding_folder), device="cpu")
    http, _ = serve(embedding_folder)
    client = openai_client(http)
    queries = client.embeddings.create(model="tiny", input=TEXTS[:2], extra_body={"prompt_name": "query"})
    close([d.embedding for d in queries.data], reference.encode(TEXTS[:2], prompt_name="query"))
    short = client.embeddings.create(model="tiny", input=TEXTS[:2], dimensions=16)
    whole = reference.encode(TEXTS[:2])[:, :16]
    close([d.embedding for d in short.data], whole / np.linalg.norm(whole, axis=-1, keepdims=True))
    ollama = ollama_client(http)
    embedded = ollama.embed(model="tiny", input=TEXTS)
    close(embedded.embeddings, reference.encode(TEXTS))
    assert embedded.prompt_eval_count == sum(len(reference.tokenize([t])["input_ids"][0]) for t in TEXTS)
    close([ollama.embeddings(model="tiny", prompt=TEXTS[0]).embedding], reference.encode(TEXTS[:1]))
    llama = http.post("/embedding", json={"content": TEXTS[:2]}).json()
    assert [item["index"] for item in llama] == [0, 1]
    close([item["embedding"][0] for item in llama], reference.encode(TEXTS[:2]))


def test_bad_requests_are_each_apis_errors(embedding_folder):
    set_pooling(embedding_folder, "mean", True)
    http, _ = serve(embedding_folder)
    for body, param in (({"input": []}, "input"), ({"input": [1, "a"]}, "input"), ({"input": [[]]}, "input"),
                        ({"input": "a", "dimensions": 65}, "dimensions"),
                        ({"input": "a", "dimensions": 0}, "dimensions"),
                        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "a", "prompt_name": "passage"}, "prompt_name"),
                        ({"input": [[1, 99999]]}, "input"), ({"input": "x " * 300, "model": "m"}, None)):
        response = http.post("/v1/embeddings", json=body)
        if param is None:  # (cut at max_seq_length, as sentence-transformers cuts it: not an error)
            assert response.status_code == 200
            continue
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (body, response.json())
    assert http.get("/metrics").status_code == 200 and http.get("/health").json() == {"status": "ok"}
    response = http.post("/api/embed", json={"model": "m", "input": 5})
    assert response.status_code == 400 and set(response.json()) == {"error"}  # (Ollama's shape: a string)
    assert isinstance(response.json()["error"], str)
    for path in ("/v1/chat/completions", "/v1/rerank"):
        response = http.post(path, json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                         "query": "q", "documents": ["d"]})
        assert response.status_code == 501 and "--rerank" in response.json()["error"]["message"]


def test_a_folder_whose_modules_this_engine_does_not_run_is_refused(tmp_path):
    (tmp_path / "modules.json").write_text(json.dumps(MODULES[:2] + [
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(CheckpointError, match="modules.json: expected the modules Transformer, Pooling"):
        read_pooling(str(tmp_path))
    (tmp_path / "modules.json").write_text(json.dumps(MODULES[:2]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(CheckpointError, match="config.json: expected one of pooling_mode_lasttoken"):
        read_pooling(str(tmp_path))
    assert read_pooling(fixture_path("llama")) is None  # (a plain decoder's folder: no modules.json)


@pytest.fixture(scope="module")
def reranker_folder(tmp_path_factory):
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("qwen3_reranker")
    tiny_qwen3(folder, head=True, seed=1, vocab_size=520)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_tokens(["yes", "no"])  # (Qwen3's vocabulary has them as single tokens)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_rerank_equals_qwen3_rerankers_formula_in_transformers(reranker_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    documents = ["Paris is the capital of France.", "Bananas are yellow.", "France borders Spain.", "no"]
    query, instruction = "What is the capital of France?", "Find the answer"
    tokenizer = AutoTokenizer.from_pretrained(str(reranker_folder))
    model = AutoModelForCausalLM.from_pretrained(str(reranker_folder), dtype=torch.float32)
    prefix = tokenizer.encode(RERANK_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")

    def formula(instruct: str) -> list[float]:
        scores = []
        for document in documents:
            pair = f"<Instruct>: {instruct}\n<Query>: {query}\n<Document>: {document}"
            ids = prefix + tokenizer.encode(pair, add_special_tokens=False) + suffix
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]
            scores.append(float(torch.stack([logits[no], logits[yes]]).log_softmax(0)[1].exp()))
        return scores

    http, _ = serve(reranker_folder, reranker=True)
    for extra, instruct in (({}, RERANK_INSTRUCTION), ({"instruction": instruction}, instruction)):
        want = formula(instruct)
        answer = http.post("/v1/rerank", json={"model": "r", "query": query, "documents": documents, **extra}).json()
        assert [r["index"] for r in answer["results"]] == sorted(range(4), key=lambda i: -want[i])  # (best first)
        for r in answer["results"]:
            assert abs(r["relevance_score"] - want[r["index"]]) <= 1e-5
    top = http.post("/rerank", json={"query": query, "documents": [{"text": d} for d in documents], "top_n": 2,
                                     "return_documents": True}).json()
    assert len(top["results"]) == 2 and top["results"][0]["document"]["text"] == documents[top["results"][0]["index"]]
    assert top["usage"]["prompt_tokens"] > 0
    for body, param in (({"query": 1, "documents": ["a"]}, "query"), ({"query": "q", "documents": []}, "documents"),
                        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n")):
        response = http.post("/v1/rerank", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    response = http.post("/v1/embeddings", json={"input": "a"})
    assert response.status_code == 501 and "/v1/rerank" in response.json()["error"]["message"]


def test_what_a_server_does_is_decided_by_its_flags_and_folder(embedding_folder, reranker_folder, capsys):
    from dense_engine.server.serve import parse_args, pooling_for
    from dense_engine.system.errors import UsageError

    set_pooling(embedding_folder, "mean", True)

    def decided(folder, *flags):
        args = parse_args(["--ckpt", str(folder), *flags])
        vocab = load_vocabulary(str(folder), None)
        model = load.from_pretrained(str(folder), dtype=torch.float32, quant="none")
        return pooling_for(args, str(folder), vocab, model, types.SimpleNamespace(max_seq_len=None))

    embeds = decided(embedding_folder)  # (modules.json: an embedding model, without a flag)
    assert embeds.pooling.kind == "mean" and embeds.pooling.normalize and embeds.max_tokens == 256
    assert decided(reranker_folder) is None  # (a plain decoder generates)
    plain = decided(reranker_folder, "--embedding")
    assert plain.pooling.kind == "lasttoken" and plain.pooling.normalize
    assert "no modules.json" in capsys.readouterr().err
    assert decided(reranker_folder, "--rerank").reranker.yes == load_vocabulary(
        str(reranker_folder), None).tokenizer.token_to_id("yes")
    with pytest.raises(UsageError, match="--rerank: .* no 'yes' and 'no' tokens"):
        decided(embedding_folder, "--rerank")
    with pytest.raises(UsageError, match="--embedding and --rerank"):
        parse_args(["--embedding", "--rerank"])


def test_a_gguf_files_pooling_type_makes_it_an_embedding_model(tmp_path):
    """{arch}.pooling_type, as llama.cpp reads it: mean or last, normalized (llama-server's embeddings), against the
    plain pass pooled by hand; none: a generator; rank (a classifier head) refused in one line."""
    import torch.nn.functional as F
    from conftest import FIXTURES
    from test_gguf import U32, rewrite

    source = os.path.join(FIXTURES, "converted_gguf", "mistral3.gguf")
    assert read_pooling(source) is None
    for kind, pool in ((1, lambda h: h.mean(0)), (3, lambda h: h[-1])):
        path = rewrite(source, str(tmp_path / f"{kind}.gguf"), add={"mistral3.pooling_type": (kind, U32)})
        vocab, model = load_vocabulary(path, None), load.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            want = [F.normalize(pool(model.hidden_states(torch.tensor([vocab.encode(t, special=True)]))[0]), dim=-1)
                    for t in TEXTS[:2]]
        vectors, _ = Embedder(model, vocab, read_pooling(path), None, 64).vectors({"input": TEXTS[:2]}, "input")
        close(vectors, torch.stack(want).numpy())
    path = rewrite(source, str(tmp_path / "rank.gguf"), add={"mistral3.pooling_type": (4, U32)})
    with pytest.raises(CheckpointError, match="mistral3.pooling_type 4: .*rank"):
        read_pooling(path)
