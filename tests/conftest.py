import os
import sys

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


def fixture_path(layout: str) -> str:
    return os.path.join(FIXTURES, LAYOUTS[layout])


def expected(layout: str) -> dict:
    return load_file(os.path.join(FIXTURES, LAYOUTS[layout].split("/")[0], "expected.safetensors"))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest reference logit."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
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
    import dense
    from dense_engine.cpu import quantized

    torch.manual_seed(seed)
    config = dense.DenseConfig(**{"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                  "max_position_embeddings": context, "rope_precision": "bfloat16",
                                  "qk_norm": "per_channel", "attn_output_gate": True, **overrides})
    model = dense.DenseDecoder(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return quantized.swap_linears(model.requires_grad_(False), None, {}).eval()
