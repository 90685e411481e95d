"""The Qwen mixtures whose layers keep a state (formats/families/qwen3_5.py with experts.py): Qwen3.5-MoE (its text
model, and the Hub's image-text folder) and Qwen3-Next, Gated DeltaNet and gated full-attention layers with experts and
a shared expert behind a sigmoid gate. Tiny random models made with transformers are the oracle; the cached steps
with rows choosing different experts are checked against the plain pass."""

import shutil

import pytest
import torch
import transformers
from test_experts import assert_transformers_logits_and_tokens, loaded, prompt, saved

from dense_engine.formats import load
from dense_engine.runtime import generate

QWEN = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_key_head_dim": 8, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "max_position_embeddings": 512, "eos_token_id": 2, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 40}
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
          "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}
CASES = {  # name: (transformers class, its config, the seed of its weights)
    # three Gated DeltaNet layers to one full-attention layer, every MLP a mixture
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", transformers.Qwen3_5MoeTextConfig(num_hidden_layers=4, **QWEN), 20),
    # the image-text folder (the text model under model.language_model, a vision tower), the layers alternating
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", transformers.Qwen3_5MoeConfig(
        text_config=dict(layer_types=["linear_attention", "full_attention"] * 2, num_hidden_layers=4, **QWEN),
        vision_config=VISION), 21),
    # the Gated DeltaNet's projections fused by key head (two value heads each), a dense layer (mlp_only_layers), the
    # top-k not renormalized
    "qwen3_next": ("Qwen3NextForCausalLM", transformers.Qwen3NextConfig(
        num_hidden_layers=4, intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False, **QWEN), 25),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return saved(tmp_path_factory.mktemp("experts_qwen"), CASES)


@pytest.fixture(scope="module")
def models(folders):
    return loaded(folders)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_equal_transformers(folders, models, case):
    """(transformers runs the delta rule in float32 whatever the model's dtype, as this engine does: the two agree to
    float32's rounding, which these random layers magnify to a few 1e-5 of the largest logit)"""
    assert_transformers_logits_and_tokens(folders[case][1], models[case])


def test_each_family_reads_into_the_router_and_experts_it_has(models):
    kinds = {name: [type(layer.mlp).__name__ for layer in model.layers] for name, model in models.items()}
    assert kinds["qwen3_5_moe_text"] == kinds["qwen3_5_moe"] == ["Experts"] * 4
    assert kinds["qwen3_next"] == ["Experts", "GatedMLP", "Experts", "Experts"]  # (mlp_only_layers)
    assert [type(layer.mixer).__name__ for layer in models["qwen3_5_moe"].layers] == ["GatedDeltaNet", "Attention"] * 2
    spec = {name: model.config.extras["experts"] for name, model in models.items()}
    assert spec["qwen3_5_moe"].renormalize and not spec["qwen3_next"].renormalize
    assert all(s.shared_gate and s.shared_width == 40 and (s.count, s.chosen) == (8, 2) for s in spec.values())
    assert models["qwen3_next"].layers[1].mlp.width == 48


