"""The families people run today, each a tiny random checkpoint written by transformers itself
(`AutoModelForCausalLM.from_config`, offline), read back from its Hugging Face folder in both config forms (transformers
5's rope_parameters / layer_types, and the Hub's rope_theta / rope_scaling / sliding_window_pattern), and compared with
transformers' own forward: logits over 48 positions (float32, relative error <= 1e-4) and greedy tokens. Windows and
caps are small enough that they matter (a window of 8 over 48 tokens, soft-caps that clip), and a test shows each
switch does: turning it off moves the logits."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import FIXTURES, ROOT, answer, rel_err

import layer_kinds
from dense_engine.cpu import quantized
from dense_engine.formats import checkpoint
from dense_engine.formats.load import from_pretrained
from dense_engine.runtime import caches, generate, speculative
from dense_engine.runtime.steps import Steps

transformers = pytest.importorskip("transformers")

BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(6)], "long_factor": [2.0 + 0.5 * i for i in range(6)]}
# case -> (model_type, config values, {switch: what turning it off sets in our config})
CASES = {
    "llama": ("llama", {"head_dim": 16}, {}),
    "llama3": ("llama", {"head_dim": 16, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}, {"rope_scaling": None}),
    "llama-linear": ("llama", {"head_dim": 16, "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                                   "factor": 4.0}}, {"rope_scaling": None}),
    "llama-dynamic": ("llama", {"head_dim": 16, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                    "factor": 4.0}}, {}),
    "llama-yarn": ("llama", {"head_dim": 16, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}},
        {"rope_scaling": None}),
    "qwen2": ("qwen2", {"use_sliding_window": False, "sliding_window": 8}, {"qkv_bias": False}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
                     {"sliding_window": None, "layer_types": None}),
    "qwen3": ("qwen3", {"head_dim": 16}, {"qk_norm": "none"}),
    "mistral": ("mistral", {"head_dim": 16, "sliding_window": 8}, {"sliding_window": None}),
    "gemma": ("gemma", {"head_dim": 16}, {"embed_scale": None}),
    "gemma2": ("gemma2", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
                          "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
               {"attn_softcap": None, "final_softcap": None, "sliding_window": None, "layer_types": None}),
    "gemma3": ("gemma3_text", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
                               "sliding_window_pattern": 2,
                               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                   "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                                      "factor": 8.0}}},
               {"rope_local_theta": None}),
    "phi3": ("phi3", {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 8,
                      "rope_parameters": LONGROPE}, {"rope_scaling": None}),
    "smollm3": ("smollm3", {"no_rope_layer_interval": 2}, {"nope_layers": None}),
    "granite": ("granite", {"embedding_multiplier": 3.0, "attention_multiplier": 0.2, "residual_multiplier": 0.5,
                            "logits_scaling": 4.0}, {"residual_scale": 1.0}),
    "olmo2": ("olmo2", {}, {"post_norms": False, "pre_norms": True}),
    "olmo3": ("olmo3", {"sliding_window": 8, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
        "full_attention": {"rope_type": "linear", "rope_theta": 5e5, "factor": 8.0}}}, {"rope_local_theta": None}),
    "stablelm": ("stablelm", {"qk_layernorm": True, "use_qkv_bias": True}, {"qk_norm": "none"}),
    "seed_oss": ("seed_oss", {"head_dim": 16}, {"qkv_bias": False}),
    "glm4": ("glm4", {"head_dim": 16}, {"rope_layout": "half"}),
    "cohere": ("cohere", {"logit_scale": 0.3}, {"parallel_residual": False}),
    # layer 0 full (base 1e4), then sliding layers: one without rope, two of base 5e5; learned sinks
    "granite_swa": ("granite_swa", {"head_dim": 16, "sliding_window": 8, "layer_rope_theta": [1e4, 0, 5e5, 5e5],
                                    "embedding_multiplier": 3.0, "attention_multiplier": 0.2,
                                    "residual_multiplier": 0.5, "logits_scaling": 4.0}, {"attn_sinks": False}),
    "cohere2": ("cohere2", {"head_dim": 16, "sliding_window": 8, "logit_scale": 0.3}, {"parallel_residual": False}),
    "ministral3": ("ministral3", {"head_dim": 16, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 96,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}},
        {"rope_scaling": None}),
    "exaone4": ("exaone4", {"head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 4}, {"nope_layers": None}),
    "exaone4-lllg": ("exaone4", {"head_dim": 16, "sliding_window": 8, "sliding_window_pattern": "LG", "layer_types": [
        "sliding_attention", "full_attention"] * 2}, {"sliding_window": None, "layer_types": None}),
    "stablelm-parallel": ("stablelm", {"qk_layernorm": True, "use_qkv_bias": True, "use_parallel_residual": True}, {}),
    "apertus": ("apertus", {"head_dim": 16, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 32,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0}}, {"mlp": "gelu"}),  # (xIELU, its parameters per layer)
    "hunyuan": ("hunyuan_v1_dense", {"head_dim": 16, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4,
                                                                         "alpha": 1000.0, "factor": 1.0}},
                {"qk_norm_after_rope": False}),  # (q/k norms after the rotary; the base stretched by alpha)
}
FAMILIES = ["llama3", "qwen2-window", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3", "smollm3", "granite",
            "olmo2", "stablelm", "glm4", "cohere2", "granite_swa"]  # one case per family for the fast paths (OLMo 3,
#   Seed-OSS, EXAONE 4 and Ministral 3 combine switches these cases run: Gemma 3's windows and local rope, Qwen2's
#   biases, SmolLM3's layers without rope, yarn)
IDS = torch.randint(3, 512, (2, 48), generator=torch.Generator().manual_seed(1))


def write_checkpoint(case: str, folder: str):
    """A tiny random model of the case's family saved by transformers, with weights large enough that every norm
    gain, bias and scale matters; returns the transformers model (float32, eager attention)."""
    model_type, values, _ = CASES[case]
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **values})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):  # Gemma stores gains as offsets from 1
                p.uniform_(-0.5, 0.5) if model_type.startswith("gemma") else p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1 if name.endswith("bias") else 0.15)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(FIXTURES, "llama", name), folder)
    return model


def hub_form(folder: str, target: str) -> None:
    """The same checkpoint with its config.json as the Hub's releases write it: rope_theta, rope_scaling,
    partial_rotary_factor and rope_local_base_freq at the top, no layer_types (sliding_window_pattern for Gemma 3)."""
    os.makedirs(target)
    for name in os.listdir(folder):
        if name != "config.json":
            os.symlink(os.path.join(folder, name), os.path.join(target, name))
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    rope = raw.pop("rope_parameters")
    if "full_attention" in rope and raw["model_type"] == "olmo3":  # the local layers: the global base, unscaled
        rope = rope["full_attention"]
    elif "full_attention" in rope:  # Gemma 3: the local layers' base beside the global one
        raw["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        raw["sliding_window_pattern"] = raw.pop("_sliding_window_pattern", 6)
        rope = rope["full_attention"]
    raw["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        raw["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    kind = rope.pop("rope_type")
    raw["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}  # the older "type" key
    raw.pop("layer_types", None)
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(raw, f)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{case: (folder, hub-form folder, transformers model)}, written once for the module."""
    root = tmp_path_factory.mktemp("families")
    made = {}
    for case in CASES:
        folder = str(root / case)
        model = write_checkpoint(case, folder)
        hub_form(folder, folder + "-hub")
        made[case] = (folder, folder + "-hub", model)
    return made


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("form", ["transformers5", "hub"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_equal_transformers(checkpoints, case, form):
    folder, hub, hf = checkpoints[case]
    model = from_pretrained(folder if form == "transformers5" else hub)
    want = reference(hf)
    assert rel_err(model(IDS), want) <= 1e-4
    model.setup_cache(2, min(128, model.config.max_position_embeddings))  # cached: a prefill, then a token at a time
    parts = [model(IDS[:, :30], input_pos=torch.arange(30))]
    parts += [model(IDS[:, p:p + 1], input_pos=torch.tensor([p])) for p in range(30, 48)]
    assert rel_err(torch.cat(parts, dim=1), want) <= 1e-4
    prompt = IDS[:1, :12]
    hf.generation_config.eos_token_id = None  # 20 tokens, whatever they are
    with torch.no_grad():
        greedy = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)[0, 12:]
    assert generate.generate(model, prompt, 20)[0, 12:].tolist() == greedy.tolist()


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][2]])
def test_each_switch_changes_the_logits(checkpoints, case):
    """The checks above would pass by accident if a switch did nothing on these inputs: turned off, it changes them."""
    folder, _, hf = checkpoints[case]
    model = from_pretrained(folder)
    off = layer_kinds.Decoder(checkpoint.replaced(model.config, **CASES[case][2]))
    state = model.state_dict()
    off.load_state_dict({k: v for k, v in state.items() if k in off.state_dict()}, strict=False)
    if CASES[case][2].get("qkv_bias") is False:  # the bias itself is what is switched off
        off = model
        for layer in off.layers:
            layer.mixer.qkv_proj.bias = None
    assert rel_err(off(IDS), reference(hf)) > 1e-3


