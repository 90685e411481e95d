"""quantize.py: bit-exact nf4, lossless int4 on its own grid, round trips on the fixtures, saved variants, the
compiled decode step, and the files the user owns."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import FIXTURES, ROOT, expected, fixture_path, rel_err
from safetensors import safe_open

import dense
import quantize
from dense_engine.cpu import kernels, quantized
from dense_engine.formats import checkpoint, load
from dense_engine.runtime import generate

# Max logit error against full precision on the random-weight fixtures, as measured (tests/fixtures draw weights
# with large norm gains, so 4-bit errors are far larger than on trained models; see BENCHMARKS.md for perplexity).
TOLERANCE = {"int8": 0.05, "llm.int8": 0.06, "int4": 0.45, "nf4": 0.45, "fp8": 0.25}  # (e4m3: 3 mantissa bits)
FOUR_BIT_OK = ["llama", "gptneox"]  # fixtures whose widths are multiples of 32 (int4's group)


@pytest.mark.parametrize("shape", [(64, 64), (96, 64), (256, 576), (3, 64)])
def test_nf4_is_bit_exact_with_bitsandbytes(shape):
    import bitsandbytes.functional as bnbf

    torch.manual_seed(0)
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 0.1
    w[0, 0] = 0.0  # ties and zeros included
    ours = quantized.nf4_quantize(w)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert torch.equal(ours["weight"], packed) and torch.equal(ours["absmax"], state.absmax)


def test_nf4_table_is_bitsandbytes():
    from bitsandbytes.functional import get_4bit_type

    assert torch.equal(quantized.NF4, get_4bit_type("nf4", device="cpu").float())


def test_int8_known_values():
    q = quantized.int8_quantize(torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]]))
    assert q["weight"].tolist() == [[64, -127, 32], [0, 0, 0]]  # 63.5 rounds to even; a zero row stays zero
    assert torch.allclose(q["scales"][0], torch.tensor(2.0 / 127))


def test_int4_is_lossless_on_its_own_grid():
    # values min + scale * q in float16, as a Q4_1 GGUF holds them, re-quantize to themselves
    torch.manual_seed(0)
    scales = (torch.rand(8, 4) * 0.01 + 0.001).half().float()
    mins = (-torch.rand(8, 4) * 0.05).half().float()
    q = torch.randint(0, 16, (8, 4, 32))
    q[..., 0], q[..., 1] = 0, 15  # each group spans the whole grid, as Q4_1's blocks do
    w = (mins[..., None] + scales[..., None] * q).reshape(8, 128)
    layer = quantized.Int4Linear(128, 8, False, group_size=32)
    layer._buffers.update(quantized.int4_quantize(w, 32))
    assert torch.equal(layer.dequantize(torch.float32), w)


def quantized_reference(model: dense.DenseDecoder) -> dense.DenseDecoder:
    """An independent path: a plain float model whose linears hold each quantized layer's dequantized weight."""
    import copy

    ref = copy.deepcopy(model)
    for name, module in model.named_modules():
        if isinstance(module, quantized.QuantLinear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight.data = module.dequantize(torch.float32)
            if module.bias is not None:
                linear.bias.data = module.bias.data.clone()
            parent, _, attr = name.rpartition(".")
            setattr(ref.get_submodule(parent) if parent else ref, attr, linear)
    return ref


@pytest.mark.parametrize("layout, mode", [(lay, mode) for mode in quantized.MODES for lay in
                                          (FOUR_BIT_OK if mode in ("int4", "nf4")
                                           else ["shellelastic", "gptneox", "openelm"])])
def test_round_trip_on_fixtures(layout, mode, tmp_path):
    src = fixture_path(layout)
    ids = expected(layout)["input_ids"]
    full = load.from_pretrained(src)(ids)
    out = tmp_path / "q"
    quantize.quantize_checkpoint(src, mode, out=str(out))
    model = load.from_pretrained(str(out), quant=mode)
    logits = model(ids)
    assert rel_err(logits, full) < TOLERANCE[mode]
    # the quantized layers compute what their dequantized weights say, up to the activations' rounding on CPU: int8
    # and int4 kernels take them in 8 bits per block of 32 (tests/test_kernels.py checks that arithmetic exactly)
    if mode != "llm.int8":
        assert rel_err(logits, quantized_reference(model)(ids)) < 5e-2
    # a saved variant reloads to exactly what quantizing at load time gives
    on_the_fly = quantized.quantize_model(load.from_pretrained(src), mode)
    assert torch.equal(on_the_fly(ids), logits)


def test_int4_saved_in_the_kernels_layout_loads_as_stored(tmp_path, monkeypatch):
    """An int4 variant is saved in the CPU kernel's layout: a load maps it and multiplies with it as stored (nothing
    repacked), and every other reader (another device, no kernels, tensor parallel's table) gets the pairs back."""
    src, out = fixture_path("llama"), tmp_path / "q"
    quantize.quantize_checkpoint(src, "int4", out=str(out))
    assert json.loads((out / "config.json").read_text())["quantization"]["int4"]["layout"] == kernels.INT4_LAYOUT
    on_the_fly = quantized.quantize_model(load.from_pretrained(src), "int4")
    fly = {n: m for n, m in on_the_fly.named_modules() if isinstance(m, quantized.Int4Linear)}
    assert fly
    table = load.pairs_layout(checkpoint.open_safetensors(str(out / "model.int4.safetensors")))
    for name in ("layers.0.mlp.down_proj", "layers.1.mixer.o_proj"):
        for key in ("qweight", "scales", "mins"):
            assert torch.equal(table[f"{name}.{key}"](), fly[name]._buffers[key]), (name, key)

    def repacked(*args):
        raise AssertionError("repacked at load")
    monkeypatch.setattr(kernels, "pack_int4", repacked)
    model = load.from_pretrained(str(out), quant="int4")
    ids = expected("llama")["input_ids"]
    assert torch.equal(model(ids), on_the_fly(ids))
    for name, module in model.named_modules():
        if isinstance(module, quantized.Int4Linear):
            assert module.kernel_weight is module.qweight and module.kernel_scales is module.scales
            pairs = module.stored_pairs()
            assert all(torch.equal(pairs[k], fly[name]._buffers[k]) for k in pairs), name
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "available", lambda: False)  # no kernels: the pairs, dequantized as before
    plain = load.from_pretrained(str(out), quant="int4")
    layer = plain.layers[0].mlp.gate_up_proj
    assert layer.layout == "pairs" and torch.equal(layer.qweight, on_the_fly.layers[0].mlp.gate_up_proj.qweight)
    assert torch.equal(plain(ids), quantized.quantize_model(load.from_pretrained(src), "int4")(ids))


