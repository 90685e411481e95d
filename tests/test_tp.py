"""Tensor parallel (tp.py) on CPU with gloo, two processes, against the single-process model: logits within 1e-5 and
the same greedy tokens for five layouts (eager; compiled for one), the GPT-NeoX original release read shard-per-rank,
int8/int4 shards, state layers (Qwen3.5, LFM2, Mamba2: Granite 4.0 H, Falcon-H1), mixtures of experts, each rank's
weight bytes, and chat.py under torchrun."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, fixture_path, random_model, rel_err

import dense
from dense_engine.cli.benchmark import stored_bytes
from dense_engine.formats import checkpoint, convert, load
from dense_engine.runtime import generate, tp

LAYOUTS = ["shellelastic", "gptneox", "llama", "openelm", "neox_original"]


def loopback() -> dict:
    """gloo over the loopback interface, whatever the machine's hostname resolves to."""
    return {"GLOO_SOCKET_IFNAME": "lo"} if os.path.isdir("/sys/class/net/lo") else {}


def worker(rank, size, rdzv, out, jobs):
    """Each job: (name, path, quant, compile); rank 0 writes {name: results} to out."""
    import faulthandler

    faulthandler.enable()  # (a rank that crashes prints where, in the test's captured stderr)
    os.environ.update(loopback())
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=size)
    from torch._dynamo.utils import counters

    results = {}
    for name, path, quant, compile in jobs:
        print(f"rank {rank}: {name}", file=sys.stderr, flush=True)  # (with faulthandler: which job a crash was in)
        model = tp.from_pretrained(path, quant=quant)
        ids = torch.arange(3, 40).reshape(1, -1) % model.config.vocab_size
        with torch.no_grad():
            logits = model(ids)
        greedy = generate.generate(model, ids[:, :6], 16)
        before = dict(counters["inductor"])
        compiled = generate.generate(model, ids[:, :6], 16, compile=True) if compile else None
        graphs = {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_miss", "fxgraph_cache_hit")}
        results[name] = {"logits": logits, "greedy": greedy, "compiled": compiled, "bytes": stored_bytes(model),
                         "o_proj": model.layers[0].mixer.o_proj.state_dict() if name == "neox_original" else None,
                         "graphs": graphs}
    gathered = [None] * size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out)
    tp.exit(0)  # (as chat.py does under torchrun: no C++ teardown of the group's threads at exit)


def run_two(tmp_path, jobs):
    out = tmp_path / "out.pt"
    torch.multiprocessing.spawn(worker, args=(2, str(tmp_path / "rdzv"), str(out), jobs), nprocs=2)
    return torch.load(out, weights_only=False)


def single(path, quant=None):
    model = load.from_pretrained(path, quant=quant)
    ids = torch.arange(3, 40).reshape(1, -1) % model.config.vocab_size
    with torch.no_grad():
        return model, model(ids), generate.generate(model, ids[:, :6], 16)


