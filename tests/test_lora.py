"""LoRA adapters (dense_engine/formats/lora.py) merged into a folder's weights as they load, against PEFT's own model
on the same weights: unmerged (PEFT's base plus its low-rank term) and merged (merge_and_unload)."""

import json
import os
import shutil
import subprocess
import sys
import threading

import peft
import pytest
import torch
import transformers
from conftest import ROOT
from test_prequantized import ids, random_llama

from dense_engine.formats import load
from dense_engine.runtime import generate
from dense_engine.system.errors import CheckpointError, UsageError

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(base: str, folder, seed: int, **config) -> peft.PeftModel:
    """A PEFT LoRA adapter of base (B drawn with std 0.05: PEFT starts B at zero, a no-op), saved in folder."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(base),
                                peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_base")
    random_llama(folder, seed=3)
    return str(folder)


def engine_logits(base: str, lora, **kw) -> torch.Tensor:
    model = load.from_pretrained(base, dtype=torch.float32, lora=lora, **kw)
    with torch.no_grad():
        return model(ids())


@pytest.mark.parametrize("config", [{}, {"use_rslora": True}, {"rank_pattern": {"down_proj": 2},
                                                                 "alpha_pattern": {"q_proj": 16},
                                                                 "target_modules": ["q_proj", "v_proj", "down_proj"]}])
def test_an_adapter_gives_peft_models_logits_and_tokens(base, tmp_path, config):
    """PEFT's model (the base and its low-rank term, unmerged) and its merge_and_unload: the engine's merged weights
    give both one's logits within 1e-5 and its greedy tokens; rsLoRA's alpha / sqrt(r), a rank and alpha per module,
    a subset of the targets, honored."""
    reference = save_adapter(base, tmp_path / "adapter", seed=1, **config)
    with torch.no_grad():
        want = reference(input_ids=ids()).logits
        plain = transformers.LlamaForCausalLM.from_pretrained(base)(input_ids=ids()).logits
        tokens = reference.generate(input_ids=ids()[:, :12], max_new_tokens=16, do_sample=False,
                                    eos_token_id=None)[0, 12:].tolist()
    got = engine_logits(base, [(tmp_path / "adapter", 1.0)])
    assert (got - want).abs().max() < 1e-5 and (want - plain).abs().max() > 0.1  # (the adapter changes the model)
    with torch.no_grad():
        merged = reference.merge_and_unload()(input_ids=ids()).logits
    assert (got - merged).abs().max() < 1e-5
    model = load.from_pretrained(base, dtype=torch.float32, lora=[(tmp_path / "adapter", 1.0)])
    assert generate.generate(model, ids()[:, :12], 16)[0, 12:].tolist() == tokens


def test_a_scale_and_two_adapters_are_peft_s_scaled_and_stacked_adapters(base, tmp_path):
    """DIR:SCALE multiplies an adapter's term (PEFT's scaling times SCALE); two adapters add both terms (PEFT: the
    first merged into the base, the second on top)."""
    first = save_adapter(base, tmp_path / "a", seed=1)
    save_adapter(base, tmp_path / "b", seed=2, r=8, lora_alpha=4, target_modules=["q_proj", "up_proj"])
    for module in first.modules():
        if hasattr(module, "scaling") and isinstance(module.scaling, dict) and "default" in module.scaling:
            module.scaling["default"] *= 0.5
    with torch.no_grad():
        want = first(input_ids=ids()).logits
    assert (engine_logits(base, [(tmp_path / "a", 0.5)]) - want).abs().max() < 1e-5
    stacked = peft.PeftModel.from_pretrained(
        peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base),
                                       tmp_path / "a").merge_and_unload(), tmp_path / "b").eval()
    with torch.no_grad():
        want = stacked(input_ids=ids()).logits
    assert (engine_logits(base, [(tmp_path / "a", 1.0), (tmp_path / "b", 1.0)]) - want).abs().max() < 1e-5


def test_an_adapter_that_does_not_fit_or_cannot_be_merged_is_refused_in_one_line(base, tmp_path):
    save_adapter(base, tmp_path / "adapter", seed=1)
    other = tmp_path / "other"  # a base of another width: the adapter's B @ A is not its weights' shape
    torch.manual_seed(0)
    wide = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256))
    wide.save_pretrained(other)
    cases = [(str(other), [(tmp_path / "adapter", 1.0)], {}, CheckpointError,
              r"q_proj\.weight is \[64, 64\] in the model, the adapter's B @ A \[128, 128\]"),
             (base, [(tmp_path / "nothing", 1.0)], {}, UsageError, r"no adapter_config\.json")]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    for key, value in (("use_dora", True), ("modules_to_save", ["lm_head"]), ("bias", "all")):
        changed = tmp_path / key
        shutil.copytree(tmp_path / "adapter", changed)
        (changed / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        cases.append((base, [(changed, 1.0)], {}, CheckpointError,
                      rf"adapter_config\.json: {key} .* is not supported"))
    for folder, lora, kw, error, message in cases:
        with pytest.raises(error, match=message) as e:
            load.from_pretrained(folder, lora=lora, **kw)
        assert "\n" not in str(e.value)
    gguf = os.path.join(ROOT, "tests", "fixtures", "converted_gguf", "command-r.gguf")  # (another model, as a GGUF)
    with pytest.raises(CheckpointError, match=r"q_proj\.weight is \[64, 64\] in the model") as e:
        load.from_pretrained(gguf, lora=[(tmp_path / "adapter", 1.0)])
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_chat_py_answers_with_an_adapter_as_the_api_does(base, tmp_path):
    """chat.py --lora DIR:SCALE (a one-shot, background compiles on as users run it): the greedy text of
    dense_engine.load(..., lora=[...]); without the flag, another text."""
    import dense_engine

    save_adapter(base, tmp_path / "adapter", seed=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(base, name))
    llm = dense_engine.load(base, lora=[f"{tmp_path / 'adapter'}:0.8"], compile=False)
    want = llm.generate("the cat sat on", max_new_tokens=12, temperature=0.0, chat=False)

    def chat(*flags):
        result = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", base, "--complete",
                                 "--prompt", "the cat sat on", "--max-new-tokens", "12", "--temperature", "0",
                                 *flags], capture_output=True, text=True, cwd=ROOT, check=False)
        assert result.returncode == 0, result.stderr
        return result.stdout.rstrip("\n")

    assert chat("--lora", f"{tmp_path / 'adapter'}:0.8") == want != chat()


def dequantized_peft_model(model, base: str, adapter) -> peft.PeftModel:
    """PEFT's model of the adapter on a transformers Llama holding the engine's quantized layers' dequantized weights
    (q | k | v and gate | up split back by rows): the oracle of an adapter beside quantized weights."""
    reference = transformers.LlamaForCausalLM.from_pretrained(base)

    def weight(layer) -> torch.Tensor:  # (a LowRank's base, or the layer; a float one's weight: a folder's head)
        layer = getattr(layer, "base", layer)
        return layer.dequantize(torch.float32) if hasattr(layer, "dequantize") else layer.weight.float()

    with torch.no_grad():
        for layer, theirs in zip(model.layers, reference.model.layers):
            q, k, v = weight(layer.mixer.qkv_proj).split([128, 64, 64])
            gate, up = weight(layer.mlp.gate_up_proj).split([256, 256])
            weights = {"self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v, "mlp.gate_proj": gate,
                       "mlp.up_proj": up, "self_attn.o_proj": weight(layer.mixer.o_proj),
                       "mlp.down_proj": weight(layer.mlp.down_proj)}
            for name, w in weights.items():
                theirs.get_submodule(name).weight.copy_(w)
        reference.lm_head.weight.copy_(weight(model.lm_head))
    return peft.PeftModel.from_pretrained(reference, adapter).eval()


@pytest.mark.parametrize("mode", ["int8", "int4", "nf4"])
def test_an_adapter_beside_quantized_weights_keeps_the_base_as_stored(base, tmp_path, mode):
    """A quantized load keeps the base quantized as without the adapter (the same stored tensors) and adds the
    adapter's term unmerged beside each layer (lora.LowRank: q, k and v's terms side by side in the fused layer):
    PEFT's logits on the dequantized base within the kernels' precision (x in 8-bit digits for int8 / nf4); the
    compiled step's tokens those of the eager one."""
    from test_quantize import rel_err

    save_adapter(base, tmp_path / "adapter", seed=1, rank_pattern={"down_proj": 2},
                 target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    model = load.from_pretrained(base, dtype=torch.float32, quant=mode, lora=[(tmp_path / "adapter", 1.0)])
    plain = load.from_pretrained(base, dtype=torch.float32, quant=mode)
    assert type(model.layers[0].mixer.qkv_proj).__name__ == "LowRank"
    assert torch.equal(model.layers[0].mixer.qkv_proj.base.dequantize(torch.float32),
                       plain.layers[0].mixer.qkv_proj.dequantize(torch.float32))
    reference = dequantized_peft_model(model, base, tmp_path / "adapter")
    with torch.no_grad():
        got, want = model(ids()), reference(input_ids=ids()).logits
        assert rel_err(got, want) < 1e-3 and rel_err(plain(ids()), want) > 1e-2
    eager = generate.generate(model, ids()[:, :12], 12)
    assert torch.equal(generate.generate(model, ids()[:, :12], 12, compile=True), eager)


def test_an_adapter_on_a_weight_the_family_splits_merges_only(tmp_path):
    """Phi-3's q | k | v is one tensor in its folder, split as it loads: an adapter on it merges into full-precision
    weights (PEFT's logits), and beside quantized weights it is refused in one line."""
    torch.manual_seed(0)
    phi = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0))
    phi.save_pretrained(tmp_path / "phi")
    adapter = peft.get_peft_model(phi, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj"]))
    with torch.no_grad():
        for name, p in adapter.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    adapter.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        want = adapter.eval()(input_ids=ids()).logits
    assert (engine_logits(str(tmp_path / "phi"), [(tmp_path / "adapter", 1.0)]) - want).abs().max() < 1e-5
    with pytest.raises(UsageError, match="--lora with int8 weights: this family changes some adapted weights") as e:
        load.plan(str(tmp_path / "phi"), quant="int8", lora=[(tmp_path / "adapter", 1.0)])
    assert "\n" not in str(e.value)


def test_an_adapter_on_a_gptq_folder_keeps_its_int4_numbers(tmp_path):
    """A GPTQ folder (4 bits, in order) with an adapter: int4-g32 holding the stored numbers to the bit, the adapter
    beside it; PEFT's logits on the dequantized base within the int4 kernel's precision."""
    from prequantized_makers_gptq import gptq_config, pack_gptq
    from test_prequantized import packed_folder
    from test_quantize import rel_err

    folder, reference = packed_folder(tmp_path, lambda w: pack_gptq(w, 4, 128, False, False, 1),
                                      gptq_config(4, 128, False, False, 1))
    save_adapter(str(tmp_path / "base"), tmp_path / "adapter", seed=1)
    record, checkpoint = load.plan(folder, lora=[(tmp_path / "adapter", 1.0)])
    assert record.quant == "int4" and len(checkpoint.exact) == 14
    model = load.from_pretrained(checkpoint, dtype=torch.float32, quant=record.quant)
    assert torch.equal(model.layers[0].mixer.qkv_proj.base.dequantize(torch.float32)[:128],
                       reference.model.layers[0].self_attn.q_proj.weight)
    with torch.no_grad():
        want = dequantized_peft_model(model, str(tmp_path / "base"), tmp_path / "adapter")(input_ids=ids()).logits
        assert rel_err(model(ids()), want) < 1e-3


GGUF = os.path.join(ROOT, "tests", "fixtures", "converted_gguf")


@pytest.mark.parametrize("base, key", [("lora-base.gguf", "logits"), ("lora-base-q8_0.gguf", "logits_q8_0")])
def test_a_llama_cpp_adapter_on_a_gguf_base_gives_llama_cpps_logits(base, key):
    """llama.cpp's own files (tests/converted_gguf_reference.py --only lora): a Llama base converted to GGUF and its
    PEFT adapter converted by convert_lora_to_gguf.py (turned q/k rows in B too). On the f16 base (float weights: the
    adapter merged) llama.cpp's logits within 1e-3 of their largest; on the Q8_0 base the blocks stay as stored with
    the adapter beside them, within what llama.cpp's 8-bit activations move its own logits here (2e-2). The PEFT folder
    it came from gives the same model on the same base; without an adapter the logits are far away."""
    import json

    with open(os.path.join(GGUF, "lora.json")) as f:
        reference = json.load(f)
    ids, want = torch.tensor([reference["ids"]]), torch.tensor(reference[key])
    path = os.path.join(GGUF, base)
    got = {}
    for adapter in ("lora-adapter.gguf", "lora-peft"):
        record, checkpoint = load.plan(path, lora=[(os.path.join(GGUF, adapter), 1.0)])
        model = load.from_pretrained(checkpoint, dtype=torch.float32, quant=record.quant)
        kind = type(getattr(model.layers[0].mixer.qkv_proj, "base", None)).__name__
        assert (record.quant, kind) == (("gguf", "GGUFLinear") if key.endswith("q8_0") else (None, "NoneType"))
        with torch.no_grad():
            got[adapter] = model(ids)[0]
    tolerance = 2e-2 if key.endswith("q8_0") else 1e-3
    assert (got["lora-adapter.gguf"] - want).abs().max() < tolerance * want.abs().max()
    assert (got["lora-peft"] - got["lora-adapter.gguf"]).abs().max() < 1e-5
    with torch.no_grad():
        alone = load.from_pretrained(path, dtype=torch.float32)(ids)[0]
    assert (alone - want).abs().max() > 0.2 * want.abs().max()


def test_a_llama_cpp_adapter_on_a_folder_is_refused_in_one_line(base):
    with pytest.raises(CheckpointError, match="a llama.cpp adapter applies to a GGUF base") as e:
        load.from_pretrained(base, lora=[(os.path.join(GGUF, "lora-adapter.gguf"), 1.0)])
    assert "\n" not in str(e.value)


def test_lora_flags_read_a_scale_and_a_name(base, tmp_path):
    """--lora [NAME=]PATH[:SCALE]: a suffix that is not a number is the path's, and so is a NAME= of a path that
    exists; a name only serve.py serves (per request): chat.py refuses it in one line saying what applies an adapter
    to every answer."""
    from dense_engine.formats import lora

    save_adapter(base, tmp_path / "adapter", seed=1)
    assert lora.parse(f"{tmp_path / 'adapter'}:0.5") == (str(tmp_path / "adapter"), 0.5, "")
    assert lora.parse("/x:y") == ("/x:y", 1.0, "")
    assert lora.parse(f"sql={tmp_path / 'adapter'}:0.5") == (str(tmp_path / "adapter"), 0.5, "sql")
    os.makedirs(tmp_path / "a=b")
    assert lora.parse(str(tmp_path / "a=b")) == (str(tmp_path / "a=b"), 1.0, "")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", base, "--prompt", "hi",
                             "--lora", f"sql={tmp_path / 'adapter'}"], capture_output=True, text=True, cwd=ROOT,
                            check=False)
    assert result.returncode != 0 and result.stderr.count("\n") == 1
    assert "has no requests to pick an adapter by name (serve.py serves them)" in result.stderr