def test_layers_chosen_and_file_sizes(tmp_path):
    src = fixture_path("gptneox")
    sizes = {}
    for mode, group in (("int8", 32), ("int4", 64), ("nf4", 32)):
        path = quantize.quantize_checkpoint(src, mode, out=str(tmp_path / mode), group_size=group)
        with safe_open(path, "pt") as f:
            names = list(f.keys())
            quantized = [n for n in names if n.rsplit(".", 1)[0] != "embed_tokens"
                         and not n.endswith(("norm.weight", "norm.bias", ".bias"))]
            stored = sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in quantized
                         if not n.startswith("lm_head"))
            assert f.get_tensor("embed_tokens.weight").dtype == torch.float32  # the embedding stays as it was
            head = f.get_tensor("lm_head.weight").dtype
        block_weights = sum(p.numel() for n, p in load.from_pretrained(src).named_parameters()
                            if n.startswith("layers.") and n.endswith("proj.weight"))
        sizes[mode] = stored / (2 * block_weights)  # against the same layers in bfloat16
        assert head == torch.int8  # the head is int8 in every mode
    assert sizes["int8"] <= 0.55 and sizes["int4"] <= 0.30 and sizes["nf4"] <= 0.30, sizes


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_in_place_variant_never_touches_the_original(tmp_path):
    ckpt = tmp_path / "shell"
    shutil.copytree(os.path.join(FIXTURES, "shellelastic"), ckpt)
    before = sha(ckpt / "model.safetensors")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "quantize.py"), "--ckpt", str(ckpt), "--mode", "int8"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert sha(ckpt / "model.safetensors") == before
    config = json.loads((ckpt / "config.json").read_text())
    assert config["quantization"]["int8"]["file"] == "model.int8.safetensors" and config["tier"] == "S"
    assert not [p for p in os.listdir(ckpt) if p.startswith(".tmp")]
    ids = expected("shellelastic")["input_ids"]
    full = load.from_pretrained(ckpt)(ids)  # plain loading still gives full precision
    assert torch.equal(full, load.from_pretrained(fixture_path("shellelastic"))(ids))
    assert not torch.equal(load.from_pretrained(ckpt, quant="int8")(ids), full)


