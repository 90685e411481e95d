"""The CUDA path: what can be checked without a GPU runs here on the CPU (the lazy, in-process compile path through
more variants than Dynamo's default limit; tensors made on the inputs' device; kernel layouts made again after a move;
attention over grouped heads with a mask; the done-check every 8 tokens). Tests marked `cuda` need a GPU and are
skipped without one (bench/gpu.sh runs them)."""

import copy
import math

import pytest
import torch
from conftest import random_model, rel_err

import dense
import layer_kinds
from dense_engine.cpu import quantized
from dense_engine.runtime import caches, generate, speculative
from dense_engine.runtime import steps as steps_module

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def reference_attention(q, k, v, mask, scale, softcap=None):
    """Grouped heads by copying K/V, softmax written out, float64."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    return scores.masked_fill(~mask, -math.inf).softmax(-1) @ v


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("mask_kind", ["causal", "shared", "per_row"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_attention_folds_query_groups_without_copying_keys(heads, kv_heads, mask_kind, softcap):
    """With a mask, dense.attention folds each K/V head's query heads into its query rows (SDPA then sees equal head
    counts: the kernels that take a mask, no K/V copies), as layer_kinds.capped_attention does for soft-capped scores;
    the result is grouped-query attention's."""
    torch.manual_seed(0)
    T, A = (5, 5) if mask_kind == "causal" else (3, 9)
    q = torch.randn(2, heads, T, 16, dtype=torch.float64)
    k, v = torch.randn(2, kv_heads, A, 16, dtype=torch.float64), torch.randn(2, kv_heads, A, 16, dtype=torch.float64)
    mask = None
    if mask_kind == "shared":
        mask = torch.rand(T, A) < 0.7
    elif mask_kind == "per_row":
        mask = torch.rand(2, 1, T, A) < 0.7
    if mask is not None:
        mask[..., 0] = True
    added = None if mask is None else dense.additive(mask, q.dtype)
    got = dense.attention(q, k, v, added, 0.25) if softcap is None else \
        layer_kinds.capped_attention(q, k, v, added, 0.25, softcap, None)
    assert (got - reference_attention(q, k, v, mask, 0.25, softcap)).abs().max() < (1e-12 if softcap is None else 1e-6)


def test_lazy_steps_pass_more_variants_than_the_recompile_limit(monkeypatch):
    """CUDA's compile path (torch.compile in the process, one graph per bucket and sampling kind, nothing saved), run
    on the CPU: 12 decode variants of one step function (Dynamo stops at 8 per code object with fullgraph=True)
    compile without error, give the eager tokens, and each says so on the status line and in compile_s. (Dynamo's
    tracing and guards are what is tested; the graphs run through its eager backend to keep the test short.)"""
    monkeypatch.setitem(steps_module.LAZY_OPTIONS, "cpu", {"backend": "eager"})
    model = random_model(context=2048).to(torch.bfloat16)  # (bfloat16: dense.py's cache, whose steps are bucketed)
    caches.setup_cache(model, 2, 2048)
    status = []
    steps = steps_module.Steps(model, status=status.append, saved=False)
    compiled, eager = generate.Runner(model, steps), generate.Runner(model, None)
    token = torch.tensor([[5], [7]])
    settings = ({"temperature": 0.0}, {"temperature": 0.8}, {"temperature": 0.8, "top_k": 5})
    positions = (3, 300, 700, 1500)  # buckets 256, 512, 1024, 2048
    assert len({generate.bucket_for(p + 1, 2048) for p in positions}) * len(settings) > 8
    for pos in positions:
        for setting in settings:
            seeded = lambda: tuple(torch.Generator().manual_seed(row) for row in range(2))
            got = compiled.decode(token, pos, None, generate.Sampling(**setting, generators=seeded()))
            want = eager.decode(token, pos, None, generate.Sampling(**setting, generators=seeded()))
            assert torch.equal(got, want), (pos, setting)
    assert steps.compiled == 12 and len(status) == 12 and steps.compile_s > 0
    assert all("Compiling the decode step" in s for s in status)
    # a new temperature is an input of the same graph: no 13th compile
    compiled.decode(token, 3, None, generate.Sampling(temperature=0.3))
    assert steps.compiled == 12


