"""Checkpoints that come quantized (dense_engine/formats/prequantized.py), each made by its own tool where that tool
runs on a CPU: bitsandbytes through transformers (nf4, fp4, int8), compressed-tensors' own compressor, GPTQ and AWQ
packed as their libraries pack (tests/prequantized_makers_gptq.py). The oracle: the format's own model where it runs
here, else a float32 transformers model holding the weights the format's own decompression gives."""

import json
import os
import shutil

import pytest
import torch
import transformers
from conftest import FIXTURES
from prequantized_makers_gptq import awq_config, gptq_config, pack_awq, pack_gptq
from safetensors.torch import load_file, save_file

from dense_engine.formats import load
from dense_engine.system.errors import CheckpointError

LLAMA = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "eos_token_id": 2,
         "tie_word_embeddings": False}


def random_llama(folder, seed: int = 0) -> transformers.LlamaForCausalLM:
    """A tiny random Llama (weights of std 0.05, the norms as made) saved in folder with the fixture's tokenizer."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.05)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(FIXTURES, "llama", name), folder)
    return model


def with_weights(model: transformers.LlamaForCausalLM, weights: dict) -> transformers.LlamaForCausalLM:
    """model with each named linear's weight replaced (float32), the oracle for a format's dequantized numbers."""
    with torch.no_grad():
        for name, w in weights.items():
            model.get_submodule(name).weight.copy_(w.float())
    return model


def packed_folder(tmp_path, pack, config: dict) -> tuple[str, transformers.LlamaForCausalLM]:
    """A random Llama's linears packed by pack(weight) -> (tensors, the weight they mean), saved beside the rest with
    config as quantization_config (each tensor under the linear's name, as GPTQModel, AutoAWQ and Qwen3-FP8's folders
    hold them); and the float32 oracle holding the weights the tensors mean."""
    base = random_llama(tmp_path / "base")
    stored, weights = {}, {}
    for name, t in load_file(os.path.join(tmp_path / "base", "model.safetensors")).items():
        if name.endswith("proj.weight"):
            tensors, weights[name[:-len(".weight")]] = pack(t)
            stored.update({f"{name[:-len('.weight')]}.{k}": v.contiguous() for k, v in tensors.items()})
        else:
            stored[name] = t
    folder = tmp_path / "packed"
    shutil.copytree(tmp_path / "base", folder)
    save_file(stored, os.path.join(folder, "model.safetensors"))
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    return str(folder), with_weights(base, weights)


def ids(n: int = 40) -> torch.Tensor:
    return torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(0))


def logits_error(folder: str, reference, quant=None) -> float:
    model = load.from_pretrained(folder, dtype=torch.float32, quant=quant)
    with torch.no_grad():
        return float((model(ids()) - reference(input_ids=ids()).logits.float()).abs().max())


# ---------------------------------------------------------------------------------------------------------------
# bitsandbytes


@pytest.fixture(scope="module")
def bnb_folders(tmp_path_factory):
    """{kind: folder} saved by transformers with bitsandbytes on the CPU (nf4, fp4, int8), from one random Llama."""
    base = tmp_path_factory.mktemp("bnb_base")
    random_llama(base)
    made = {}
    for kind in ("nf4", "fp4", "int8"):
        config = transformers.BitsAndBytesConfig(load_in_4bit=kind != "int8", load_in_8bit=kind == "int8",
                                                 bnb_4bit_quant_type="fp4" if kind == "fp4" else "nf4",
                                                 bnb_4bit_compute_dtype=torch.float32)
        model = transformers.AutoModelForCausalLM.from_pretrained(base, quantization_config=config, device_map="cpu")
        made[kind] = str(tmp_path_factory.mktemp(f"bnb_{kind}"))
        model.save_pretrained(made[kind])
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(base, name), made[kind])
    return str(base), made


def bitsandbytes_in_float32(model: torch.nn.Module) -> torch.nn.Module:
    """model's bitsandbytes 4-bit linears on bitsandbytes' own float32 route: its dequantize_4bit, then a float32
    matmul (the gemm_4bit op's default kernel). On a CPU with AVX512-BF16 a Linear4bit otherwise repacks its weight
    at its first call and multiplies in bfloat16 (its fused gemv_4bit, whatever the compute dtype asked: 1.8e-2 off
    the float32 product on this test's logits); that choice is the flag it takes from has_avx512bf16() when made."""
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers  # (the folder's linears are bitsandbytes' own)
    for layer in layers:
        assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)  # (not yet repacked)
        layer.support_avx512bf16_for_cpu = False
    return model


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_bitsandbytes_4bit_folders_give_bitsandbytes_own_logits(bnb_folders, kind):
    """transformers runs a 4-bit folder by dequantizing each weight with bitsandbytes (float32 compute, on every
    CPU: bitsandbytes_in_float32): the engine's dequantized weights give its logits; nf4 loads as quantized.py's nf4
    by default, its codes and absmax the stored ones bit for bit (its kernel's activations in 8 bits: the quantized
    tolerance), its float head float as stored; fp4 dequantized."""
    from dense_engine.cpu import kernels

    folder = bnb_folders[1][kind]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, device_map="cpu").eval()
    bitsandbytes_in_float32(reference)
    assert logits_error(folder, reference, quant="none") < 1e-5
    model = load.from_pretrained(folder, dtype=torch.float32)
    stored = load_file(os.path.join(folder, "model.safetensors"))
    assert type(model.lm_head) is kernels.Linear and torch.equal(model.lm_head.weight, stored["lm_head.weight"])
    qkv = model.layers[0].mixer.qkv_proj
    if kind == "nf4":
        q = stored["model.layers.0.self_attn.q_proj.weight"]
        assert torch.equal(qkv.weight[:q.shape[0]], q)
        assert torch.equal(qkv.absmax[:q.shape[0] * 2 // 64], stored["model.layers.0.self_attn.q_proj.weight.absmax"])
        assert logits_error(folder, reference) < 2e-2 * float(reference(input_ids=ids()).logits.abs().max())
    else:
        assert isinstance(qkv, torch.nn.Linear)


def test_a_bitsandbytes_int8_folder_is_the_int8_path_with_its_stored_codes(bnb_folders):
    """An int8 folder's rows times SCB / 127 are the weights (LLM.int8's outlier split is its matmul, not its
    numbers): the logits of a float32 model holding them; loaded as quantized.py's int8, whose codes are the stored
    ones, its float head float as stored."""
    from dense_engine.cpu import kernels

    base, made = bnb_folders
    stored = load_file(os.path.join(made["int8"], "model.safetensors"))
    weights = {name[:-len(".SCB")]: stored[name[:-len(".SCB")] + ".weight"].float() * stored[name][:, None] / 127
               for name in stored if name.endswith(".SCB")}
    assert len(weights) == 14
    reference = with_weights(transformers.LlamaForCausalLM.from_pretrained(base).eval(), weights)
    assert logits_error(made["int8"], reference, quant="none") < 1e-5
    model = load.from_pretrained(made["int8"], dtype=torch.float32)
    q = stored["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(model.layers[1].mlp.down_proj.weight, q)
    assert type(model.lm_head) is kernels.Linear and torch.equal(model.lm_head.weight, stored["lm_head.weight"])
    assert logits_error(made["int8"], reference) < 2e-2 * float(reference(input_ids=ids()).logits.abs().max())


# ---------------------------------------------------------------------------------------------------------------
# compressed-tensors


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM", "W4A16_G32", "W4A16_CHANNEL", "W8A16", "W8A16_CHANNEL",
                                    "FP8", "FP8_DYNAMIC", "FP8_BLOCK"])
def test_compressed_tensors_folders_give_their_decompressed_models_logits(tmp_path, preset):
    """Folders written by compressed-tensors' own compressor (pack-quantized int4 / int8 by group, channel, with zero
    points; float-quantized FP8 by tensor, channel, 128 x 128 block): each linear's weight is what the library's
    decompression gives, to the bit, and the logits are those of a float32 model holding those weights."""
    from prequantized_makers_ct import make_compressed_tensors

    weights = make_compressed_tensors(str(tmp_path), preset, seed=1)
    reference = with_weights(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval(), weights)
    base = load_file(os.path.join(tmp_path, "model.safetensors"))
    with torch.no_grad():
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            reference.get_parameter(name).copy_(base[name])
        for i in range(2):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                name = f"model.layers.{i}.{norm}.weight"
                reference.get_parameter(name).copy_(base[name])
    from dense_engine.formats import families

    table = families.hf_weights(str(tmp_path))
    assert all(torch.equal(table[name + ".weight"](), w) for name, w in weights.items())
    assert logits_error(str(tmp_path), reference) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# fine-grained FP8


def fp8_blocks(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """w [out, in] as Qwen3-FP8 stores it: e4m3 values and a float32 scale per 128 x 128 block (weight_scale_inv,
    the multiplier back: amax / 448); and the weight they mean."""
    out, inp = w.shape
    padded = torch.nn.functional.pad(w, (0, -inp % 128, 0, -out % 128))
    blocks = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448
    q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:out, :inp].to(torch.float8_e4m3fn)
    meant = q.float() * scale.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]
    return {"weight": q, "weight_scale_inv": scale}, meant