@pytest.mark.parametrize("quant", [None, "int8"])
def test_adapters_by_name_switch_per_row_as_each_alone(base, tmp_path, quant):
    """Adapters loaded by name stay beside the weights; rows of one batch with another adapter each (one at half
    its scale, one with none) give the logits of the base with that adapter alone: merged (full precision, 1e-5)
    or beside the same int8 weights (equal)."""
    from dense_engine.formats import lora

    save_adapter(base, tmp_path / "a", seed=1)
    save_adapter(base, tmp_path / "b", seed=2)
    served = load.from_pretrained(base, dtype=torch.float32, quant=quant,
                                  lora=[(str(tmp_path / "a"), 1.0, "a"), (str(tmp_path / "b"), 0.5, "b")])
    assert len(lora.switches(served)) == 4 * 2  # (qkv, o, gate-up, down of 2 layers: their weights unmerged)
    lora.size_switch(served, 3)
    lora.switch(lora.switches(served), [(1.0, 0.0), (), (0.0, 0.5)])
    with torch.no_grad():
        got = served(torch.cat([ids()] * 3))
        for b, adapters in enumerate([[(str(tmp_path / "a"), 1.0)], [], [(str(tmp_path / "b"), 0.5)]]):
            want = engine_logits(base, adapters, quant=quant)[0]
            assert (got[b] - want).abs().max() <= (1e-5 * want.abs().max() if quant is None else 0)
    assert (engine_logits(base, [(str(tmp_path / "a"), 1.0)])[0] - got[1]).abs().max() > 0.1


