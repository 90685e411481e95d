"""Mixtures of experts (layer_kinds.Experts, formats/families/experts.py): tiny random models made with transformers
are the oracle for each family's router, experts and shared experts; each other path (the cached steps with rows
choosing different experts, a left-padded batch, the compiled step's gathered experts, speculative decoding) is
checked against the plain pass."""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import FIXTURES

import layer_kinds
from dense_engine.cpu import quantized
from dense_engine.formats import load
from dense_engine.runtime import generate, tp
from dense_engine.system.errors import CheckpointError

SMALL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
         "eos_token_id": 2}
CASES = {  # name: (transformers class, its config)
    "qwen3_moe": ("Qwen3MoeForCausalLM", transformers.Qwen3MoeConfig(
        **SMALL, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeForCausalLM", transformers.Qwen2MoeConfig(
        **SMALL, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=8, num_experts_per_tok=3)),
    "mixtral": ("MixtralForCausalLM", transformers.MixtralConfig(**SMALL, num_local_experts=6, num_experts_per_tok=2)),
    "olmoe": ("OlmoeForCausalLM", transformers.OlmoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2)),
    "glm4_moe": ("Glm4MoeForCausalLM", transformers.Glm4MoeConfig(
        **SMALL, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, use_qk_norm=True,
        attention_bias=True)),
    "gpt_oss": ("GptOssForCausalLM", transformers.GptOssConfig(
        **SMALL, num_local_experts=6, num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.5)),
}