@pytest.fixture(scope="module")
def bigger(tmp_path_factory):
    """A native checkpoint whose blocks dominate its size (the embedding is 3% of it), widths that keep every shard
    on the kernels' fast paths."""
    model = random_model(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, bias=False)
    path = str(tmp_path_factory.mktemp("bigger"))
    convert.write_native(path, model.config, {k: v.contiguous() for k, v in load.checkpoint_tensors(model).items()})
    return path


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Checkpoints of families whose switches meet the shards: Gemma 2 (soft-caps, windows, post-norms), Qwen2 (q/k/v
    biases split by heads), StableLM (per-head q/k norms split by heads, partial rotary)."""
    from test_families import write_checkpoint

    root = tmp_path_factory.mktemp("families")
    return {case: write_checkpoint(case, str(root / case)) and str(root / case) for case in ("gemma2", "qwen2",
                                                                                           "stablelm")}


def test_qk_norms_over_every_head_refuse_to_shard():
    config = dense.DenseConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               hidden_size=64, qk_norm="whole")
    with pytest.raises(checkpoint.CheckpointError, match="cannot be split across ranks"):
        tp.plan(config, 0, 2)


@pytest.fixture(scope="module")
def states(tmp_path_factory):
    """Models with state layers: Qwen3.5 (value heads grouped, as transformers stores them, and tiled, as llama.cpp's
    files do; widths that int4 groups of 32 divide per value head) and LFM2."""
    import transformers
    from test_state_layers import LFM2, QWEN, save_random, tile_value_heads

    root, made = tmp_path_factory.mktemp("states"), {}
    qwen = transformers.Qwen3_5TextConfig(vocab_size=512, num_hidden_layers=4,
                                          **{**QWEN, "linear_value_head_dim": 32, "intermediate_size": 128})
    for i, (case, cls, config) in enumerate((("qwen3_5", "Qwen3_5ForCausalLM", qwen),
                                             ("lfm2", "Lfm2ForCausalLM", transformers.Lfm2Config(vocab_size=512,
                                                                                                  **LFM2)))):
        save_random(cls, config, i, root / case)
        made[case] = str(root / case)
    from test_state_layers import CASES, FALCON_H1  # Mamba2: heads and their groups split (Granite 4.0 H, Falcon-H1's
    # attention and Mamba2 in one layer), or one group each rank reads whole (Falcon-H1 without its norm; Granite 4.0
    # H's normed: tp.SpreadNorm)
    mamba = {"granite 4.0 h": CASES["granite 4.0 h"], "falcon-h1": CASES["falcon-h1"],
             "granite 4.0 h one group": ("GraniteMoeHybridForCausalLM", transformers.GraniteMoeHybridConfig(
                 vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                 layer_types=["mamba", "attention", "mamba"], num_local_experts=0, shared_intermediate_size=96,
                 mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16, mamba_d_head=16, mamba_expand=2,
                 position_embedding_type="nope", max_position_embeddings=512, eos_token_id=2)),
             "falcon-h1 one group": ("FalconH1ForCausalLM", transformers.FalconH1Config(**{**FALCON_H1,
                                                                                         "mamba_n_groups": 1}))}
    for i, (case, (cls, config)) in enumerate(mamba.items()):
        save_random(cls, config, 10 + i, root / case.replace(" ", "_"))
        made[case] = str(root / case.replace(" ", "_"))
    tiled = tile_value_heads(load.from_pretrained(made["qwen3_5"]))
    made["qwen3_5 tiled"] = str(root / "tiled")
    convert.write_native(made["qwen3_5 tiled"], tiled.config,
                         {k: v.contiguous() for k, v in load.checkpoint_tensors(tiled).items()})
    return made


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """Gemma 4 (test_gemma4.py's cases): per-layer embeddings with the last two layers reading earlier layers' keys
    and values; full layers of their own head size whose one key/value head (replicated on both ranks) gives keys as
    values, a final soft-cap."""
    from test_gemma4 import CASES
    from test_state_layers import save_random

    root, made = tmp_path_factory.mktemp("gemma4"), {}
    for i, case in enumerate(("per-layer embeddings, shared keys and values", "k = v, final soft-cap")):
        save_random(*CASES[case], 20 + i, root / f"case{i}")
        made[f"gemma4 {case}"] = str(root / f"case{i}")
    return made


@pytest.fixture(scope="module")
def mixtures(tmp_path_factory):
    """Mixtures of experts (test_experts.py's cases), every expert split by its width: Qwen2-MoE (a shared expert
    behind a gate), GLM-4.5's (grouped sigmoid routing, shared experts, a dense first layer, q/k/v biases)."""
    from test_experts import CASES, save_random

    root = tmp_path_factory.mktemp("mixtures")
    for i, case in enumerate(("qwen2_moe", "glm4_moe")):
        save_random(*CASES[case], 30 + i, root / case)
    return {case: str(root / case) for case in ("qwen2_moe", "glm4_moe")}


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path, bigger, families, states, gemma4, mixtures):
    jobs = [(layout, fixture_path(layout), None, layout != "neox_original") for layout in LAYOUTS]
    jobs += [(case, path, None, False) for case, path in families.items()]
    jobs += [("bigger", bigger, None, False), ("int8", bigger, "int8", False), ("int4", bigger, "int4", False),
             ("fp8", bigger, "fp8", False)]
    # state layers: a Gated DeltaNet layer's key heads and the value heads reading them go to one rank
    jobs += [(case, path, None, case in ("qwen3_5", "falcon-h1")) for case, path in states.items()]
    jobs += [("qwen3_5 int4", states["qwen3_5"], "int4", False), ("lfm2 int8", states["lfm2"], "int8", False),
             ("granite 4.0 h int8", states["granite 4.0 h"], "int8", False)]
    jobs += [(case, path, None, i == 0) for i, (case, path) in enumerate(gemma4.items())]
    jobs += [(case, path, None, False) for case, path in mixtures.items()]
    ranks = run_two(tmp_path, jobs)
    for name, path, quant, compile in jobs:
        model, logits, greedy = single(path, quant)
        for r in ranks:
            got = r[name]
            # (quantized: a 37-token pass multiplies in bfloat16, whose rounding depends on how a sum is split)
            tolerance = 1e-2 if quant else 1e-5
            assert rel_err(got["logits"], logits) < tolerance, (name, rel_err(got["logits"], logits))
            assert torch.equal(got["greedy"], greedy), name
            if compile:
                assert torch.equal(got["compiled"], greedy), name
        if compile:  # the ranks compile one at a time: a graph compiled by one is found in the cache by the other
            compiled = sum(r[name]["graphs"]["fxgraph_cache_miss"] for r in ranks)
            assert compiled <= sum(ranks[0][name]["graphs"].values()), (name, [r[name]["graphs"] for r in ranks])
        if name == "bigger":  # each rank holds about half of the blocks, the embedding and norms whole
            assert all(r[name]["bytes"] <= 0.6 * stored_bytes(model) for r in ranks)
    # GPT-NeoX's original two-way release: rank r holds shard r's tensors as they are in its files
    for r, result in enumerate(ranks):
        shard = checkpoint.load_pickle(os.path.join(fixture_path("neox_original"), "global_step150000",
                                                 f"layer_02-model_0{r}-model_states.pt"))
        assert torch.equal(result["neox_original"]["o_proj"]["weight"], shard["attention.dense.weight"])
        # its own row-parallel bias, as stored (a merge would give rank 0 the sum and rank 1 zeros)
        assert torch.equal(result["neox_original"]["o_proj"]["bias"], shard["attention.dense.bias"])