def test_longrope_picks_its_factors_by_the_cache_length(checkpoints):
    """Phi-3's longrope: a cache longer than the original context (8 here) rotates every position with the long
    factors, as transformers does for a sequence that long (and llama.cpp for such a context); a cache within it, with
    the short ones, as transformers does for a sequence within it."""
    folder, _, hf = checkpoints["phi3"]
    model = from_pretrained(folder)
    long, short = model.rope_frequencies(128, "base")[0], model.rope_frequencies(8, "base")[0]
    assert not torch.equal(long, short)
    for cache, tokens in ((64, 40), (8, 8)):
        caches.setup_cache(model, 1, cache)
        ids = IDS[:1, :tokens]
        cached = model.logits(model.hidden_states(ids, torch.arange(tokens)))
        assert rel_err(cached, reference(hf, ids)) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("case", FAMILIES)
def test_fast_paths_give_the_plain_tokens(checkpoints, case, tmp_path, monkeypatch):
    """Per family: the CPU kernels' cache (window and soft-cap inside the attention kernel), compiled steps, a ragged
    batch and prompt-lookup drafts all give plain eager decoding's greedy tokens; int8 and int4 give the logits of
    the model whose weights are the quantized ones, dequantized."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder, _, _ = checkpoints[case]
    model = from_pretrained(folder)
    prompts = [IDS[0, :11].tolist(), IDS[1, :36].tolist()]  # (36 > generate.PREFILL_CHUNK: prefilled eagerly)
    want = []
    for p in prompts:  # the plain path: no cache, argmax of a full pass per token
        ids = torch.tensor([p])
        for _ in range(24):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
        want.append(ids[0, len(p):].tolist())
    steps = Steps(model)  # one step, decode, is compiled
    compiled = [int(t) for t in generate.generate_tokens(model, torch.tensor([prompts[1]]), 24, steps=steps)]
    assert compiled == want[1] and steps.compiled == 1
    assert [r.tolist() for r in generate.generate(model, prompts, 24)] == want  # ragged, left-padded batch
    drafted = speculative.generate(model, torch.tensor([prompts[1]]), 24, speculative.LookupDraft())
    assert drafted[0, 36:].tolist() == want[1]
    for mode in ("int8", "int4"):
        q = quantized.quantize_model(from_pretrained(folder), mode)
        plain = from_pretrained(folder)
        for name, layer in q.named_modules():  # (a tied head gets its own weight: the embedding stays as it is)
            if isinstance(layer, quantized.QuantLinear):
                plain.get_submodule(name).weight = torch.nn.Parameter(layer.dequantize(torch.float32))
        few = IDS[:, :6]  # up to 12 rows (int4's head is int8: longer prompts take bfloat16 GEMMs): the int8 kernel
        # on activations held to 1/32258 of each row's largest value; int4 at float32's precision
        assert rel_err(q(few), plain(few)) <= (1e-3 if mode == "int8" else 1e-4)


@pytest.mark.parametrize("edit, message", [
    ({"rope_scaling": {"rope_type": "su2", "factor": 2.0}}, "rope_scaling type 'su2' is not implemented"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "warp": 1}}, "key 'warp' is not implemented"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}}, "needs 'low_freq_factor'"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
    ({"attn_logit_softcapping": 30.0}, "config key 'attn_logit_softcapping' is not supported"),
    ({"sliding_window": 64}, "sliding_window 64 is not supported"),
    ({"attention_bias": True}, "attention_bias True is not supported"),
    ({"model_type": "jamba", "num_experts": 8}, "is a mixture of experts this engine does not read yet"),
    ({"model_type": "deepseek_v3", "n_routed_experts": 8, "kv_lora_rank": 512}, "multi-head latent attention"),
    ({"model_type": "falcon"}, "unknown model_type 'falcon'"),
])
def test_unsupported_variants_are_refused_in_one_line(checkpoints, tmp_path, edit, message):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints["llama"][0], folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(edit)
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(checkpoint.CheckpointError) as info:
        from_pretrained(str(folder))
    assert message in str(info.value) and "config.json" in str(info.value) and "\n" not in str(info.value)


def test_a_refusal_is_one_line_and_exit_2_from_chat(checkpoints, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints["gemma3"][0], folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["use_bidirectional_attention"] = True
    (folder / "config.json").write_text(json.dumps(raw))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", str(folder), "--prompt", "hi"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "use_bidirectional_attention" in result.stderr


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")


def test_a_template_without_a_system_role_gets_the_system_message_in_the_first_user_turn(checkpoints, tmp_path):
    """Gemma 2's own template refuses a system message; chat.py --system puts it before the first user message, says
    so once on stderr, and answers as the merged conversation renders (greedy: the same tokens as generate)."""
    from jinja2 import Template
    from tokenizers import Tokenizer

    folder = tmp_path / "gemma2"
    shutil.copytree(checkpoints["gemma2"][0], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = GEMMA_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", str(folder), "--prompt",
                             "hello there", "--system", "Be brief.", "--temperature", "0", "--max-new-tokens", "12",
                             "--no-compile"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("this chat template has no system role") == 1
    text = Template(GEMMA_TEMPLATE).render(messages=[{"role": "user", "content": "Be brief.\n\nhello there"}],
                                           add_generation_prompt=True, bos_token=config.get("bos_token") or "")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    model = from_pretrained(str(folder))
    out = generate.generate(model, torch.tensor([ids]), 12)[0, len(ids):].tolist()
    stops = {2, tok.token_to_id("<|im_end|>")}
    out = out[:next((i for i, t in enumerate(out) if t in stops), len(out))]
    assert result.stdout == answer(tok.decode(out, skip_special_tokens=True))


def test_the_mistral3_image_text_folder_is_its_text_model(tmp_path, capsys):
    """Mistral 3's image-text folder (Ministral 3 inside Mistral3ForConditionalGeneration, as the Hub ships it): the
    text model's logits equal transformers' (the vision tower skipped with a note), and the context stops where
    Ministral 3 would start scaling its queries (llama_4_scaling_beta)."""
    _, values, _ = CASES["ministral3"]
    text = transformers.AutoConfig.for_model("ministral3", **{**BASE, **values})
    vision = transformers.AutoConfig.for_model("pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=32, patch_size=16, head_dim=16)
    config = transformers.AutoConfig.for_model("mistral3", text_config=text.to_dict(), vision_config=vision.to_dict())
    torch.manual_seed(0)
    hf = transformers.Mistral3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name and name.endswith("weight") else p.normal_(0, 0.15)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(str(tmp_path))
    assert "vision tower" in capsys.readouterr().err
    assert model.config.max_position_embeddings == 96
    assert rel_err(model(IDS), reference(hf)) <= 1e-4


def test_command_r_plus_per_head_qk_norms_are_refused(tmp_path):
    write_checkpoint("cohere", str(tmp_path))
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**raw, "use_qk_norm": True}, f)
    with pytest.raises(checkpoint.CheckpointError, match="use_qk_norm True is not supported .Command R.'s per-head"):
        from_pretrained(str(tmp_path))


def assert_a_pruned_head_as_transformers(model, hf, rows: int) -> None:
    """A head of `rows` ids out of 512: transformers' logits over them, -1e30 past them, its greedy tokens."""
    assert model.lm_head.weight.shape[0] == rows and model.config.vocab_size == 512
    got, want = model(IDS), reference(hf)
    assert rel_err(got[..., :rows], want) <= 1e-4 and bool((got[..., rows:] == -1e30).all())
    prompt = IDS[:1, :12]
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        greedy = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 12:]
    assert generate.generate(model, prompt, 12)[0, 12:].tolist() == greedy.tolist()