def save_random(cls: str, config, seed: int, folder):
    """A transformers model of the class, its weights drawn with std 0.05 (biases, sinks and the choice bias 0.5: the
    router's choice turns on them; gpt-oss's clamp at 0.5 is reached), the norms as made, saved in folder."""
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(config).eval()
    with torch.no_grad():
        for key, t in [*model.named_parameters(), *model.named_buffers()]:
            if "bias" in key or "sinks" in key:
                t.normal_(0, 0.5)
            elif "norm" not in key and t.is_floating_point() and t.ndim > 1:
                t.normal_(0, 0.15 if "router" not in key and "gate.weight" not in key else 0.5)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{case: (folder, transformers model)}: a saved tiny random model and the fixture llama's tokenizer (512 tokens)
    beside it."""
    root, made = tmp_path_factory.mktemp("experts"), {}
    for i, (name, (cls, config)) in enumerate(CASES.items()):
        made[name] = (str(root / name), save_random(cls, config, 10 + i, root / name))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(FIXTURES, "llama", f), root / name)
    return made


def saved(root, cases: dict) -> dict:
    """{case: (folder, transformers model)} for cases {name: (class, config, seed)}, each saved by save_random under
    root."""
    return {name: (str(root / name.replace(" ", "_")), save_random(cls, config, seed, root / name.replace(" ", "_")))
            for name, (cls, config, seed) in cases.items()}


def loaded(folders: dict) -> dict:
    """{case: our float32 model of its folder}."""
    return {name: load.from_pretrained(folder, dtype=torch.float32) for name, (folder, _) in folders.items()}


@pytest.fixture(scope="module")
def models(folders):
    return loaded(folders)


def prompt(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def assert_transformers_logits_and_tokens(reference, model) -> None:
    """Our model's logits on a 2-row prompt within 1e-4 (of the largest) of transformers' reference's, and its greedy
    tokens (the cached path) equal, tokens that vary (the test can tell models apart)."""
    ids = prompt(40, batch=2)
    with torch.no_grad():
        want = reference(input_ids=ids).logits.float()
        want_tokens = reference.generate(ids[:1, :20], max_new_tokens=24, do_sample=False)[0, 20:].tolist()
        got = model(ids)
    assert (got - want).abs().max() / want.abs().max() < 1e-4
    tokens = generate.generate(model, ids[:1, :20], 24)[0, 20:].tolist()
    tokens = tokens[:tokens.index(2) + 1] if 2 in tokens else tokens  # (transformers stops at eos, 2)
    assert tokens == want_tokens and len(set(tokens)) > 3


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_equal_transformers(folders, models, case):
    assert_transformers_logits_and_tokens(folders[case][1], models[case])


def test_each_family_reads_into_the_router_and_experts_it_has(models):
    """What the readers chose, seen on the built models (so that a reader that ignored a key would be caught even if
    random weights hid it)."""
    kinds = {name: [type(layer.mlp).__name__ for layer in model.layers] for name, model in models.items()}
    assert kinds["qwen3_moe"] == ["Experts", "GatedMLP", "Experts"]  # (mlp_only_layers)
    assert kinds["glm4_moe"] == ["GatedMLP", "Experts", "Experts"]  # (first_k_dense_replace)
    spec = {name: model.config.extras["experts"] for name, model in models.items()}
    assert (spec["glm4_moe"].scoring, spec["glm4_moe"].groups, spec["glm4_moe"].routed_scale) == ("sigmoid", (4, 2),
                                                                                                   2.5)
    assert spec["qwen2_moe"].shared_gate and spec["qwen2_moe"].shared_width == 40 and not spec["qwen2_moe"].renormalize
    assert spec["gpt_oss"].activation == "clamped_swiglu" and spec["gpt_oss"].clamp == 0.5
    assert models["glm4_moe"].layers[1].mlp.shared.width == 24


@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_steps_gathered_experts_equal_each_expert_over_its_tokens(models, case):
    """Experts.gathered (fixed shapes: what a compiled step runs) and Experts.grouped (the eager pass) on the same
    tokens, and the router's choice as transformers' rule for each family: the same outputs."""
    layer = next(layer.mlp for layer in models[case].layers if isinstance(layer.mlp, layer_kinds.Experts))
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        weights, chosen = layer.route(x)
        gathered, grouped = layer.gathered(x, weights, chosen), layer.grouped(x, weights, chosen)
    assert chosen.unique().numel() > layer.spec.count // 2  # (many experts run, each for some tokens)
    assert (gathered - grouped).abs().max() <= 1e-5 * grouped.abs().max()
    if layer.spec.activation == "clamped_swiglu":  # the clamp is reached
        h = torch.einsum("nc,nkhc->nkh", x, layer.experts_gate_up[chosen]) + layer.experts_gate_up_bias[chosen]
        assert (h.abs() > layer.spec.clamp).float().mean() > 0.1


@pytest.mark.parametrize("case", ["qwen2_moe", "glm4_moe", "gpt_oss"])
def test_cached_steps_with_rows_choosing_different_experts_equal_the_plain_pass(models, case):
    """A prompt in chunks (padding to the scratch slot) on row 1 of 3 while rows 0 and 2 hold other sequences, then
    decode steps of all three rows at once (each row its own experts): the plain pass's logits."""
    model = models[case]
    S, chunk = 96, 16
    model.setup_cache(3, S)
    ids, others = prompt(45, seed=1), prompt(45, seed=2, batch=3)
    with torch.no_grad():
        want = model(ids)[0]
        model(others[:, :44], torch.arange(44))
        got = []
        for start in range(0, 37, chunk):
            n = min(chunk, 37 - start)
            pos = torch.cat([torch.arange(start, start + n), torch.full((chunk - n,), S)])
            piece = torch.cat([ids[:, start:start + n], torch.zeros(1, chunk - n, dtype=torch.long)], 1)
            got.append(model(piece, pos, rows=torch.tensor([1]))[0, :n])
        for t in range(37, 45):
            step = torch.stack([others[0, 44:45], ids[0, t:t + 1], others[2, 44:45]])
            out = model(step, torch.tensor([[44], [t], [44]]))
            got.append(out[1])
            alone = model(others[[0], :45])[0, -1]
            assert (out[0, 0] - alone).abs().max() < 1e-4  # (a neighbour row: its own experts)
    assert (torch.cat(got) - want).abs().max() < 1e-4