def test_generation_makes_its_tensors_on_the_inputs_device():
    """Every tensor the sampling, generation and speculative functions make is on the model's device: with the
    default device set to `meta`, a tensor made without an explicit device would be a meta tensor, and mixing it with
    the CPU model's tensors or reading it fails; the outputs are those of a normal run."""
    model, draft_model = random_model(), random_model(seed=3)
    prompt, repeating = torch.tensor([[3, 9, 27, 4]]), torch.tensor([[3, 9, 3, 9, 3]])
    lookup = speculative.LookupDraft()

    def run():
        torch.manual_seed(0)
        return [generate.generate(model, prompt, 10), generate.generate(model, [[1, 2, 3], [4]], 8, eos_id=5),
                generate.generate(model, prompt, 10, temperature=0.9, top_k=20, top_p=0.9),
                speculative.generate(model, repeating, 10, lookup),
                speculative.generate(model, repeating, 10, lookup, temperature=1.0),
                speculative.generate(model, repeating, 10, speculative.ModelDraft(draft_model), temperature=1.0,
                                     top_k=10)]

    plain = run()
    with torch.device("meta"):
        on_meta_default = run()
    for a, b in zip(plain, on_meta_default):
        assert all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, list) else torch.equal(a, b)


@pytest.mark.parametrize("mode", ["int8", "int4", "nf4"])
def test_a_moved_quantized_model_makes_its_kernel_layouts_again(mode):
    """model.to(...) drops the kernel layouts made for the device it left and makes them from the stored tensors for
    the new one: a CPU layout never reaches a GPU's forward. Here: a cast (layouts made again, same logits) and a
    move to `meta` (no kernel layout there, and none of the CPU's left behind)."""
    model = quantized.quantize_model(random_model(), mode)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        before = model(ids)
    recast = copy.deepcopy(model).to(torch.float32)
    with torch.no_grad():
        assert rel_err(recast(ids), before) < 1e-6
    layers = [m for m in model.modules() if isinstance(m, quantized.QuantLinear)]
    assert any(name.startswith("kernel_") for m in layers for name in m._buffers)  # (the CPU layouts were there)
    moved = copy.deepcopy(model).to("meta")
    assert not [name for m in moved.modules() for name in m._buffers if name.startswith("kernel_")]
    if mode == "nf4":
        assert all(m.code.device.type == "meta" for m in moved.modules() if isinstance(m, quantized.NF4Linear))


def test_a_cast_keeps_fp8_weights_and_scales_as_stored():
    """model.to(torch.bfloat16), as a GPU load casts: an fp8 layer's float8 values and float32 scales stay as stored
    (they are floating dtypes a cast would otherwise round), and the cast model's logits are the float32 one's within
    bfloat16's rounding."""
    model = quantized.quantize_model(random_model(), "fp8")
    ids = torch.tensor([[1, 5, 9, 2]])
    cast = copy.deepcopy(model).to(torch.bfloat16)
    layers = [m for m in cast.modules() if isinstance(m, quantized.Float8Linear)]
    assert layers and all(m.weight.dtype == torch.float8_e4m3fn and m.scales.dtype == torch.float32 for m in layers)
    original = [m for m in model.modules() if isinstance(m, quantized.Float8Linear)]
    assert all(torch.equal(a.weight.float(), b.weight.float()) for a, b in zip(layers, original))
    with torch.no_grad():
        assert rel_err(cast(ids).float(), model(ids)) < 3e-2


def test_done_is_read_every_8_tokens_with_the_same_result():
    """collect() reads whether every row is done (a host sync on a GPU) every 8 tokens there; the tokens after the
    last row finished are dropped, so the result equals reading it every token."""
    model = random_model()
    prompts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    free = generate.generate(model, prompts, 20)
    eos = free[:, 3 + 3].tolist()  # each row's 4th new token: every row is done by then
    every = [generate.collect(generate.generate_tokens(model, prompts, 20), prompts, eos, model.device,
                              check_every=n) for n in (1, 8)]
    assert torch.equal(every[0], every[1]) and every[0].shape[1] <= 3 + 4
    rows = [[1, 2, 3], [4]]
    every = [generate.collect(generate.generate_tokens(model, rows, 20), rows, eos, model.device, check_every=n)
             for n in (1, 8)]
    assert all(torch.equal(a, b) for a, b in zip(*every))


def test_ahead_gives_the_tokens_in_order():
    tokens = [torch.tensor([[i], [i + 10]]) for i in range(5)]
    assert list(generate.ahead(iter(tokens))) == [[i, i + 10] for i in range(5)]


# ----------------------------------------------------------------------------------------------------------------
# On a GPU


@cuda
@pytest.mark.parametrize("mode", ["none", "int8", "int4", "nf4"])
def test_cuda_logits_match_the_cpu_in_every_mode(mode):
    """bfloat16 on CUDA, quantized on the CPU and moved or quantized there, against CPU float32."""
    base = random_model(hidden_size=128, intermediate_size=256, head_dim=32)
    cpu = base if mode == "none" else quantized.quantize_model(copy.deepcopy(base), mode)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = cpu(ids)
        moved = copy.deepcopy(cpu).to("cuda", torch.bfloat16)
        direct = copy.deepcopy(base).to("cuda", torch.bfloat16)
        direct = direct if mode == "none" else quantized.quantize_model(direct, mode)
        for model in (moved, direct):
            assert rel_err(model(ids.cuda()), reference) < 3e-2