def test_refuses_an_already_quantized_source_and_foreign_in_place(tmp_path):
    out = tmp_path / "q"
    quantize.quantize_checkpoint(fixture_path("llama"), "int8", out=str(out))
    assert load.from_pretrained(str(out)).lm_head.__class__ is quantized.Int8Linear  # the only variant
    result = subprocess.run([sys.executable, os.path.join(ROOT, "quantize.py"), "--ckpt", str(out), "--mode", "int4"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "already quantized" in result.stderr and result.stderr.count("\n") == 1
    with pytest.raises(checkpoint.CheckpointError, match="not a native checkpoint; pass --out"):
        quantize.quantize_checkpoint(fixture_path("llama"), "int8")
    with pytest.raises(checkpoint.CheckpointError, match="input width 48 is not a multiple of the group size 32"):
        quantize.quantize_checkpoint(fixture_path("shellelastic"), "int4", out=str(tmp_path / "x"))


def test_unsaved_mode_quantizes_at_load_with_a_notice(capsys):
    model = load.from_pretrained(fixture_path("llama"), quant="int8")
    assert "no saved int8 variant; quantizing at load time" in capsys.readouterr().err
    assert isinstance(model.layers[0].mlp.gate_up_proj, quantized.Int8Linear)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "int4", "int4 g64", "nf4", "fp8", "fp8 scaled_mm"])
def test_compiled_decode_matches_eager_tokens(mode):
    """(int4 g64: PyTorch's int4 matmul, whose lowering makes a constant of its own, which the saved step carries)"""
    group = int(mode.split(" g")[1]) if " g" in mode else 32
    model = quantized.quantize_model(load.from_pretrained(fixture_path("gptneox" if group == 64 else "llama")),
                                     mode.split()[0], group)
    for layer in model.modules():  # (a GPU's float8 matmul, torch._scaled_mm: in one graph, here on the CPU's kernel)
        if isinstance(layer, quantized.Float8Linear):
            layer.scaled_mm = mode.endswith("scaled_mm")
    ids = expected("llama")["input_ids"][:, :8]
    eager = generate.generate(model, ids, 24)
    assert torch.equal(generate.generate(model, ids, 24, compile=True), eager)  # fullgraph: no graph breaks either


def test_nf4_double_quant_matches_bitsandbytes():
    import bitsandbytes.functional as bnbf

    torch.manual_seed(1)
    w = torch.randn(512, 192) * 0.05
    ours = quantized.nf4_quantize(w, double_quant=True)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    assert torch.equal(ours["weight"], packed) and torch.equal(ours["absmax_q"], state.absmax)
    assert (torch.equal(ours["absmax_scales"], state.state2.absmax)
            and torch.equal(ours["absmax_code"], state.state2.code))
    assert torch.equal(ours["absmax_offset"], state.offset.reshape(1))
    absmax = quantized.double_quant_absmax(*(ours[k] for k in quantized.DOUBLE_QUANT))
    assert torch.allclose(absmax, bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset, rtol=0,
                          atol=1e-7)


def test_double_quant_variant_round_trip(tmp_path):
    src = fixture_path("gptneox")
    plain = quantize.quantize_checkpoint(src, "nf4", out=str(tmp_path / "plain"))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "quantize.py"), "--ckpt", src, "--mode", "nf4",
                             "--double-quant", "--out", str(tmp_path / "dq")], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "dq" / "config.json").read_text())["quantization"]["nf4"]["double_quant"] is True
    def scale_bytes(path, names):  # bytes holding the 64-block scales (the nested code table is a constant)
        with safe_open(path, "pt") as f:
            # (safe_open: keys(), no iteration)
            return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()  # noqa: SIM118
                       if k.rsplit(".", 1)[-1] in names)

    dq_bytes = scale_bytes(tmp_path / "dq" / "model.nf4.safetensors", {"absmax_q", "absmax_scales", "absmax_offset"})
    assert dq_bytes < 0.3 * scale_bytes(plain, {"absmax"})  # 8-bit instead of 32-bit block scales
    ids = expected("gptneox")["input_ids"]
    dq = load.from_pretrained(str(tmp_path / "dq"), quant="nf4")
    assert rel_err(dq(ids), load.from_pretrained(str(tmp_path / "plain"), quant="nf4")(ids)) < 2e-2
    assert rel_err(dq(ids), quantized_reference(dq)(ids)) < 2e-2
    with pytest.raises(checkpoint.CheckpointError, match="--double-quant applies to --mode nf4 only"):
        quantize.quantize_checkpoint(src, "int8", out=str(tmp_path / "x"), double_quant=True)


@pytest.mark.parametrize("width", [24, 40, 48])
def test_an_int8_layer_whose_inputs_are_no_multiple_of_64_computes_its_dequantized_weight(width):
    """The CPU kernel takes inputs in multiples of 64; others go to PyTorch's int8 kernel (multiples of 16: 48) or,
    where that one computes garbage or crashes (24, 40: an FFN of 48 split over two ranks), to the layer's own
    dequantize-and-matmul: the logits of a float model holding each layer's dequantized weight either way."""
    from conftest import random_model

    model = quantized.quantize_model(random_model(intermediate_size=width), "int8")
    down = model.layers[0].mlp.down_proj
    assert down.in_features == width and hasattr(down, "kernel_weight") == (width % 16 == 0)
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        assert rel_err(model(ids), quantized_reference(model)(ids)) < 1e-2
