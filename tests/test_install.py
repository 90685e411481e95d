"""The package installs whole: a wheel built from the sources carries the C++ kernels' sources, and an engine installed
from it into a fresh virtual environment, run from a folder outside the clone, loads its CPU kernels and answers the
clone's greedy tokens."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
from conftest import FIXTURES, ROOT

# Run by both interpreters: where the engine came from, whether the kernels loaded, and int8 greedy tokens (the int8
# linears run the kernels when they load, PyTorch's matmuls when they do not).
PROBE = """
import json, sys
import dense, dense_engine
from dense_engine.cpu import kernels
from dense_engine.formats import load
from dense_engine.runtime import generate
import torch
model = load.from_pretrained(sys.argv[1], quant="int8")
tokens = generate.generate(model, torch.tensor([[1, 5, 9, 2, 7]]), 12)[0].tolist()
print(json.dumps({"engine": dense_engine.__file__, "dense": dense.__file__, "kernels": kernels.available(),
                  "tokens": tokens}))
"""


def probe(python: str, cwd: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([python, "-c", PROBE, os.path.join(FIXTURES, "llama")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_wheel_installs_an_engine_whose_kernels_load_outside_the_clone(tmp_path):
    pytest.importorskip("setuptools")
    source = tmp_path / "source"  # a copy, so that the build writes nothing into the clone
    source.mkdir()
    for name in ("dense.py", "layer_kinds.py", "chat.py", "quantize.py", "serve.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    shutil.copytree(os.path.join(ROOT, "dense_engine"), source / "dense_engine",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(tmp_path / "wheels")], check=True, capture_output=True, timeout=600)
    wheel, = (tmp_path / "wheels").glob("dense_engine-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for kernel in ("kernels.cpp", "kernels_avx2.cpp", "kernels.h"):
        assert f"dense_engine/cpu/{kernel}" in names
    assert sorted(n for n in names if "/" not in n) == ["chat.py", "dense.py", "layer_kinds.py", "quantize.py",
                                                         "serve.py"]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # the new environment sees the packages of the one running the tests (torch, pip, ...) after its own: a venv's
    # --system-site-packages would show the base interpreter's instead, which inside a virtual environment lack them
    inner = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    outer = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    pathlib.Path(inner, "_outer.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in outer))
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "--quiet", str(wheel)], check=True,
                   capture_output=True, timeout=600)
    outside = tmp_path / "outside"
    outside.mkdir()
    installed, clone = probe(python, str(outside)), probe(sys.executable, ROOT)
    assert installed["engine"].startswith(str(venv)) and installed["dense"].startswith(str(venv))
    assert clone["engine"].startswith(ROOT)
    assert installed["kernels"] and clone["kernels"]
    assert installed["tokens"] == clone["tokens"]
    assert os.path.isfile(venv / "bin" / "dense-chat") and os.path.isfile(venv / "bin" / "dense-convert")


def test_a_missing_kernel_source_is_said_once(tmp_path, monkeypatch, capsys):
    from dense_engine.cpu import kernels

    monkeypatch.setattr(kernels, "HERE", str(tmp_path))
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.delenv("DENSE_KERNELS", raising=False)
    if not any(set(flags) <= set(kernels.cpu_flags().split()) for flags in kernels.SOURCES.values()):
        pytest.skip("this CPU has neither kernel's instructions")
    assert kernels.available() is False and kernels.available() is False
    err = capsys.readouterr().err
    assert err.count("CPU kernels unavailable") == 1 and "is missing" in err and str(tmp_path) in err