def test_cached_steps_with_rows_choosing_different_experts_equal_the_plain_pass(models):
    """A prompt in chunks (padding to the scratch slot) on row 1 of 3 while rows 0 and 2 hold other sequences, then
    decode steps of all three rows at once, each row going on with its own sequence (its own experts, its own
    state): each row's plain pass."""
    model = models["qwen3_5_moe_text"]
    S, chunk = 96, 16
    model.setup_cache(3, S)
    ids, others = prompt(45, seed=1), prompt(45, seed=2, batch=3)
    with torch.no_grad():
        want, alone = model(ids)[0], model(others)[[0, 2], 37:]
        model(others[:, :37], torch.arange(37))  # rows 0..2 hold others' states
        got, beside = [], []
        for start in range(0, 37, chunk):  # 37 prompt tokens: chunks of 16, 16 and 5 + 11 padding
            n = min(chunk, 37 - start)
            pos = torch.cat([torch.arange(start, start + n), torch.full((chunk - n,), S)])
            piece = torch.cat([ids[:, start:start + n], torch.zeros(1, chunk - n, dtype=torch.long)], 1)
            got.append(model(piece, pos, rows=torch.tensor([1]))[0, :n])
        experts = model.layers[0].mlp
        chosen = []  # each decode step's experts of the first layer [3, 2]
        hook = experts.register_forward_pre_hook(lambda m, args: chosen.append(m.route(args[0].flatten(0, 1))[1]))
        for t in range(37, 45):  # (a state moves on at every step: each row its next token, at its own position)
            step = torch.stack([others[0, t:t + 1], ids[0, t:t + 1], others[2, t:t + 1]])
            out = model(step, torch.tensor([[t], [t], [t]]))
            got.append(out[1])
            beside.append(out[[0, 2]])
        hook.remove()
    assert all(len({tuple(sorted(row)) for row in c.tolist()}) > 1 for c in chosen)  # (the rows' experts differ)
    # (relative to the largest logit, as against transformers: these random Gated DeltaNet layers magnify float32's
    # rounding, which differs where the prompt is cut into other chunks)
    assert (torch.cat(got) - want).abs().max() / want.abs().max() < 1e-4
    assert (torch.cat(beside, 1) - alone).abs().max() / alone.abs().max() < 1e-4


def test_an_mtp_layer_with_experts_drafts_as_its_transformers_layer(folders, tmp_path):
    """Qwen3.5-MoE's multi-token prediction layer (mtp.*: a full-attention layer whose MLP is a mixture, its experts
    stacked as transformers 5 holds them) read into the draft of --draft mtp (speculative.MultiTokenPredictor): on
    the target's hidden states, the logits of the same layer built of transformers' own modules."""
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

    from dense_engine.formats import convert
    from dense_engine.runtime import speculative

    folder, hf_model = folders["qwen3_5_moe_text"]
    config, C = hf_model.config, hf_model.config.hidden_size
    full = config.layer_types.index("full_attention")
    torch.manual_seed(0)
    mtp = torch.nn.ModuleDict({
        "fc": torch.nn.Linear(2 * C, C, bias=False), "pre_fc_norm_embedding": qwen.Qwen3_5MoeRMSNorm(C),
        "pre_fc_norm_hidden": qwen.Qwen3_5MoeRMSNorm(C), "norm": qwen.Qwen3_5MoeRMSNorm(C),
        "layers": torch.nn.ModuleList([qwen.Qwen3_5MoeDecoderLayer(config, full)])})
    with torch.no_grad():
        for key, t in mtp.named_parameters():
            if "norm" not in key:
                t.normal_(0, 0.5 if "gate.weight" in key else 0.15)
    weights = load_file(f"{folder}/model.safetensors")
    weights.update({f"mtp.{k}": v.contiguous() for k, v in mtp.state_dict().items()})
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(f"{folder}/config.json", tmp_path)
    model = load.from_pretrained(str(tmp_path), dtype=torch.float32)
    draft = speculative.mtp_draft(model, convert.read_checkpoint(str(tmp_path)), None)
    assert type(draft.predictor.layers[0].mlp).__name__ == "Experts"
    model.setup_cache(1, 64)
    ids = prompt(40, seed=3)
    with torch.no_grad():
        hidden = generate.Runner(model, None).prefill_hidden(ids, 0)[0][:-1]  # h_i, after the model's norm
        draft.attach(generate.Runner(model, None))
        got = model.logits(draft.run(ids[0, 1:].tolist(), hidden, 0))
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(hf_model.model.embed_tokens(ids[:, 1:])),
                              mtp.pre_fc_norm_hidden(hidden[None])], -1))
        T = x.shape[1]
        rope, mask = hf_model.model.rotary_emb(x, torch.arange(T)[None]), torch.full((T, T), -torch.inf).triu(1)
        x = mtp.layers[0](x, position_embeddings=rope, attention_mask=mask[None, None])
        want = hf_model.lm_head(mtp.norm(x))[0]
    assert (got - want).abs().max() / want.abs().max() < 1e-4
