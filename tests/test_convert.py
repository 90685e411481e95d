"""Every family's on-disk layout, convert.py's native folders, and the ways a foreign checkpoint can be wrong."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, LAYOUTS, expected, fixture_path, rel_err
from safetensors.torch import load_file, save_file

from dense_engine.formats import convert, families
from dense_engine.formats.load import from_pretrained
from dense_engine.system.errors import CheckpointError


@pytest.mark.parametrize("layout", LAYOUTS)
def test_converted_folder_loads_to_the_same_logits(layout, tmp_path):
    dst = tmp_path / "native"
    convert.convert(fixture_path(layout), str(dst))
    assert json.loads((dst / "config.json").read_text()).get("model_type", "dense") == "dense"
    ids = expected(layout)["input_ids"]
    direct = from_pretrained(fixture_path(layout))(ids)
    native = from_pretrained(dst)(ids)
    assert torch.equal(direct, native)
    assert rel_err(native, expected(layout)["logits"]) < 1e-4


def test_a_native_folder_of_older_names_loads_as_today(tmp_path):
    """Folders and saved variants written when a layer's mixer was `attn` (layers.N.attn.*, attn_norm) load to the
    same model as the same tensors under today's names (layers.N.mixer.*, mixer_norm)."""
    import quantize

    dst = tmp_path / "native"
    convert.convert(fixture_path("llama"), str(dst))
    today = load_file(dst / "model.safetensors")
    assert "layers.0.mixer.q_proj.weight" in today and "layers.0.mixer_norm.weight" in today
    assert not any(".attn" in name for name in today)
    assert quantize.main(["--ckpt", str(dst), "--mode", "int8"]) == 0
    ids = expected("llama")["input_ids"]
    fresh, fresh_int8 = from_pretrained(dst)(ids), from_pretrained(dst, quant="int8")(ids)
    for file in ("model.safetensors", convert.variant_file("int8")):
        tensors = load_file(dst / file)
        save_file({name.replace(".mixer", ".attn"): t for name, t in tensors.items()}, dst / file,
                  metadata={"format": "pt"})
    assert "layers.0.attn_norm.weight" in load_file(dst / "model.safetensors")
    assert torch.equal(from_pretrained(dst)(ids), fresh)
    assert torch.equal(from_pretrained(dst, quant="int8")(ids), fresh_int8)


def test_convert_copies_the_tokenizer(tmp_path):
    convert.convert(fixture_path("neox_original"), str(tmp_path / "a"))
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == \
        Path(FIXTURES, "neox_original", "20B_tokenizer.json").read_bytes()
    convert.convert(fixture_path("llama"), str(tmp_path / "b"))
    assert json.loads((tmp_path / "b" / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "dense_engine.formats.convert", *map(str, args)], capture_output=True,
                          text=True, check=False)


def test_cli_never_overwrites_without_force(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "model.safetensors").write_text("mine")
    result = run_cli(fixture_path("sprout"), dst)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "--force" in result.stderr
    assert (dst / "model.safetensors").read_text() == "mine"
    assert run_cli(fixture_path("sprout"), dst, "--force").returncode == 0
    assert from_pretrained(dst).config.hidden_size == 64
    assert not [p for p in os.listdir(dst) if p.startswith(".tmp")]


def test_cli_casts_dtype(tmp_path):
    assert run_cli(fixture_path("llama"), tmp_path / "bf", "--dtype", "bfloat16").returncode == 0
    assert load_file(tmp_path / "bf" / "model.safetensors")["norm.weight"].dtype == torch.bfloat16
    assert from_pretrained(tmp_path / "bf").dtype == torch.bfloat16  # torch_dtype is the default


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PAYLOAD_MARK']}",))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path, monkeypatch):
    mark = tmp_path / "pwned"
    monkeypatch.setenv("PAYLOAD_MARK", str(mark))
    folder = tmp_path / "evil"
    folder.mkdir()
    torch.save({"model": {"x": Payload()}, "config": {"dim": 64}}, folder / "ckpt.pt")
    with pytest.raises(CheckpointError, match="refused to unpickle") as info:
        from_pretrained(folder)
    assert "ckpt.pt" in str(info.value) and "\n" not in str(info.value)
    assert not mark.exists()