def test_a_left_padded_batch_equals_each_prompt_alone(models):
    model = models["qwen3_moe"]
    prompts = [prompt(9, seed=3)[0], prompt(30, seed=4)[0], prompt(17, seed=5)[0]]
    alone = [generate.generate(model, p[None], 12)[0, len(p):].tolist() for p in prompts]
    together = generate.generate(model, prompts, 12)
    assert [t.tolist() for t in together] == alone


def test_the_compiled_decode_step_equals_eager(models):
    model = models["glm4_moe"]  # (grouped top-k, a choice bias, shared experts, a dense first layer)
    ids = prompt(21, seed=9)
    eager = generate.generate(model, ids, 16)
    assert torch.equal(generate.generate(model, ids, 16, compile=True), eager)


@pytest.mark.parametrize("draft", ["lookup", "int4"])
def test_speculative_decoding_equals_plain_greedy(models, draft):
    from dense_engine.runtime import speculative

    model = models["mixtral"]
    ids = prompt(30, seed=11)
    ids = torch.cat([ids, ids[:, :12], ids[:, 5:20]], 1)  # (repeats: prompt lookup finds drafts)
    plain = generate.generate(model, ids, 32)[0, ids.shape[1]:].tolist()
    made = speculative.LookupDraft(3) if draft == "lookup" else speculative.ModelDraft(
        speculative.quantized_copy(model, draft))
    tokens = [t for step in speculative.generate_rounds(model, ids, 32, made, speculate_k=4) for t in step]
    assert tokens == plain


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_mixture_computes_what_its_weights_say(folders, models, mode):
    """--quant on a float mixture: the attention's linears in the mode; the router, the experts and the shared
    expert as stored (the experts' own blocks are the next step). Its logits: a plain float model's holding each
    quantized layer's dequantized weight, up to the activations' rounding (as tests/test_quantize.py)."""
    from test_quantize import quantized_reference, rel_err

    model = load.from_pretrained(folders["qwen2_moe"][0], dtype=torch.float32, quant=mode)
    layer = model.layers[0]
    assert isinstance(layer.mixer.qkv_proj, quantized.QuantLinear)
    assert not isinstance(layer.mlp.router, quantized.QuantLinear)
    assert not isinstance(layer.mlp.shared.gate_up_proj, quantized.QuantLinear)
    assert torch.equal(layer.mlp.experts_gate_up, models["qwen2_moe"].layers[0].mlp.experts_gate_up)
    ids = prompt(24, seed=6)
    with torch.no_grad():
        assert rel_err(model(ids), quantized_reference(model)(ids)) < 2e-3


def test_what_a_mixture_cannot_do_yet_is_refused_in_one_line(folders, models, tmp_path):
    config = models["mixtral"].config  # (tensor parallel: every expert split by its width; tests/test_tp.py)
    assert [s.experts for s in tp.plan(config, 1, 2)] == [(24, 48)] * 3
    odd = dataclasses.replace(config, extras={**config.extras, "experts": dataclasses.replace(
        config.extras["experts"], width=30)})
    with pytest.raises(CheckpointError, match="its experts' width 30 does not divide over 4 ranks"):
        tp.plan(odd, 0, 4)
    folder = tmp_path / "latent"
    shutil.copytree(folders["qwen3_moe"][0], folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "model_type": "deepseek_v3", "kv_lora_rank": 512}))
    with pytest.raises(CheckpointError, match="multi-head latent attention") as e:
        load.from_pretrained(str(folder))
    assert "\n" not in str(e.value)
    (folder / "config.json").write_text(json.dumps({**raw, "num_experts_per_tok": 9}))
    with pytest.raises(CheckpointError, match="num_experts_per_tok 9 is not supported \\(at most the 8 experts\\)"):
        load.from_pretrained(str(folder))