def test_apertus_1p5s_pruned_head_gives_the_first_ids_only(tmp_path):
    """Apertus 1.5's text model (apertus1p5_text): Apertus with an LM head pruned to output_vocab_size rows (the
    multimodal ids cut): its logits equal transformers' over those ids, the ids past them never come out."""
    rope = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 32,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = transformers.AutoConfig.for_model("apertus1p5_text", **{**BASE, "head_dim": 16, "rope_parameters": rope,
                                                                   "output_vocab_size": 400})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name and name.endswith("weight") else p.normal_(0, 0.15)
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(FIXTURES, "llama", name), tmp_path)
    model = from_pretrained(str(tmp_path))
    assert_a_pruned_head_as_transformers(model, hf, 400)


def test_apertus_1p5s_image_text_folder_is_its_text_model(tmp_path, capsys):
    """The Hub's Apertus 1.5 folder (apertus1p5: the text model under model.language_model, the head beside it,
    pruned; vision and audio tokenizers that turn images and sounds into ids of the one vocabulary): the text model
    read, the tokenizers skipped with one note; transformers' logits of a text prompt, its greedy tokens."""
    text = {**BASE, "head_dim": 16, "output_vocab_size": 384, "max_position_embeddings": 256,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    config = transformers.Apertus1p5Config(
        text_config=text, image_token_offset=384, audio_token_offset=448, image_token_id=300, audio_token_id=301,
        vision_config={"codebook_size": 64, "embed_dim": 8, "latent_channels": 32, "base_channels": 32,
                       "channel_multiplier": [1, 1], "num_res_blocks": 1, "attn_resolutions": [], "resolution": 16},
        audio_config={"model_type": "wavtokenizer_encoder", "codebook_size": 64})
    torch.manual_seed(0)
    hf = transformers.Apertus1p5ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.startswith(("model.language_model.", "lm_head.")):
                p.uniform_(0.5, 1.5) if "norm" in name and name.endswith("weight") else p.normal_(0, 0.15)
    hf.save_pretrained(tmp_path)
    capsys.readouterr()
    model = from_pretrained(str(tmp_path))
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 1 and "the vision tokenizer and the audio tokenizer are not loaded" in notes[0]
    assert_a_pruned_head_as_transformers(model, hf, 384)