def copy_fixture(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    return dst


def test_sharded_safetensors_index(tmp_path):
    folder = copy_fixture("llama", tmp_path)
    state = load_file(folder / "model.safetensors")
    os.remove(folder / "model.safetensors")
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, folder / shard)
    index = {"weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = expected("llama")["input_ids"]
    assert rel_err(from_pretrained(folder)(ids), expected("llama")["logits"]) < 1e-4
    os.remove(folder / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="shard 'model-00002-of-00002.safetensors' is named in the index"):
        from_pretrained(folder)


def test_pytorch_model_bin_and_old_buffers(tmp_path):
    folder = copy_fixture("gptneox", tmp_path)
    state = load_file(folder / "model.safetensors")
    os.remove(folder / "model.safetensors")
    state["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(4)
    state["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    state["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    torch.save(state, folder / "pytorch_model.bin")
    ids = expected("gptneox")["input_ids"]
    assert rel_err(from_pretrained(folder)(ids), expected("gptneox")["logits"]) < 1e-4
    state["gpt_neox.layers.0.attention.surprise"] = torch.ones(1)
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="unexpected tensor 'gpt_neox.layers.0.attention.surprise'"):
        from_pretrained(folder)


def test_newer_rope_parameters_config(tmp_path):
    folder = copy_fixture("gptneox", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rotary_emb_base"),
                                 "partial_rotary_factor": config.pop("rotary_pct")}
    (folder / "config.json").write_text(json.dumps(config))
    model = from_pretrained(folder)
    assert model.config.rotary_dim == 4
    assert rel_err(model(expected("gptneox")["input_ids"]), expected("gptneox")["logits"]) < 1e-4


def test_sprout_state_dict_beside_config_json(tmp_path):
    ckpt = torch.load(fixture_path("sprout"), weights_only=True)
    for fmt in ("safetensors", "pt"):
        folder = tmp_path / fmt
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(ckpt["config"]))
        state = {k: v.contiguous() for k, v in ckpt["model"].items()}
        if fmt == "pt":
            torch.save(state, folder / "model.pt")
        else:
            save_file(state, folder / "model.safetensors")
        logits = from_pretrained(folder)(expected("sprout")["input_ids"])
        assert rel_err(logits, expected("sprout")["logits"]) < 1e-4


def test_unknown_model_type(tmp_path):
    folder = copy_fixture("llama", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(CheckpointError, match=r"config.json: unknown model_type 'mamba'"):
        from_pretrained(folder)


def test_missing_family_field(tmp_path):
    folder = copy_fixture("openelm", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["model_dim"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: missing config field 'model_dim'"):
        from_pretrained(folder)


def test_openelm_widths_follow_seed_003():
    # OpenELM-270M's published per-layer sizes, derived from its config as OpenELM's reference does.
    raw = {"num_transformer_layers": 16, "model_dim": 1280, "head_dim": 64, "num_gqa_groups": 4,
           "ffn_multipliers": (0.5, 4.0), "qkv_multipliers": (0.5, 1.0), "ffn_dim_divisor": 256}
    q, kv, ffn = families.openelm_widths(raw, "cfg")
    assert q == [12, 12, 12, 12, 12, 16, 16, 16, 16, 16, 16, 16, 20, 20, 20, 20]
    assert kv == [h // 4 for h in q]
    assert ffn[0] == 768 and ffn[-1] == 5120 and len(ffn) == 16


def test_neox_original_norms_must_agree(tmp_path):
    folder = copy_fixture("neox_original", tmp_path)
    shard = folder / "global_step150000" / "layer_03-model_01-model_states.pt"
    state = torch.load(shard, weights_only=True)
    state["input_layernorm.weight"] = state["input_layernorm.weight"] + 1
    torch.save(state, shard)
    with pytest.raises(CheckpointError, match="'input_layernorm.weight' of layer 03 differs between the two shards"):
        from_pretrained(folder)


def test_neox_original_reads_one_layer_at_a_time(tmp_path, monkeypatch):
    loaded = []
    real = families.gpt_neox.load_pickle

    def spy(path):
        state = real(path)
        loaded.append(os.path.basename(path)[:8])
        return state

    monkeypatch.setattr(families.gpt_neox, "load_pickle", spy)
    from_pretrained(fixture_path("neox_original"))
    # every layer file is read once, in order, so at most two layers are held at a time
    assert loaded == [f"layer_{i:02d}" for i in (0, 0, 2, 2, 3, 3, 5, 5, 6, 6)]
