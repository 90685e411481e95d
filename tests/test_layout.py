"""The layout: the folders of dense_engine/ are floors, and every import between the project's modules (those inside
functions too) points down them or stays on its floor, with no cycle; dense.py imports nothing of the project and
layer_kinds.py only dense.py, and nothing is put into either from outside at import time; only the root's named files
are installed as top-level modules; tests and bench/ do not reach into each other."""

import ast
import glob
import os
import re
import subprocess
import sys

import tomllib
from conftest import ROOT

# Bottom to top: what a module may import is on its own floor or below. dense.py stands under them all, layer_kinds.py
# on it; the root's programs on top.
MODELS = ("dense", "layer_kinds")
FLOORS = ["dense", "layer_kinds", "dense_engine.system", "dense_engine.cpu", "dense_engine.formats",
          "dense_engine.runtime", "dense_engine", "dense_engine.cli", "dense_engine.server", "programs"]
PROGRAMS = {"chat", "quantize", "serve"}


def modules() -> dict[str, str]:
    """{dotted module name: path} of every module of the project (the root's files and the package's)."""
    found = {name: os.path.join(ROOT, name + ".py") for name in (*MODELS, *PROGRAMS)}
    for path in glob.glob(os.path.join(ROOT, "dense_engine", "**", "*.py"), recursive=True):
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        found[name] = path
    return found


def floor(module: str) -> int:
    if module in PROGRAMS:
        return FLOORS.index("programs")
    package = module if module in FLOORS else module.rsplit(".", 1)[0]  # (a folder: itself)
    while package not in FLOORS and package.count(".") > 1:  # (a folder inside a floor's folder: that floor)
        package = package.rsplit(".", 1)[0]
    return FLOORS.index(package)


