"""The module layout: every import between the project's modules points one way (down from the programs to dense.py),
counting imports made inside functions, and dense.py imports nothing of the project."""

import ast
import glob
import os

from conftest import ROOT


def project_imports() -> dict[str, set[str]]:
    """{module: the project modules it imports anywhere in its file (top level or inside functions)}."""
    modules = {os.path.basename(p)[:-3]: p for p in glob.glob(os.path.join(ROOT, "*.py"))}
    graph = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
        graph[name] = {m for m in found if m in modules and m != name}
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
    assert {"dense", "kernels", "load", "generate", "chat"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_dense_imports_only_torch():
    assert project_imports()["dense"] == set()


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_dense_holds_the_model_not_its_loading():
    """dense.py defines the model, its cache and sampling; reading, checking and loading checkpoints (and memory checks)
    live in checkpoint.py, load.py and machine.py."""
    with open(os.path.join(ROOT, "dense.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    loading = {n for n in names if any(word in n.lower() for word in (
        "load", "state_dict", "fits", "memory", "torch_dtype", "from_dict", "validate", "checkpoint", "fused_parts"))}
    assert not loading, f"dense.py defines loading code: {sorted(loading)}"
    assert {"DenseConfig", "DenseDecoder", "KVCache", "Attention", "sample"} <= names