def torchrun(*args, n=2):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                           os.path.join(ROOT, "chat.py"), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **loopback()}, timeout=300, check=False)


@pytest.mark.slow
def test_torchrun_chat_prints_the_single_process_text_and_bad_n_fails_on_every_rank():
    args = ("--ckpt", fixture_path("llama"), "--prompt", "hello there", "--complete", "--temperature", 0,
            "--max-new-tokens", 12, "--no-compile")
    alone = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), *map(str, args)], capture_output=True,
                           text=True, cwd=ROOT, check=False)
    both = torchrun(*args)
    assert both.returncode == 0, both.stderr[-6000:]
    assert both.stdout == alone.stdout != ""  # printed once, by rank 0
    sampled = torchrun(*args[:-5], "--temperature", 1.0, "--max-new-tokens", 12, "--no-compile", "--seed", 3)
    one = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), *map(str, args[:-5]), "--temperature",
                          "1.0", "--max-new-tokens", "12", "--no-compile", "--seed", "3"], capture_output=True,
                         text=True, cwd=ROOT, check=False)
    assert sampled.returncode == 0 and sampled.stdout == one.stdout  # every rank drew rank 0's tokens
    bad = torchrun(*args, n=3)  # 4 heads over 3 ranks
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert bad.returncode != 0 and len(errors) == 3
    assert all("4 attention heads do not divide over 3 ranks" in e for e in errors)


@pytest.mark.slow
def test_torchrun_ctrl_c_stops_a_reply_on_every_rank_and_ends_the_session_at_the_prompt(tmp_path):
    """torchrun ends the job on the terminal's SIGINT: rank 0 reads Ctrl-C as a key instead (one-shot and chat)."""
    import pexpect
    from test_chat import random_chat_model

    ckpt = random_chat_model(tmp_path / "big")

    def spawn(*args):
        return pexpect.spawn(sys.executable, ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                              os.path.join(ROOT, "chat.py"), "--ckpt", str(ckpt), "--temperature",
                                              "1.0", "--seed", "0", "--max-new-tokens", "4000", "--no-compile", *args],
                             cwd=ROOT, encoding="utf-8", timeout=120, dimensions=(40, 200),
                             env={**os.environ, "TERM": "dumb", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                                  **loopback()})

    one = spawn("--prompt", "tell me a long story", "--stats")  # one-shot: Ctrl-C ends the reply, exit status 0
    one.expect(r"weights: [\s\S]*?\)\)")  # the load's notice: the reply comes next
    one.expect(r"\S{3}")
    one.sendintr()
    one.expect(r"(\d+) tokens, .*\(interrupted\)")
    assert int(one.match.group(1)) < 4000
    one.expect(pexpect.EOF)
    one.close()
    assert one.exitstatus == 0, one.before
    child = spawn()
    child.expect(">>> ")
    child.sendline("tell me a long story")
    child.expect(r"\S{3}")  # the reply has started streaming
    child.sendintr()  # torchrun would end the job on SIGINT: rank 0 reads the key and every rank stops
    child.expect(r"(\d+) tokens, .*\(interrupted\)")
    assert int(child.match.group(1)) < 4000
    child.expect(">>> ")
    child.sendline("/help")  # both ranks are still in step
    child.expect("/reset")
    child.expect(">>> ")
    child.send("half a line")
    child.sendintr()  # Ctrl-C at the prompt ends the session cleanly, as in one process
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