@cuda
def test_cuda_compiled_generation_matches_eager():
    """Compiled bfloat16 decoding on CUDA picks, at every step, one of the CPU float32 model's best tokens (within the
    CPU checks' tolerance: different reductions may flip a near-tie, and then the sequences go apart), as eager does."""
    base = random_model(hidden_size=128, intermediate_size=256, head_dim=32)
    model = copy.deepcopy(base).to("cuda", torch.bfloat16)
    prompt = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(0)).cuda()
    for out in (generate.generate(model, prompt, 12), generate.generate(model, prompt, 12, compile=True)):
        assert near_best(base, out[0].cpu(), 20) == 12
    sampled = speculative.generate(model, torch.tensor([[3, 9, 3, 9, 3]], device="cuda"), 12,
                                   speculative.LookupDraft(), temperature=1.0)
    assert sampled.shape == (1, 17) and sampled.device.type == "cuda"


@cuda
def test_cuda_int8_layer_is_the_float_product(fresh_dynamo):
    """The int8 layer on CUDA, compiled, at one row (decode) and 40 (prefill): the product with its dequantized
    weight, and never routed to aten._weight_int8pack_mm."""
    check_int8_layer_compiled("cuda")


def near_best(reference, row: torch.Tensor, start: int, tolerance: float = 3e-2) -> int:
    """How many of row's tokens from `start` on the reference (no cache, float32) rates within tolerance (relative
    to its largest logit) of its best token."""
    with torch.no_grad():
        logits = reference(row[None, :-1])[0].float()
    chosen = logits[start - 1:].gather(-1, row[start:, None])[:, 0]
    return int((logits[start - 1:].max(-1).values - chosen <= tolerance * logits.abs().max()).sum())


def check_int8_layer_compiled(device: str) -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.02
    layer = quantized.Int8Linear(256, 96, False)
    for key, t in layer.stored(w).items():
        layer._buffers[key] = t
    layer = layer.to(device)  # (on the CPU too: no kernel layout made here, so the layer's own path runs)
    for name in [n for n in layer._buffers if n.startswith("kernel_")]:
        del layer._buffers[name]
    compiled = torch.compile(layer, dynamic=False)
    for rows in (1, 40):
        x = torch.randn(1, rows, 256, device=device).to(torch.bfloat16)  # [B, T, C], as the model's
        want = torch.nn.functional.linear(x.double(), layer.dequantize(torch.float64))
        assert rel_err(compiled(x), want) < 1e-2
    assert counters["inductor"]["woq_matcher_count"] == 0


def test_int8_layer_compiles_without_the_slow_int8_kernel(fresh_dynamo):
    """The CUDA int8 path (the layer's dequantize-and-matmul) compiled here on the CPU, where Inductor runs the same
    pattern pass: with float32 scales it stays a matmul on the converted weight (fused on a GPU), and the control
    shows the pass would route bfloat16 scales to aten._weight_int8pack_mm."""
    from torch._dynamo.utils import counters

    check_int8_layer_compiled("cpu")
    w, scales = torch.randint(-127, 128, (96, 256), dtype=torch.int8), torch.rand(96).to(torch.bfloat16)
    slow = torch.compile(lambda x: torch.nn.functional.linear(x, w.to(x.dtype)) * scales, dynamic=False)
    slow(torch.randn(1, 1, 256).to(torch.bfloat16))
    assert counters["inductor"]["woq_matcher_count"] > 0


@pytest.mark.slow
def test_gpu_check_leaves_the_reference_on_the_cpu(tmp_path, monkeypatch):
    """bench/gpu.py's check moves copies to the device: the CPU float32 reference stays as it was (Module.to works in
    place; moving the reference itself would feed CPU ids to a CUDA model, or, in a dry run, compare bfloat16 with
    bfloat16), and every check of the dry run passes."""
    import importlib.util
    import json
    import os
    import types

    path = os.path.join(os.path.dirname(__file__), "..", "bench", "gpu.py")
    spec = importlib.util.spec_from_file_location("gpu_plan", path)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    monkeypatch.setitem(steps_module.LAZY_OPTIONS, "cpu", {"backend": "eager"})  # (Dynamo traced; Inductor not run)
    plan = gpu.Plan(types.SimpleNamespace(dry_run=True, out=str(tmp_path)))
    reference = gpu.check(plan, "tiny", None)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in reference.parameters())
    with open(tmp_path / "gpu.json") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) > 10 and plan.failures == 0, [r for r in rows if r.get("ok") is False]
