"""The prefix store (dense_engine/server/prefix_store.py): what rows held before other requests took them, kept in
host memory in blocks keyed by their tokens. Blocks match only a prompt that shares every token up to their end;
the store keeps its byte bound (least recently used leaf first); a returning conversation's prefix is copied back into
a row and its greedy reply equals a cold prefill's (eager and compiled, both cache layouts)."""

import os
from pathlib import Path

import pytest
import torch
from conftest import fixture_path, run_alone

from dense_engine.formats.load import LoadRecord
from dense_engine.runtime import caches
from dense_engine.runtime.sampling import SamplerSettings
from dense_engine.server.prefix_store import PrefixStore

LLAMA = fixture_path("llama")  # a ChatML template, a context of 128


class Colliding(int):
    """A token whose hash is every token's: a key that compared hashes alone would mix prompts."""

    def __hash__(self) -> int:
        return 0


def test_a_block_matches_only_a_prompt_with_every_token_up_to_its_end():
    store = PrefixStore(1 << 20, 1, block=4)
    a = [Colliding(t) for t in [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    new, evicted = store.add(a)
    assert new == [(0, 0), (1, 4)] and evicted == []  # (the ninth token: no whole block)
    assert [b.id for b in store.match(a, 9)] == [0, 1]
    assert [b.id for b in store.match(a, 7)] == [0]  # within the limit only
    other_second = [Colliding(t) for t in [1, 2, 3, 4, 5, 6, 7, 0]]  # same hashes, one token differs
    assert [b.id for b in store.match(other_second, 8)] == [0]
    other_first = [Colliding(t) for t in [0, 2, 3, 4, 5, 6, 7, 8]]  # its second block equals a's, its first does not
    assert store.match(other_first, 8) == []
    new, _ = store.add(other_first)
    assert new == [(2, 0), (3, 4)]  # a block of the same tokens after another prefix is another block
    assert [b.id for b in store.match(other_first, 8)] == [2, 3] and [b.id for b in store.match(a, 8)] == [0, 1]
    assert store.add(a) == ([], [])  # stored already: nothing new


def test_the_store_keeps_its_bound_least_recently_used_leaf_first():
    store = PrefixStore(3 * 4 * 10, 10, block=4)  # room for 3 blocks
    a, b, c = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 8, 8, 8, 8], [1, 2, 3, 4, 7, 7, 7, 7]
    assert store.add(a) == ([(0, 0), (1, 4)], [])
    assert store.add(b) == ([(2, 0), (3, 4)], [1])  # b's second block: a's leaf goes (a's first has no other child)
    assert store.bytes == 3 * 40 and store.evictions == 1
    store.match(a, 8)  # a's first block: now more recent than b's
    assert store.add(c) == ([(4, 4)], [3])  # c continues a's first block; b's leaf (the least recent) goes
    assert sorted(blk.id for blk in store.index.values()) == [0, 2, 4]
    ids = {blk.id for blk in store.index.values()}
    assert all(blk.parent is None or blk.parent.id in ids for blk in store.index.values())  # chains stay whole
    tiny = PrefixStore(4 * 10, 10, block=4)  # room for one block: a chain never evicts its own
    assert tiny.add(a) == ([(0, 0)], [])


def test_a_state_models_prefix_matches_up_to_its_last_block_holding_a_state():
    store = PrefixStore(4 * 40 + 2 * 100, 10, block=4, state_bytes=100)  # room for 4 blocks and 2 states
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert store.add(a[:8]) == ([(0, 0), (1, 4)], []) and store.match(a, 12) == []  # no state: nothing to reuse
    assert store.hold_state(a[:8]) == (1, []) and store.hold_state(a[:8]) == (None, [])  # (held already)
    assert store.hold_state(a[:6]) == (None, [])  # not a whole block's end
    assert store.add(a) == ([(2, 8)], []) and [b.id for b in store.match(a, 12)] == [0, 1]  # 2 holds no state
    assert store.bytes == 3 * 40 + 100 and store.states == 1
    b, c = [9, 9, 9, 9], [7, 7, 7, 7]
    assert store.add(b) == ([(3, 0)], []) and store.hold_state(b) == (3, [])
    assert store.bytes == 4 * 40 + 200 == store.capacity
    assert store.add(c) == ([(4, 0)], [2])  # the least recent leaf: a's third block
    assert store.hold_state(c) == (4, [1])  # then a's second, its state with it
    assert store.states == 2 and store.bytes == 3 * 40 + 200 and store.match(a, 12) == []  # (block 0: no state)


@pytest.mark.parametrize("layout", ["dense", "kernels"])
def test_slots_taken_out_of_a_row_and_put_into_another_are_the_same_keys_and_values(layout):
    from dense_engine.cpu import kernels

    if layout == "kernels" and not kernels.available():
        pytest.skip("no CPU kernels here")
    cache_class = caches.KVCache if layout == "dense" else caches.CPUKVCache
    cache = cache_class(3, 2, 63, 8, torch.float32, torch.device("cpu"))  # 3 rows, 2 heads, 63 slots + scratch
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    k, v = cache.slots(0, 16, 48)
    k, v = k.clone(), v.clone()
    before = cache.k.clone(), cache.v.clone()
    cache.put_slots(2, 16, k[:, :k.shape[1] // 2], v[:, :16])  # the first 16 slots
    cache.put_slots(2, 32, k[:, k.shape[1] // 2:], v[:, 16:])  # the next 16
    as_dense = (lambda t: t) if layout == "dense" else (lambda t: t.transpose(-1, -2).flatten(-3, -2))  # [.., S, D]
    keys, before_keys = as_dense(cache.k), as_dense(before[0])
    assert torch.equal(keys[2, :, 16:48], before_keys[0, :, 16:48]) and torch.equal(cache.v[2, :, 16:48],
                                                                                    before[1][0, :, 16:48])
    assert torch.equal(keys[2, :, :16], before_keys[2, :, :16]) and torch.equal(keys[2, :, 48:], before_keys[2, :, 48:])
    assert torch.equal(keys[:2], before_keys[:2]) and torch.equal(cache.v[:2], before[1][:2])  # other rows untouched


def conversations(vocab, k: int) -> list[dict]:
    topic = ["the sea and its fish, whales and boats", "mountains in winter, snow and skiing",
             "old trains and their stations"][k % 3]
    return [{"role": "system", "content": f"You are assistant number {k}. You talk about {topic}."},
            {"role": "user", "content": "hi"}]


def prefill_starts(monkeypatch) -> list[int]:
    """The slot each prefill call starts at, appended as the scheduler makes them."""
    from dense_engine.server import runner

    starts, healthy = [], runner.ModelCalls.call

    def counting(self, name, **args):
        if name == "prefill":
            starts.append(args["start"])
        return healthy(self, name, **args)

    monkeypatch.setattr(runner.ModelCalls, "call", counting)
    return starts


def greedy(prompt, n):
    from dense_engine.server import scheduler

    return scheduler.Request(prompt, n, SamplerSettings(), [], torch.Generator().manual_seed(0), lambda event: None)


@pytest.mark.parametrize("layout,compiled", [("kernels", False), ("kernels", True), ("dense", False), ("int8", False)])
def test_a_returning_conversation_whose_row_was_taken_prefills_only_what_the_store_lacks(monkeypatch, layout,
                                                                                          compiled):
    """Three conversations on two rows: each one's second turn finds its row taken by another, takes its first
    turn's blocks from the store (its prefill starts at the last whole block) and answers as a cold prefill does,
    on a model of its own. With room for only a few blocks, the same answers, the store within its bound, and the
    model calls' blocks always the store's."""
    from dense_engine.formats import load
    from dense_engine.formats import vocab as vocab_module
    from dense_engine.server.metrics import Metrics
    from dense_engine.server.scheduler import Scheduler, token_bytes

    if layout == "dense":
        monkeypatch.setattr(caches, "cache_for", lambda model, kv_dtype: (caches.KVCache, None))
    vocab = vocab_module.load_vocabulary(LLAMA, None)
    cold_model, model = load.from_pretrained(LLAMA), load.from_pretrained(LLAMA)
    record = LoadRecord(kv_dtype="int8" if layout == "int8" else "auto")  # (int8: the scales travel with the blocks)
    cold = Scheduler(cold_model, vocab, 2, 128, compile=compiled, reuse=False, load=record)
    prefilled = prefill_starts(monkeypatch)
    for capacity_blocks in (1000, 5):
        scheduler = Scheduler(model, vocab, 2, 128, compile=compiled, load=record)
        assert isinstance(model.layers[0].mixer.memory, caches.CPUKVCache) == (layout != "dense")
        assert isinstance(model.layers[0].mixer.memory, caches.CPUInt8KVCache) == (layout == "int8")
        scheduler.store = PrefixStore(capacity_blocks * 16 * token_bytes(model), token_bytes(model), block=16)
        scheduler.metrics = metrics = Metrics()
        metrics.watch(scheduler)
        firsts = {}
        for k in (1, 2, 3):
            prompt = vocab.encode(vocab.render(conversations(vocab, k)), special=False)
            firsts[k] = prompt, run_alone(scheduler, greedy(prompt, 4))
        for k in (1, 2, 3):
            prompt, reply = firsts[k]
            history = conversations(vocab, k) + [{"role": "assistant", "content": vocab.decode(reply)},
                                                 {"role": "user", "content": "ok"}]
            second = vocab.encode(vocab.render(history), special=False)
            prefilled.clear()
            answer = run_alone(scheduler, greedy(second, 8))
            if capacity_blocks == 1000:  # (its first turn's whole blocks came back: 64 of its ~70 tokens)
                assert prefilled[0] == len(prompt) // 16 * 16, (k, prefilled, len(prompt))
            assert answer == run_alone(cold, greedy(second, 8)), k
            assert set(scheduler.calls.kept) == {b.id for b in scheduler.store.index.values()}
            assert scheduler.store.bytes <= scheduler.store.capacity
        text = metrics.text()[0].decode()
        value = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line[:1] != "#"}
        assert value["dense_prefix_store_bytes"] == scheduler.store.bytes > 0
        assert value["dense_prefix_store_evictions_total"] == scheduler.store.evictions
        assert (scheduler.store.evictions > 0) == (capacity_blocks == 5)
        if capacity_blocks == 1000:
            assert value["dense_prefix_store_reused_tokens_total"] >= 3 * 32  # (past what their rows shared)
        scheduler.forget()
        assert scheduler.store.index == {} and scheduler.calls.kept == {}


# ---- the disk tier


@pytest.mark.parametrize("int8", [False, True])
def test_a_block_file_is_read_only_for_its_own_tokens_shapes_and_bytes(tmp_path, int8):
    from dense_engine.runtime.caches import write as write_block
    from dense_engine.server.prefix_store import read_block

    def layer():  # keys [K, blocks, D, 16] and values [K, slots, D] (int8: and their scales [K, slots])
        if int8:
            return (torch.randint(-127, 128, (2, 1, 8, 16), dtype=torch.int8),
                    torch.randint(-127, 128, (2, 16, 8), dtype=torch.int8), torch.rand(2, 16), torch.rand(2, 16))
        return torch.randn(2, 1, 8, 16), torch.randn(2, 16, 8)

    layers = [layer(), layer()]
    tokens = list(range(100, 116))
    path = str(tmp_path / "a" / "block.safetensors")
    write_block(path, tokens, layers)
    assert os.listdir(tmp_path / "a") == ["block.safetensors"]  # (no temporary file left)
    got = read_block(path, tokens, layers)
    assert len(got) == 2 and all(len(g) == len(w) and all(torch.equal(t, u) for t, u in zip(g, w))
                                 for g, w in zip(got, layers))
    assert read_block(path, tokens[:-1] + [0], layers) is None and os.path.exists(path)  # another prefix: not used
    other = [(torch.zeros(2, 1, 8, 16, dtype=torch.half), torch.zeros(2, 16, 8, dtype=torch.half))] * 2
    assert read_block(path, tokens, other) is None  # another cache's
    assert not os.path.exists(path)  # (deleted: written again when next used)
    write_block(path, tokens, layers)
    data = bytearray(Path(path).read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the last tensor
    Path(path).write_bytes(bytes(data))
    assert read_block(path, tokens, layers) is None and not os.path.exists(path)
    write_block(path, tokens, layers)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    assert read_block(path, tokens, layers) is None
    assert read_block(str(tmp_path / "missing.safetensors"), tokens, layers) is None


def test_the_models_key_changes_with_any_weight_the_caches_dtype_and_the_kernels(monkeypatch):
    from dense_engine.cpu import kernels
    from dense_engine.runtime.caches import model_key

    model = load_and_cache(LLAMA)
    key = model_key(model)
    assert model_key(load_and_cache(LLAMA)) == key  # the same weights: the same key
    assert model_key(load_and_cache(LLAMA, torch.bfloat16)) != key  # another cache dtype
    if kernels.available():  # another build of the kernels (an AVX2 one on this CPU): other roundings, another key
        monkeypatch.setitem(kernels._state, "key", "another build")
        assert model_key(model) != key
        monkeypatch.undo()
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    assert model_key(model) != key


def load_and_cache(path, cache_dtype=None):
    from dense_engine.formats import load

    model = load.from_pretrained(path)
    cache_class, dtype = caches.cache_for(model)
    model.setup_cache(1, 64, cache_dtype or dtype, cache_class=cache_class)
    return model


def test_a_prefix_used_twice_is_read_back_from_disk_after_a_restart_by_the_same_model_only(monkeypatch, tmp_path):
    """A conversation's second turn reuses its first: those blocks go to disk. A new scheduler on a freshly loaded
    model (a restart) takes them from disk for a third turn (its prefill starts past them) and answers as a cold
    prefill does; a model with one weight changed reads none of them. The files stay within their bound."""
    from dense_engine.formats import load
    from dense_engine.formats import vocab as vocab_module
    from dense_engine.server.scheduler import Scheduler

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    vocab = vocab_module.load_vocabulary(LLAMA, None)
    prefilled = prefill_starts(monkeypatch)

    first = vocab.encode(vocab.render(conversations(vocab, 1)), special=False)
    before = Scheduler(load.from_pretrained(LLAMA), vocab, 2, 128, compile=False, prefix_disk_mb=1, prefix_block=16)
    reply = run_alone(before, greedy(first, 4))
    history = conversations(vocab, 1) + [{"role": "assistant", "content": vocab.decode(reply)}]
    second = vocab.encode(vocab.render(history + [{"role": "user", "content": "ok"}]), special=False)
    run_alone(before, greedy(second, 4))  # (reuses the first turn's row: its blocks are written)
    before.disk.flush()
    folder = before.disk.folder
    files = os.listdir(folder)
    assert len(files) == len(first) // 16 and all(f.endswith(".safetensors") for f in files)

    third = vocab.encode(vocab.render(history + [{"role": "user", "content": "and the fish?"}]), special=False)
    after = Scheduler(load.from_pretrained(LLAMA), vocab, 2, 128, compile=False, prefix_disk_mb=1, prefix_block=16)
    prefilled.clear()
    answer = run_alone(after, greedy(third, 8))
    assert prefilled[0] == len(first) // 16 * 16  # every block on disk came back
    cold = Scheduler(load.from_pretrained(LLAMA), vocab, 2, 128, compile=False, reuse=False)
    assert answer == run_alone(cold, greedy(third, 8))

    changed = load.from_pretrained(LLAMA)
    with torch.no_grad():
        changed.layers[0].mixer.o_proj.weight[0, 0] += 1e-2
    other = Scheduler(changed, vocab, 2, 128, compile=False, prefix_disk_mb=1, prefix_block=16)
    prefilled.clear()
    run_alone(other, greedy(third, 2))
    assert prefilled[0] == 0 and other.disk.folder != folder

    tight = Scheduler(load.from_pretrained(LLAMA), vocab, 2, 128, compile=False, prefix_disk_mb=1, prefix_block=16)
    tight.disk.capacity = 2 * os.path.getsize(os.path.join(folder, files[0]))
    tight.disk.trim()
    assert len(os.listdir(folder)) == 2


# ---- llama-server's slot files, through a real server


def test_a_saved_slot_restored_after_a_restart_serves_its_prompt_without_prefilling_it(tmp_path):
    """POST /slots/0?action=save after a request, the server restarted, action=restore into another row: the next
    request with that prompt reuses the restored tokens (/metrics) and answers as the first server did; erase
    forgets them. Bad names, ids and actions are 400s in OpenAI's error shape; another model's file is refused;
    without --slot-save-path, 501."""
    from test_serve import Server

    folder = tmp_path / "slots"
    folder.mkdir()
    env = {"XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))}
    prompt = "tell me about the sea and its fish, whales and boats, and the people who sail on it every day"
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}

    def reused(server) -> float:
        text = server.get("/metrics")[1].decode()
        return next(float(line.split()[1]) for line in text.splitlines()
                    if line.startswith("dense_prefix_reused_tokens_total"))

    first = Server("--no-compile", "--max-batch", "2", "--slot-save-path", str(folder), "--prefix-cache-disk-mb", "0",
                   env=env)
    try:
        status, answer = first.request("POST", "/v1/completions", body)
        assert status == 200
        status, saved = first.request("POST", "/slots/0?action=save", {"filename": "sea.slot"})
        assert status == 200 and saved["id_slot"] == 0 and saved["n_saved"] > 20 and saved["filename"] == "sea.slot"
        assert saved["n_written"] == os.path.getsize(folder / "sea.slot")
        for path, payload, param in [("/slots/0?action=save", {"filename": "../x"}, "filename"),
                                     ("/slots/0?action=save", {"filename": "a/b"}, "filename"),
                                     ("/slots/0?action=save", {}, "filename"),
                                     ("/slots/9?action=save", {"filename": "x"}, "id_slot"),
                                     ("/slots/0?action=fly", {"filename": "x"}, "action"),
                                     ("/slots/1?action=restore", {"filename": "missing"}, "id_slot")]:
            status, error = first.request("POST", path, payload)
            assert status == 400 and error["error"]["param"] == param and error["error"]["type"], (path, error)
        assert sorted(os.listdir(folder)) == ["sea.slot"]
    finally:
        first.stop()

    second = Server("--no-compile", "--max-batch", "2", "--slot-save-path", str(folder), "--prefix-cache-disk-mb", "0",
                    env=env)
    try:
        status, restored = second.request("POST", "/slots/1?action=restore", {"filename": "sea.slot"})
        assert status == 200 and restored["n_restored"] == saved["n_saved"] and restored["id_slot"] == 1
        before = reused(second)
        status, again = second.request("POST", "/v1/completions", body)
        assert status == 200 and again["choices"][0]["text"] == answer["choices"][0]["text"]
        prompt_tokens = again["usage"]["prompt_tokens"]
        assert reused(second) - before == prompt_tokens - 1  # every prompt token but the last came from the file
        status, erased = second.request("POST", "/slots/1?action=erase", {})
        assert status == 200 and erased["n_erased"] >= prompt_tokens
    finally:
        second.stop()

    other = Server("--no-compile", "--max-batch", "2", "--slot-save-path", str(folder), "--prefix-cache-disk-mb", "0",
                   "--quant", "int8", env=env)  # (another model: the same checkpoint quantized)
    try:
        status, error = other.request("POST", "/slots/0?action=restore", {"filename": "sea.slot"})
        assert status == 400 and "another model" in error["error"]["message"]  # (its weights' key differs)
    finally:
        other.stop()
    plain = Server("--no-compile", "--max-batch", "1", "--prefix-cache-disk-mb", "0", env=env)
    try:
        status, error = plain.request("POST", "/slots/0?action=save", {"filename": "x"})
        assert status == 501 and "--slot-save-path" in error["error"]["message"]
    finally:
        plain.stop()


def test_a_slot_file_of_a_model_with_other_weights_is_refused(tmp_path):
    from dense_engine.formats import load
    from dense_engine.formats import vocab as vocab_module
    from dense_engine.server import slots
    from dense_engine.server.scheduler import Scheduler

    vocab = vocab_module.load_vocabulary(LLAMA, None)
    saver = Scheduler(load.from_pretrained(LLAMA), vocab, 1, 128, compile=False)
    run_alone(saver, greedy(list(range(5, 40)), 3))
    # (the prompt and the tokens fed back)
    assert slots.SlotFiles(saver).save(0, str(tmp_path / "s"))["n_saved"] == 35 + 2
    changed = load.from_pretrained(LLAMA)
    with torch.no_grad():
        changed.layers[1].mixer.qkv_proj.weight[0, 0] += 1e-3
    with pytest.raises(ValueError, match="another model"):
        slots.SlotFiles(Scheduler(changed, vocab, 1, 128, compile=False)).restore(0, str(tmp_path / "s"))
    same = Scheduler(load.from_pretrained(LLAMA), vocab, 1, 128, compile=False)
    assert slots.SlotFiles(same).restore(0, str(tmp_path / "s"))["n_restored"] == 37
    assert same.rows[0].tokens == saver.rows[0].tokens


def test_hostile_slot_requests_get_a_4xx_in_openais_shape_and_the_server_goes_on(tmp_path):
    """Generated ids, actions, names and bodies against /slots/{id} (a real scheduler on the fixture): a 200 or a 4xx
    with OpenAI's error body, never a 5xx; no file appears outside the slot folder; a plain save works after them."""
    import json
    import random
    import threading
    import types

    from starlette.testclient import TestClient

    from dense_engine.formats import load
    from dense_engine.formats import vocab as vocab_module
    from dense_engine.server import app
    from dense_engine.server.metrics import Metrics
    from dense_engine.server.scheduler import Scheduler

    vocab = vocab_module.load_vocabulary(LLAMA, None)
    scheduler = Scheduler(load.from_pretrained(LLAMA), vocab, 2, 128, compile=False)
    run_alone(scheduler, greedy(list(range(5, 30)), 2))
    folder = tmp_path / "slots"
    folder.mkdir()
    server = types.SimpleNamespace(vocab=vocab, max_seq_len=128, name="llama", scheduler=scheduler, error=None,
                                   ready=threading.Event(), metrics=Metrics(),
                                   args=types.SimpleNamespace(api_key=None, max_queue=64, cors_origin=None,
                                                              max_body_mb=1, slot_save_path=str(folder)))
    server.ready.set()
    scheduler.thread.start()
    rng = random.Random(0)
    names = ["a", "../a", "/etc/passwd", "a/b", "..", ".", ".hidden", "", "x" * 300, "a\\b", "a\x00b", 5, None, [],
             {"x": 1}, "ok.slot", "\ud800"]
    try:
        with TestClient(app.make_app(server), raise_server_exceptions=False) as client:
            for _ in range(200):
                row = rng.choice(["0", "1", "2", "-1", "x", "99999999999999999999", "0x1", " 1", "%20"])
                action = rng.choice(["save", "restore", "erase", "", "SAVE", "fly", None])
                sent = rng.choice([{"filename": rng.choice(names)}, {}, {"filename": "ok.slot", "extra": 1}])
                query = "" if action is None else f"?action={action}"
                data = json.dumps(sent).encode("utf-8", "surrogatepass")
                response = client.post(f"/slots/{row}{query}", content=data,
                                       headers={"Content-Type": "application/json"})
                assert response.status_code < 500, (row, action, sent, response.text)
                if response.status_code != 200:
                    error = response.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"} and error["message"]
            assert set(os.listdir(tmp_path)) == {"slots"} and set(os.listdir(folder)) <= {"ok.slot", "a"}
            held = len(scheduler.rows[0].tokens)  # (an erase among them may have emptied it)
            answer = client.post("/slots/0?action=save", json={"filename": "plain.slot"})
            assert answer.status_code == 200 and answer.json()["n_saved"] == held
            assert client.post("/slots/1?action=restore", json={"filename": "plain.slot"}).json()["n_restored"] == held
    finally:
        scheduler.stopping.set()
        scheduler.thread.join(timeout=10)


def test_n_choices_share_one_prefill(monkeypatch):
    """n choices of a prompt: the first prefills it, the others wait for it, copy its row's whole blocks and prefill
    only the rest (from slot 48 of a 60-token prompt); greedy choices all equal the prompt prefilled alone, sampled
    ones each follow their own noise as if prefilled alone."""
    from dense_engine.formats import load
    from dense_engine.formats import vocab as vocab_module
    from dense_engine.server.scheduler import Request, Scheduler

    vocab = vocab_module.load_vocabulary(LLAMA, None)
    prompt = torch.randint(3, 500, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    cold = Scheduler(load.from_pretrained(LLAMA), vocab, 4, 128, compile=False, reuse=False)

    def choices(scheduler, sampler, n=3):
        jobs = [Request(prompt, 6, sampler, [], torch.Generator().manual_seed(i), lambda event: None, index=i)
                for i in range(n)]
        for job in jobs[1:]:
            job.follows = jobs[0]
        for job in jobs:
            scheduler.submit(job)
        for _ in range(100):
            scheduler.safe_turn()
            if all(job.finish_reason for job in jobs):
                return [job.generated for job in jobs]
        raise AssertionError("the choices did not finish")

    prefilled = prefill_starts(monkeypatch)
    scheduler = Scheduler(load.from_pretrained(LLAMA), vocab, 4, 128, compile=False, reuse=False)
    greedy = choices(scheduler, SamplerSettings())
    assert sorted(prefilled) == [0, 48, 48] and greedy == [run_alone(cold, Request(
        prompt, 6, SamplerSettings(), [], torch.Generator(), lambda event: None)).copy()] * 3
    sampled = SamplerSettings(temperature=1.0)
    alone = [run_alone(cold, Request(prompt, 6, sampled, [], torch.Generator().manual_seed(i), lambda event: None))
             for i in range(3)]
    assert choices(scheduler, sampled) == alone and len({tuple(a) for a in alone}) > 1