@pytest.mark.slow
def test_a_server_serves_adapters_by_name_side_by_side_as_each_alone(base, tmp_path):
    """serve.py --lora sql=DIR --lora chat=DIR:0.5, through the openai client: a request naming an adapter as its
    model (vLLM's way), or picking it by llama-server's `lora` field, gets the greedy text of the base with that
    adapter merged (dense_engine.load); side by side with the others in one batch, each its text alone; no adapter,
    the base's. /v1/models and /lora-adapters list them; a bad `lora` is a 400 naming it."""
    from test_serve import Server

    import dense_engine

    openai = pytest.importorskip("openai")

    save_adapter(base, tmp_path / "a", seed=1)
    save_adapter(base, tmp_path / "b", seed=2)
    prompt = "the cat sat on"
    want = {name: dense_engine.load(base, lora=adapters, compile=False).generate(
        prompt, max_new_tokens=12, temperature=0.0, chat=False)
        for name, adapters in [("sql", [str(tmp_path / "a")]), ("chat", [f"{tmp_path / 'b'}:0.5"]), ("base", [])]}
    assert len(set(want.values())) == 3
    server = Server("--max-batch", "4", "--lora", f"sql={tmp_path / 'a'}", "--lora", f"chat={tmp_path / 'b'}:0.5",
                    ckpt=base)
    try:
        client = server.client()

        def complete(model, **extra):
            return client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                             extra_body=extra or None).choices[0].text

        alone = {name: complete(name) for name in ("sql", "chat", "base")}
        assert alone == want
        together = {}
        workers = [threading.Thread(target=lambda name=name: together.update({name: complete(name)}))
                   for name in [*alone] * 2]  # (six requests, four rows: a batch of every adapter, then more)
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert together == want
        assert complete("base", lora=[{"id": 1, "scale": 0.5}]) == want["chat"]
        assert complete("sql", lora=[]) == want["base"]  # (the field says which: none)
        assert [m.id for m in client.models.list().data] == [os.path.basename(base), "sql", "chat"]
        status, listed = server.get("/lora-adapters")
        assert status == 200 and [(a["id"], a["name"], a["scale"]) for a in json.loads(listed)] == [
            (0, "sql", 1.0), (1, "chat", 0.5)]
        with pytest.raises(openai.BadRequestError, match=r"lora\[0\]\.id must be the id of an adapter") as e:
            complete("base", lora=[{"id": 2}])
        assert e.value.body["param"] == "lora[0].id"
    finally:
        assert server.stop() == 0