def test_a_fine_grained_fp8_folder_runs_its_blocks_scales(tmp_path):
    """Qwen3-FP8's layout: e4m3 weights and weight_scale_inv per 128 x 128 block (k and v's 64 rows a part block):
    the logits of a float32 model holding e4m3 x scale, loaded as float (the CPU's auto) and as fp8 (a GPU's auto:
    the stored values and each block's scale on its rows, Float8Linear); transformers' own reading of the folder (its
    CPU fallback dequantizes to bfloat16) gives the same weights to bfloat16's rounding. A saved fp8 variant keeps the
    stored values. A missing scale is refused in one line."""
    import quantize
    from dense_engine.cpu.quantized import Float8Linear

    folder, reference = packed_folder(tmp_path, fp8_blocks, {"activation_scheme": "dynamic", "fmt": "e4m3",
                                                             "quant_method": "fp8", "weight_block_size": [128, 128]})
    record, checkpoint = load.plan(folder)
    assert record.quant is None and "dequantized to float" in record.reason
    assert load.auto_mode(checkpoint, "cuda")[0] == "fp8" and len(checkpoint.exact) == 14
    assert logits_error(folder, reference, quant="auto") < 1e-5
    assert logits_error(folder, reference, quant="fp8") < 1e-5
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, device_map="cpu")
    mine = load.from_pretrained(folder, dtype=torch.float32, quant="fp8")
    layer, w = mine.layers[1].mlp.down_proj, theirs.model.layers[1].mlp.down_proj.weight.float()
    stored = load_file(os.path.join(folder, "model.safetensors"))
    assert isinstance(layer, Float8Linear) and torch.equal(layer.weight, stored["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(layer.dequantize(torch.float32), reference.model.layers[1].mlp.down_proj.weight)
    assert (layer.dequantize(torch.float32) - w).abs().max() <= w.abs().max() * 2 ** -8
    qkv = mine.layers[0].mixer.qkv_proj.dequantize(torch.float32)  # (k and v: 64 rows of a 128-row block each)
    attn = reference.model.layers[0].self_attn
    assert torch.equal(qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    quantize.quantize_checkpoint(folder, "fp8", out=str(tmp_path / "saved"))
    saved = load.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32, quant="fp8")
    assert torch.equal(saved.layers[1].mlp.down_proj.weight, layer.weight)
    with torch.no_grad():
        assert torch.equal(saved(ids()), mine(ids()))
    stored = load_file(os.path.join(folder, "model.safetensors"))
    del stored["model.layers.1.mlp.up_proj.weight_scale_inv"]
    save_file(stored, os.path.join(folder, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight_scale_inv is missing") as e:
        load.from_pretrained(folder)
    assert "\n" not in str(e.value)


def fake_fp8_rows(module, args):
    """A linear's input with each row quantized to e4m3 and back (max|row| / 448): FP8-dynamic's activations."""
    x = args[0].float()
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    return ((x / scale).to(torch.float8_e4m3fn).float() * scale,)


def test_fp8_dynamic_folders_run_their_scaled_matmul_as_its_arithmetic_means(tmp_path):
    """compressed-tensors' FP8-dynamic (e4m3 weights, a scale per channel, activations quantized per token on the fly)
    as fp8: Float8Linear's torch._scaled_mm path (a GPU's with compute capability 8.9+; run here on the CPU's reference
    kernel) gives the logits of a float32 model holding the dequantized weights whose linears take their inputs
    quantized to e4m3 per row; its weight-only path (every other device) the plain float model's."""
    from prequantized_makers_ct import make_compressed_tensors

    from dense_engine.cpu.quantized import Float8Linear

    weights = make_compressed_tensors(str(tmp_path), "FP8_DYNAMIC", seed=2)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    reference = with_weights(transformers.LlamaForCausalLM(reference.config).eval(), weights)
    base = load_file(os.path.join(tmp_path, "model.safetensors"))
    with torch.no_grad():
        for name in [n for n in base if "proj" not in n]:
            reference.get_parameter(name).copy_(base[name])
    model = load.from_pretrained(str(tmp_path), dtype=torch.float32, quant="fp8")
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(layers) == 8 and all(m.scales.shape[1] == 1 and not m.scaled_mm for m in layers)  # (not on a CPU)
    with torch.no_grad():
        want = reference(input_ids=ids()).logits
        assert float((model(ids()) - want).abs().max()) < 1e-5
        for m in layers:
            m.scaled_mm = True
        got = model(ids())
        for name, m in reference.named_modules():
            if name.endswith("proj"):
                m.register_forward_pre_hook(fake_fp8_rows)
        quantized_rows = reference(input_ids=ids()).logits
    assert float((got - quantized_rows).abs().max()) < 1e-4 * float(quantized_rows.abs().max())
    assert float((got - want).abs().max()) > 1e-3  # (the activations' quantization shows)


@pytest.mark.parametrize("change, field", [
    ({"quant_method": "hqq"}, r"quant_method 'hqq' is not supported"),
    ({"quant_method": "gptq", "bits": 3}, r"bits 3 is not supported"),
    ({"quant_method": "awq", "version": "exllama"}, r"version 'exllama' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "sparse-24-bitmask"}, r"format 'sparse-24-bitmask'")])
def test_a_scheme_this_engine_does_not_read_is_refused_in_one_line(tmp_path, change, field):
    random_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": change}))
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config\." + field) as e:
        load.from_pretrained(str(tmp_path))
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------------------------
# GPTQ and AWQ


@pytest.mark.parametrize("bits, group, sym, desc_act, version", [
    (4, 128, True, False, 1), (4, 32, False, True, 1), (4, 64, False, False, 2), (8, -1, True, False, 1),
    (8, 32, False, True, 2)])
def test_gptq_folders_give_the_logits_of_the_weights_they_mean(tmp_path, bits, group, sym, desc_act, version):
    """GPTQ 4 / 8 bits, symmetric and not, by group or channel, act-order (g_idx not in order), v1 (zero points stored
    minus one) and v2: the logits of a float32 model holding the weights the tensors mean."""
    from prequantized_makers_gptq import gptq_config, pack_gptq

    folder, reference = packed_folder(tmp_path, lambda w: pack_gptq(w, bits, group, sym, desc_act, version),
                                      gptq_config(bits, group, sym, desc_act, version))
    assert logits_error(folder, reference, quant="none") < 1e-5


def test_a_gptq_v1_zero_point_of_zero_is_read_as_gptqmodel_reads_it(tmp_path):
    """v1 stores zero - 1 by subtracting from whole words: a zero point of 0 borrows from its neighbour. Read back
    word by word (as GPTQModel's loader adds the ones back), every zero point is right; a group whose weights are all
    positive has zero point 0."""
    from prequantized_makers_gptq import gptq_config, pack_gptq

    folder, reference = packed_folder(tmp_path, lambda w: pack_gptq(w.abs(), 4, 32, False, False, 1),
                                      gptq_config(4, 32, False, False, 1))
    assert logits_error(folder, reference, quant="none") < 1e-5


@pytest.mark.parametrize("group", [128, 64])
def test_awq_folders_give_the_logits_of_the_weights_they_mean(tmp_path, group):
    """AWQ gemm 4-bit (eight codes a word in the order 0, 2, 4, 6, 1, 3, 5, 7, zero points so too)."""
    from prequantized_makers_gptq import awq_config, pack_awq

    folder, reference = packed_folder(tmp_path, lambda w: pack_awq(w, group), awq_config(group))
    assert logits_error(folder, reference, quant="none") < 1e-5


@pytest.mark.parametrize("kind", ["gptq 4 bits g128", "gptq 4 bits per channel", "awq g64"])
def test_4bit_gptq_and_awq_load_as_int4_holding_their_numbers_to_the_bit(tmp_path, kind):
    """GPTQ (in order: no act-order) and AWQ 4-bit with zero points are the int4 tile's scale and minimum: --quant
    auto loads them as int4-g32 (min = -scale * zero, in float32: exact), each weight dequantized equal to the
    format's to the bit, and the model's logits those of a float model holding its layers' weights (the int4 kernel's
    x near float32's precision; the head float, as the folder holds it). Act-order loads as float, with a note."""
    from prequantized_makers_gptq import awq_config, gptq_config, pack_awq, pack_gptq
    from test_quantize import quantized_reference, rel_err

    pack, config = {"gptq 4 bits g128": (lambda w: pack_gptq(w, 4, 128, False, False, 1),
                                         gptq_config(4, 128, False, False, 1)),
                    "gptq 4 bits per channel": (lambda w: pack_gptq(w, 4, -1, True, False, 2),
                                                gptq_config(4, -1, True, False, 2)),
                    "awq g64": (lambda w: pack_awq(w, 64), awq_config(64))}[kind]
    folder, reference = packed_folder(tmp_path, pack, config)
    record, checkpoint = load.plan(folder)
    assert record.quant == "int4" and "holds exactly" in record.reason and len(checkpoint.exact) == 14
    model = load.from_pretrained(checkpoint, dtype=torch.float32, quant="int4")
    layer = model.layers[1].mlp.gate_up_proj
    want = torch.cat([reference.model.layers[1].mlp.gate_proj.weight, reference.model.layers[1].mlp.up_proj.weight])
    assert type(layer).__name__ == "Int4Linear" and torch.equal(layer.dequantize(torch.float32), want)
    with torch.no_grad():
        assert rel_err(model(ids()), quantized_reference(model)(ids())) < 1e-3


def test_act_order_gptq_loads_as_float_with_a_note(tmp_path, capsys):
    from prequantized_makers_gptq import gptq_config, pack_gptq

    folder, _ = packed_folder(tmp_path, lambda w: pack_gptq(w, 4, 32, False, True, 1), gptq_config(4, 32, False,
                                                                                                    True, 1))
    record, checkpoint = load.plan(folder)
    assert record.quant is None and not checkpoint.exact
    assert "gptq weights (14 linears) dequantized as they load" in capsys.readouterr().err


GPTQ_AWQ = {"gptq": (lambda w: pack_gptq(w, 4, 128, False, False, 1), gptq_config(4, 128, False, False, 1)),
            "awq": (lambda w: pack_awq(w, 64), awq_config(64))}


def greedy(logits, n: int = 32) -> torch.Tensor:
    """n greedy tokens after each of four prompts (a row each), logits(ids) -> [rows, positions, vocab]."""
    x = torch.randint(3, 512, (4, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(n):
            x = torch.cat([x, logits(x)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x[:, 8:]


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_gptq_and_awq_folders_under_auto_run_their_float_tensors_as_stored(tmp_path, kind):
    """--quant auto (the programs' default: load.plan, then its record loaded as the programs load it) runs a 4-bit
    GPTQ / AWQ folder as stored: its linears int4 holding their numbers to the bit, its float head float (the stored
    tensor, not int8: 6.3e-3 and 6.8e-3 of the largest logit off before, and greedy tokens that parted); the logits of
    a float32 model holding the weights the tensors mean (the makers' own formula) within 1e-5 of the largest, and
    its greedy tokens the same. quant=None (from_pretrained's default) loads the same."""
    from dense_engine.cpu import kernels
    from dense_engine.runtime.session import load_model

    folder, reference = packed_folder(tmp_path, *GPTQ_AWQ[kind])
    record, checkpoint = load.plan(folder)
    assert record.quant == "int4" and "float tensors (the head, embeddings, norms) as stored" in record.weights
    model = load_model(record, checkpoint)
    assert type(model.lm_head) is kernels.Linear
    assert torch.equal(model.lm_head.weight, load_file(os.path.join(folder, "model.safetensors"))["lm_head.weight"])
    assert all(type(m).__name__ == "Int4Linear" for name, m in model.named_modules() if name.endswith("proj"))
    with torch.no_grad():
        want = reference(input_ids=ids()).logits
        assert float((model(ids()) - want).abs().max()) < 1e-5 * float(want.abs().max())
        default = load.from_pretrained(folder, dtype=torch.float32)
        assert torch.equal(default(ids()), model(ids()))
    assert torch.equal(greedy(model), greedy(lambda x: reference(input_ids=x).logits))


def test_a_linear_a_gptq_folder_left_unquantized_runs_float_as_stored(tmp_path):
    """A linear the folder stores in float (modules_to_not_convert, a dynamic exclusion) beside int4 ones: float as
    stored under --quant auto, not quantized to int4; a float part of a stacked projection (layer 0's k_proj) keeps
    the stack float, its quantized parts dequantized (the same numbers); the rest int4; the logits within 1e-5."""
    from dense_engine.cpu import kernels

    folder, reference = packed_folder(tmp_path, *GPTQ_AWQ["gptq"])
    stored, base = load_file(os.path.join(folder, "model.safetensors")), load_file(tmp_path / "base/model.safetensors")
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        for key in ("qweight", "qzeros", "scales", "g_idx"):
            stored.pop(f"{name}.{key}", None)
        stored[f"{name}.weight"] = base[f"{name}.weight"]
        with torch.no_grad():
            reference.get_submodule(name).weight.copy_(base[f"{name}.weight"])
    save_file(stored, os.path.join(folder, "model.safetensors"))
    model = load.from_pretrained(folder, dtype=torch.float32, quant="auto")
    float_layers = {name for name, m in model.named_modules() if type(m) is kernels.Linear}
    assert float_layers == {"lm_head", "layers.0.mixer.qkv_proj", "layers.1.mlp.down_proj"}
    assert torch.equal(model.layers[1].mlp.down_proj.weight, base["model.layers.1.mlp.down_proj.weight"])
    attn = reference.model.layers[0].self_attn
    assert torch.equal(model.layers[0].mixer.qkv_proj.weight,
                       torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert type(model.layers[0].mlp.gate_up_proj).__name__ == "Int4Linear"
    with torch.no_grad():
        want = reference(input_ids=ids()).logits
        assert float((model(ids()) - want).abs().max()) < 1e-5 * float(want.abs().max())


def test_another_mode_on_a_gptq_folder_says_on_its_first_line_that_it_quantizes_the_float_head(tmp_path):
    """A mode other than the folder's own quantizes its float tensors (the head int8 beside 4 bits) and its weights
    again, and the first line says so: --quant nf4 on a 4-bit GPTQ folder, --quant int4 on an act-order one (run as
    float by auto); --quant int4 on the 4-bit folder is its own mode, as stored."""
    from dense_engine.cpu.quantized import Int8Linear
    from dense_engine.runtime.session import load_model

    folder, _ = packed_folder(tmp_path, *GPTQ_AWQ["gptq"])
    record, checkpoint = load.plan(folder, quant="nf4")
    assert record.weights == ("nf4 (--quant nf4, which quantizes the folder's float head to int8 and its gptq weights "
                              "again to nf4; --quant auto runs it as stored)")
    assert isinstance(load_model(record, checkpoint).lm_head, Int8Linear)
    record, _ = load.plan(folder, quant="int4")
    assert record.weights.startswith("int4 (--quant int4: the folder's gptq int4 weights, which int4 holds exactly; "
                                     "its float tensors (the head, embeddings, norms) as stored")
    act_order, _ = packed_folder(tmp_path / "act_order", lambda w: pack_gptq(w, 4, 32, False, True, 1),
                                 gptq_config(4, 32, False, True, 1))
    record, checkpoint = load.plan(act_order, quant="int4")
    assert "which quantizes the folder's float head to int8 and its gptq weights again to int4" in record.weights
    assert isinstance(load_model(record, checkpoint).lm_head, Int8Linear)
