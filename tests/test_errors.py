"""Bad input: each case raises an error whose one-line message says what and where."""

import json
import os
import shutil

import pytest
import torch
from conftest import FIXTURES
from safetensors.torch import load_file, save_file

from dense_engine.formats.checkpoint import config_from_dict, make_config
from dense_engine.formats.load import from_pretrained
from dense_engine.runtime import generate
from dense_engine.system.errors import CheckpointError

SHELL = os.path.join(FIXTURES, "shellelastic")


@pytest.fixture
def ckpt(tmp_path):
    """A writable copy of the ShellElastic fixture."""
    dst = tmp_path / "ckpt"
    shutil.copytree(SHELL, dst)
    return dst


def raises_one_line(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_missing_path():
    raises_one_line(CheckpointError, "no such file or folder", from_pretrained, "/nonexistent/x")


def test_missing_config(ckpt):
    os.remove(ckpt / "config.json")
    raises_one_line(CheckpointError, str(ckpt), from_pretrained, ckpt)


def test_unreadable_config(ckpt):
    (ckpt / "config.json").write_text("{ not json")
    msg = raises_one_line(CheckpointError, "not valid JSON", from_pretrained, ckpt)
    assert "config.json" in msg


def test_missing_weights(ckpt):
    os.remove(ckpt / "model.safetensors")
    raises_one_line(CheckpointError, "no model.safetensors", from_pretrained, ckpt)


def test_truncated_safetensors(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    msg = raises_one_line(CheckpointError, "model.safetensors", from_pretrained, ckpt)
    assert "safetensors" in msg


def rewrite(ckpt, change):
    state = load_file(ckpt / "model.safetensors")
    change(state)
    save_file(state, ckpt / "model.safetensors")


def test_missing_tensor(ckpt):
    rewrite(ckpt, lambda s: s.pop("layers.1.attn.gate_proj.weight"))  # (the fixture's older names: as today's)
    raises_one_line(CheckpointError, r"missing tensor 'layers.1.mixer.gate_proj.weight'", from_pretrained,
                    ckpt)


def test_unexpected_tensor(ckpt):
    rewrite(ckpt, lambda s: s.__setitem__("layers.0.mixer.extra.weight", torch.zeros(2)))
    raises_one_line(CheckpointError, r"unexpected tensor 'layers.0.mixer.extra.weight'", from_pretrained,
                    ckpt)


def test_wrong_shape_names_tensor_and_shapes(ckpt):
    rewrite(ckpt, lambda s: s.__setitem__("layers.2.mlp.up_proj.weight", torch.zeros(100, 48)))
    raises_one_line(CheckpointError, r"'layers.2.mlp.up_proj.weight' has shape \[100, 48\], expected \[160, 48\]",
                    from_pretrained, ckpt)


def edit_config(ckpt, **changes):
    config = json.loads((ckpt / "config.json").read_text())
    config.update(changes)
    (ckpt / "config.json").write_text(json.dumps(config))


def test_heads_that_do_not_divide(ckpt):
    edit_config(ckpt, num_key_value_heads=3)
    raises_one_line(CheckpointError, "4 query heads do not divide into 3 key/value heads", from_pretrained,
                    ckpt)


def test_odd_head_dim_with_rotary(ckpt):
    edit_config(ckpt, head_dim=15)
    raises_one_line(CheckpointError, "rotary dimension 15 must be even", from_pretrained, ckpt)


def test_unknown_config_key_is_not_ignored(ckpt):
    edit_config(ckpt, num_layers=3)
    raises_one_line(CheckpointError, "unknown config key 'num_layers'", from_pretrained, ckpt)


def test_bad_choice_value():
    raises_one_line(CheckpointError, "rope_layout must be one of half, interleaved", make_config, rope_layout="pairs")


def test_release_keys_are_ignored():
    config = config_from_dict({"hidden_size": 48, "method": "standalone", "tier": "S", "rms_norm_eps": 1e-6})
    assert config.hidden_size == 48 and config.norm_eps == 1e-6


def test_token_ids_out_of_range():
    model = from_pretrained(SHELL)
    raises_one_line(ValueError, "token id 512 is out of range for the vocabulary of 512", model,
                    torch.tensor([[1, 512]]))
    raises_one_line(ValueError, "token id -1 is out of range", model, torch.tensor([[-1, 2]]))


def test_more_tokens_than_context():
    model = from_pretrained(SHELL)
    raises_one_line(ValueError, "129 tokens exceed the context of 128", model, torch.zeros(1, 129, dtype=torch.long))


def test_cached_step_errors():
    model = from_pretrained(SHELL)
    raises_one_line(ValueError, "call setup_cache", model, torch.zeros(1, 2, dtype=torch.long),
                    input_pos=torch.arange(2))
    raises_one_line(ValueError, "must be in 1..128", model.setup_cache, 1, 129)
    model.setup_cache(1, 16)
    raises_one_line(ValueError, "position 17 is outside the cache of 16", model, torch.zeros(1, 1, dtype=torch.long),
                    input_pos=torch.tensor([17]))
    raises_one_line(ValueError, "batch 2 exceeds", model, torch.zeros(2, 1, dtype=torch.long),
                    input_pos=torch.tensor([0]))


def test_generate_beyond_context():

    model = from_pretrained(SHELL)
    raises_one_line(ValueError, "exceed the context of 128", lambda: list(generate.generate_tokens(
        model, torch.zeros(1, 100, dtype=torch.long), 40)))


def test_first_line_of_any_exception():
    """The one helper every one-line error uses: the first non-empty line; the type's name for an empty message
    (an unguarded str(e).splitlines()[0] raised IndexError there)."""
    from dense_engine.system import errors

    assert errors.first_line(ValueError("")) == "ValueError"
    assert errors.first_line(OSError("\n  disk full\nmore")) == "disk full"
    assert errors.first_line(RuntimeError("x" * 300)) == "x" * 200


def test_a_program_that_leaves_early_flushes_its_output_and_runs_its_exit_handlers(tmp_path):
    """errors.leave (chat.py's exit: no interpreter teardown after the answer): the status is the one given, text still
    in stdout's and stderr's buffers comes out whole, and atexit's handlers run (they remove a temporary folder)."""
    import subprocess
    import sys

    from conftest import ROOT

    marker = tmp_path / "handler-ran"
    program = (f"import atexit, sys; sys.path.insert(0, {ROOT!r}); from dense_engine.system.errors import leave; "
               f"atexit.register(lambda: open({str(marker)!r}, 'w').write('yes')); "
               "sys.stdout.write('answer ' * 5000 + 'end'); sys.stderr.write('note: last'); leave(3)")
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (what leave() flushes is there)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, env=buffered,
                          check=False)
    assert (done.returncode, done.stdout, done.stderr) == (3, "answer " * 5000 + "end", "note: last")
    assert marker.read_text() == "yes"