def project_imports() -> dict[str, set[str]]:
    """{module: the project modules it imports anywhere in its file (top level or inside functions)}."""
    known = modules()
    graph = {}
    for name, path in known.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)  # `from dense_engine.cpu import kernels` imports the module kernels
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {m for m in found if m in known and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_imports_point_one_way():
    graph = project_imports()
    assert {"dense", "dense_engine.cpu.kernels", "dense_engine.formats.load", "dense_engine.runtime.generate",
            "chat"} <= set(graph)
    cycle = find_cycle({name: {m for m in imports if m != "dense_engine"} for name, imports in graph.items()})
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_point_down_the_folders():
    upward = [f"{name} imports {m}" for name, imports in project_imports().items() for m in sorted(imports)
              if m != "dense_engine" and floor(m) > floor(name)]
    assert not upward, "imports up the floors: " + "; ".join(upward)


def test_every_folder_is_a_floor():
    folders = {os.path.relpath(p, ROOT).replace(os.sep, ".") for p in glob.glob(os.path.join(ROOT, "dense_engine", "*"))
               if os.path.isdir(p) and not p.endswith("__pycache__")}
    assert folders == set(FLOORS) - {*MODELS, "dense_engine", "programs"}
    for name in modules():
        floor(name)  # (raises for a module outside the floors)


def test_the_floor_rule_finds_upward_imports():
    assert floor("dense_engine.cpu.kernels") < floor("dense_engine.runtime.generate") < floor("chat")
    assert floor("dense") < floor("dense_engine.system.machine") < floor("dense_engine.server.serve")


def test_dense_imports_only_torch_and_layer_kinds_only_dense():
    graph = project_imports()
    assert graph["dense"] == set() and graph["layer_kinds"] == {"dense"}


def test_dense_alone_runs_a_llama_3_1_config_and_nothing_is_put_into_the_model_files_at_import_time():
    """dense.py imported alone builds and runs a Llama 3.1 model (its llama3 rope scaling is dense.py's own), with
    the frequencies transformers computes; importing the whole engine (the programs, the API, every loader) adds
    nothing to dense.py or layer_kinds.py: no table filled, no method set."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    alone = ("import sys, torch, dense\n"
             "scaling = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,\n"
             "           'original_max_position_embeddings': 64}\n"
             "config = dense.DenseConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
             "    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,\n"
             "    rope_theta=500000.0, rope_scaling=scaling)\n"
             "model = dense.DenseDecoder(config)\n"
             "model.setup_cache(1, 512)\n"
             "with torch.no_grad():\n"
             "    assert model(torch.arange(20)[None]).shape == (1, 20, 100)\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dense_engine', 'layer_kinds')))\n"
             "print(dense.rope_frequencies(config, 512)[0].tolist())\n")
    found = subprocess.run([sys.executable, "-c", alone], cwd=ROOT, capture_output=True, text=True, check=True)
    imported, frequencies = found.stdout.splitlines()
    assert imported == "[]"
    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=500000.0,
                                  max_position_embeddings=512, rope_scaling={
                                      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert eval(frequencies) == expected.tolist()
    names = ("import dense, layer_kinds\n"
             "print(sorted(vars(dense)), sorted(vars(layer_kinds)), sorted(vars(dense.DenseDecoder)),\n"
             "      sorted(vars(layer_kinds.Decoder)), sorted(dense.DenseConfig.__dataclass_fields__))\n")
    everything = "import chat, serve, quantize, dense_engine.api, dense_engine.formats.load, dense_engine.runtime.tp\n"
    before = subprocess.run([sys.executable, "-c", names], cwd=ROOT, capture_output=True, text=True, check=True)
    after = subprocess.run([sys.executable, "-c", everything + names], cwd=ROOT, capture_output=True, text=True,
                           check=True)
    assert before.stdout == after.stdout and before.stdout.count("DenseDecoder") >= 1


def test_the_programs_import_no_compiler_until_they_compile():
    """sympy (torch's symbolic shapes, 0.3 s) and the compiler are imported when a graph is traced or a compiled step
    loaded, not by the programs' imports: a warm one-shot run never traces."""
    code = ("import sys, chat, serve, dense_engine.api; "
            "print(sorted(m for m in ('sympy', 'torch._dynamo', 'torch._inductor') if m in sys.modules))")
    found = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_only_the_named_files_are_top_level_modules():
    """What pip installs at the top of site-packages: dense, chat, quantize, serve and the one package."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    setuptools = project["tool"]["setuptools"]
    assert set(setuptools["py-modules"]) == {*MODELS, *PROGRAMS}
    assert setuptools["packages"]["find"]["include"] == ["dense_engine*"]
    root_modules = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py"))}
    assert root_modules == {*MODELS, *PROGRAMS}
    assert set(setuptools["package-data"]["dense_engine.cpu"]) == {"*.cpp", "*.h"}
    assert set(project["project"]["scripts"]) == {"dense-chat", "dense-serve", "dense-quantize", "dense-convert"}


def test_tests_and_bench_do_not_reach_into_each_other():
    bench = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "bench", "*.py"))}
    tests = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "tests", "*.py"))}
    crossings = []
    for folder, others in (("tests", bench), ("bench", tests)):
        for path in glob.glob(os.path.join(ROOT, folder, "*.py")):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            tree = ast.parse(text, path)
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                crossings += [f"{path}: {n}" for n in names if n.split(".")[0] in others | {folder}]
            if folder == "bench" and re.search(r"sys\.path\.(insert|append)|sys\.path\[", text):
                crossings.append(f"{path}: edits sys.path")
    assert not crossings, "; ".join(crossings)


def test_dense_holds_the_model_not_its_loading():
    """dense.py and layer_kinds.py define the model and its memory (a KV cache, a state); reading, checking and loading
    checkpoints (and memory checks) live in dense_engine/formats/ and dense_engine/system/, the sampler in
    runtime/sampling.py."""
    names = set()
    for model in MODELS:
        with open(os.path.join(ROOT, f"{model}.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        names |= {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    loading = {n for n in names if any(word in n.lower() for word in (
        "load", "state_dict", "fits", "memory", "torch_dtype", "from_dict", "validate", "checkpoint", "fused_parts"))}
    assert not loading, f"dense.py defines loading code: {sorted(loading)}"
    assert {"DenseConfig", "DenseDecoder", "KVCache", "Attention", "State", "GatedDeltaNet", "ShortConv"} <= names
