"""Mixtures of experts in the hybrid families (formats/families/granite_hybrid.py, nemotron_h.py, lfm2.py): tiny random
models made with transformers, each with both of its mixer kinds and with dense and expert layers, are the oracle for
the router, the experts and what runs beside them, as tests/test_experts.py's are for the Llama-layout rows."""

import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import save_file
from test_experts import assert_transformers_logits_and_tokens, loaded, prompt, saved

import dense
import layer_kinds
from dense_engine.formats import load

MAMBA = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16}  # (as test_state_layers)
SMALL = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 512, "eos_token_id": 2}
CASES = {  # name: (transformers class, its config, seed)
    # Mamba2 layers around an attention one, Granite's four multipliers; 8 experts (top 2, a softmax over the chosen)
    # in every layer, its shared MLP added beside them
    "granite 4.0 h": ("GraniteMoeHybridForCausalLM", transformers.GraniteMoeHybridConfig(
        **SMALL, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"], num_local_experts=8,
        num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=48, mamba_expand=2, **MAMBA,
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0,
        position_embedding_type="nope"), 1),
    # blocks (M E) (* E) (M) (M -): squared-ReLU experts (a sigmoid router, a choice bias, 4 groups of which 2 kept,
    # a routed scale of 2.5) and a squared-ReLU shared expert, a dense MLP block, a layer with no MLP
    "nemotron-h": ("NemotronHForCausalLM", transformers.NemotronHConfig(
        **SMALL, head_dim=16, layers_block_type=["mamba", "moe", "attention", "moe", "mamba", "mamba", "mlp"],
        intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16), 2),
    # short convs around an attention layer; a dense first layer, then SwiGLU experts (a sigmoid router, a choice
    # bias, renormalized, a routed scale)
    "lfm2-moe": ("Lfm2MoeForCausalLM", transformers.Lfm2MoeConfig(
        **SMALL, num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"], intermediate_size=96,
        moe_intermediate_size=32, num_dense_layers=1, num_experts=8, num_experts_per_tok=2,
        routed_scaling_factor=1.5), 3),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return saved(tmp_path_factory.mktemp("experts_hybrid"), CASES)


@pytest.fixture(scope="module")
def models(folders):
    return loaded(folders)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_equal_transformers(folders, models, case):
    assert_transformers_logits_and_tokens(folders[case][1], models[case])


def test_each_family_reads_into_the_experts_it_has(models):
    """What the readers chose, seen on the built models (a reader that ignored a key would be caught even where
    random weights hid it)."""
    kinds = {name: [type(layer.mlp).__name__ for layer in model.layers] for name, model in models.items()}
    assert kinds == {"granite 4.0 h": ["Experts"] * 4, "nemotron-h": ["Experts", "Experts", "NoneType", "MLP"],
                     "lfm2-moe": ["GatedMLP", "Experts", "Experts", "Experts"]}
    spec = {name: model.config.extras["experts"] for name, model in models.items()}
    granite, nemotron, lfm2 = spec["granite 4.0 h"], spec["nemotron-h"], spec["lfm2-moe"]
    assert (granite.scoring, granite.renormalize, granite.shared_width, granite.shared_gate) == ("softmax", True, 48,
                                                                                                 False)
    assert (nemotron.scoring, nemotron.choice_bias, nemotron.groups, nemotron.routed_scale, nemotron.activation,
            nemotron.shared_width, nemotron.dense_layers) == ("sigmoid", True, (4, 2), 2.5, "relu2", 48, (2, 3))
    assert (lfm2.scoring, lfm2.choice_bias, lfm2.renormalize, lfm2.routed_scale, lfm2.dense_layers) == (
        "sigmoid", True, True, 1.5, (0,))
    shared = models["nemotron-h"].layers[0].mlp.shared  # (squared ReLU, up and down alone)
    assert isinstance(shared, dense.MLP) and isinstance(shared.act, layer_kinds.ReLU2)
    assert models["granite 4.0 h"].layers[1].mlp.shared.width == 48


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_own_stacked_names_give_the_same_model(folders, models, case, tmp_path):
    """A folder of transformers 5's own names (its state dict: the experts stacked, Granite's router as
    router.weight, Nemotron-H's layers under model.) is read as the Hub's names are."""
    folder, reference = folders[case]
    shutil.copy(os.path.join(folder, "config.json"), tmp_path)
    state = {name: t.contiguous() for name, t in reference.state_dict().items()}
    if reference.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    assert any("experts.gate_up_proj" in n or "experts.up_proj" in n for n in state)
    ids = prompt(24, seed=5)
    with torch.no_grad():
        got, want = load.from_pretrained(str(tmp_path), dtype=torch.float32)(ids), models[case](ids)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()  # (the same weights; where they lie in memory may
    # change a kernel's order of sums)