def test_an_adapter_on_a_mixtures_attention_gives_peft_models_logits(folders, tmp_path):
    """A PEFT LoRA adapter on the attention (q_proj, v_proj) of a mixture: the engine's merged weights give PEFT's
    logits and greedy tokens."""
    import peft

    folder, _ = folders["qwen3_moe"]
    torch.manual_seed(4)
    reference = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder),
                                    peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    reference.save_pretrained(tmp_path / "adapter")
    ids = prompt(30, seed=7)
    with torch.no_grad():
        want = reference.eval()(input_ids=ids).logits
        with reference.disable_adapter():
            plain = reference(input_ids=ids).logits
    model = load.from_pretrained(folder, dtype=torch.float32, lora=[(tmp_path / "adapter", 1.0)])
    with torch.no_grad():
        got = model(ids)
    assert (got - want).abs().max() / want.abs().max() < 1e-4 and (want - plain).abs().max() > 0.1


@pytest.mark.slow
def test_the_server_answers_a_mixture_as_generate_does(folders):
    """Through the official openai client: concurrent greedy completions on rows that choose different experts (more
    requests than rows), and a conversation's next turn from the prefix it shares, each equal to generate()."""
    from test_serve import Server, assert_served_as_generate

    folder, _ = folders["glm4_moe"]
    server = Server("--no-compile", "--max-batch", "3", ckpt=folder)
    try:
        assert_served_as_generate(server, folder, load.from_pretrained(folder, dtype=torch.float32))
    finally:
        server.stop()


@pytest.mark.parametrize("kind", ["fp8", "gptq", "awq"])
def test_a_prequantized_mixture_runs_the_weights_its_tensors_mean(folders, tmp_path, kind):
    """Folders that come quantized, every linear (each expert's too) packed as Qwen3-30B-A3B-FP8 (e4m3, a scale per
    128 x 128 block), GPTQ (4 bits, groups of 16) or AWQ (4 bits, groups of 16) store them, the router float: the
    logits of the folder holding, in float32, the weights those tensors mean (that folder: the transformers-exact path
    above). The experts run dequantized, for now."""
    from prequantized_makers_gptq import awq_config, gptq_config, pack_awq, pack_gptq
    from safetensors.torch import load_file, save_file
    from test_prequantized import fp8_blocks

    pack, scheme = {"fp8": (fp8_blocks, {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": [128, 128]}),
                    "gptq": (lambda w: pack_gptq(w, 4, 16, True, False), gptq_config(4, 16, True, False)),
                    "awq": (lambda w: pack_awq(w, 16), awq_config(16))}[kind]
    folder, _ = folders["qwen3_moe"]
    packed, meant = {}, {}
    for name, t in load_file(os.path.join(folder, "model.safetensors")).items():
        if name.endswith("proj.weight"):
            tensors, weight = pack(t)
            meant[name] = weight.contiguous()
            packed.update({f"{name[:-len('.weight')]}.{k}": v.contiguous() for k, v in tensors.items()})
        else:
            packed[name] = meant[name] = t
    raw = json.loads(Path(folder, "config.json").read_text())
    for name, tensors, config in (("packed", packed, {**raw, "quantization_config": scheme}), ("float", meant, raw)):
        os.makedirs(tmp_path / name)
        save_file(tensors, tmp_path / name / "model.safetensors")
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert sum(".experts." in n and n.endswith("proj.weight") for n in meant) == 2 * 8 * 3  # (each expert packed)
    ids = prompt(30, seed=8)
    with torch.no_grad():
        got = load.from_pretrained(str(tmp_path / "packed"), dtype=torch.float32)(ids)
        want = load.from_pretrained(str(tmp_path / "float"), dtype=torch.float32)(ids)
        plain = load.from_pretrained(folder, dtype=torch.float32)(ids)
    assert (got - want).abs().max() / want.abs().max() < 1e-5
    assert 0 < (plain - want).abs().max() / want.abs().max() < 0.5  # (the format rounds every weight: near, not equal)
