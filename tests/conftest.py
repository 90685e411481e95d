import os
import sys

# The suite runs two workers on two cores, and the programs they start beside them: more threads than cores. OpenMP's
# threads (PyTorch's and the kernels') that wait for work sleep rather than spin: a spinning thread takes the core
# another process needs (BENCHMARKS.md, the suite's time). Set before torch loads OpenMP; the workers and the programs
# they start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Programs started by the tests compile their steps before answering, as they did before background compiles
# (tests/test_background.py turns them on where it tests them): no worker process outlives a test.
os.environ.setdefault("DENSE_BACKGROUND_COMPILE", "0")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
sys.path.insert(0, ROOT)

# Each layout a checkpoint can arrive in, with the path from_pretrained takes and the fixture holding its references.
LAYOUTS = {
    "shellelastic": "shellelastic",
    "sprout": "sprout/ckpt.pt",
    "germangpt": "germangpt/checkpoint.pt",
    "openelm": "openelm",
    "gptneox": "gptneox",
    "neox_original": "neox_original",
    "llama": "llama",
}


# Tests that build the kernels of instruction sets other than the machine's own (minutes of compiling): .ci/kernels
# runs them, once, beside the kernel tests on each build (DENSE_KERNEL_BUILDS=1)
other_builds = pytest.mark.skipif(os.environ.get("DENSE_KERNEL_BUILDS") != "1",
                                  reason="builds other instruction sets' kernels: .ci/kernels runs it")


def fixture_path(layout: str) -> str:
    return os.path.join(FIXTURES, LAYOUTS[layout])


def expected(layout: str) -> dict:
    return load_file(os.path.join(FIXTURES, LAYOUTS[layout].split("/")[0], "expected.safetensors"))


def with_kernels(cache):
    """A fresh cache folder (XDG_CACHE_HOME) holding a copy of the CPU kernels the suite built: a program started
    on it answers without building them again (about 15 s each). Not for the tests of the build itself."""
    import shutil

    from dense_engine.cpu import kernels

    if kernels.available():
        built = os.path.dirname(kernels.library())  # (<cache>/dense-engine/kernels/<key>)
        target = os.path.join(str(cache), "dense-engine", "kernels", os.path.basename(built))
        if not os.path.isdir(target):
            shutil.copytree(built, target)
    return cache


def answer(text: str) -> str:
    """What a one-shot prints for an answer: the text with its line closed (for the next program in a pipe)."""
    return text if text.endswith("\n") else text + "\n"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest reference logit."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


# The files that take longest (compiles, processes) start first: the two workers (pyproject's -n 2, a file each at a
# time) then end together instead of one of them finishing the longest file alone
LONGEST_FIRST = ["test_tp.py", "test_background.py", "test_chat.py", "test_steps.py", "test_state_layers.py",
                 "test_reliability.py", "test_families.py", "test_serve.py", "test_quantize.py",
                 "test_default_model.py"]


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # (stable: each file's tests keep their order)


def pytest_sessionstart(session):
    """The CPU kernels built once, before the workers start (each would build them at once)."""
    if not hasattr(session.config, "workerinput"):
        from dense_engine.cpu import kernels

        kernels.available()


@pytest.fixture(autouse=True, scope="module")
def _dynamo_per_module():
    """Each test file starts with Dynamo's caches empty (a reset before every test made every test compile again)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield


@pytest.fixture
def fresh_dynamo():
    """Dynamo reset and its counters cleared, for a test that counts compiles or recompiles."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # its default set again: a config name once deleted (as a mock's undo does) is hidden, and a recompile reads it
    torch._dynamo.config.error_on_recompile = False
    yield


@pytest.fixture(autouse=True)
def _steps_compile(monkeypatch):
    """A step that cannot be compiled runs eagerly for a user, with one note. In a test, "compiled equals eager" would
    then compare eager with itself: the test fails instead, naming the step."""
    from dense_engine.runtime import steps

    compile_now = steps.Steps.compile_now

    def compiled_or_fail(self, path, kind, *args, **kwargs):
        compiled = compile_now(self, path, kind, *args, **kwargs)
        if compiled is None:
            pytest.fail(f"the {kind} step could not be compiled (it would have run eagerly)")
        return compiled

    monkeypatch.setattr(steps.Steps, "compile_now", compiled_or_fail)


def run_alone(scheduler, request) -> list[int]:
    """A server scheduler's turns, driven by hand, until the request (submitted alone) ends: its generated ids."""
    scheduler.submit(request)
    for _ in range(200):
        scheduler.safe_turn()
        if request.finish_reason is not None:
            return list(request.generated)
    raise AssertionError("the request did not finish")


def random_model(context: int = 512, seed: int = 0, **overrides):
    """A small random-weight model (GQA, q/k norm, output gate) with a longer context than the fixtures, whose full
    precision linears run kernels.py as from_pretrained's do."""
    import layer_kinds
    from dense_engine.cpu import quantized
    from dense_engine.formats.checkpoint import make_config

    torch.manual_seed(seed)
    config = make_config("random model", **{"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "head_dim": 16, "max_position_embeddings": context, "rope_precision": "bfloat16",
                                  "qk_norm": "per_channel", "attn_output_gate": True, **overrides})
    model = layer_kinds.Decoder(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return quantized.swap_linears(model.requires_grad_(False), None, {}).eval()
