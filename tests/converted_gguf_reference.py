"""Makes tests/fixtures/converted_gguf/: tiny random models written by llama.cpp's own converter (NAME.gguf), and
llama.cpp's logits and token ids on them (NAME.json; run once, where llama-cpp-python and its sdist's converter are
at hand):

    python tests/converted_gguf_reference.py --llama-python VENV/bin/python --llama-src SDIST/vendor/llama.cpp

gemma4 (transformers' Gemma4ForCausalLM): six layers, sliding ones of head size 16 and full ones (layers 3 and 5)
of 32 with one key/value head and their keys as values (attention_k_eq_v), per-layer embeddings of 8, the last two
layers reading layers 2 and 3's keys and values with MLPs twice as wide, a final soft-cap of 0.05 (small enough to
bend these logits), layer scalars 0.5 + 0.1 i; weights of std 0.05. The fixture llama's tokenizer, made BPE with byte
fallback as the converter's Gemma 4 vocabulary reader requires.

granitehybrid (GraniteMoeHybridForCausalLM, tests/test_state_layers.py's "granite 4.0 h"): Mamba2 layers (A_log,
dt_bias and D drawn in [-1, 1]) around one attention layer without rope, Granite's multipliers; num_experts_per_tok 0
and intermediate_size the MLP's (else the converter writes an expert count and an FFN width llama.cpp then refuses),
layer_types as the Hub's configs name them; the fixture llama's tokenizer, its pre-tokenizer named "gpt-2" for the
converter (which knows the Hub's tokenizers by hash).

nemotron_h (NemotronHForCausalLM, tests/test_state_layers.py's "nemotron-h"): blocks M - * - M M -, its config.json as
the Hub's dense releases write it (hybrid_override_pattern, num_hidden_layers, no experts' keys), read by the
converter as written (with transformers 5.25 installed, the converter's AutoConfig fills in the experts' defaults and
writes nemotron_h_moe).

falcon-h1 (FalconH1ForCausalLM, tests/test_state_layers.py's "falcon-h1 normed"): attention and Mamba2 in each of
three layers, every muP multiplier away from 1 (the converter folds them into the weights), the SSM's output normed by
groups after its gate; weights as granitehybrid's.

granite_swa (transformers' granite_swa): four layers, the first full and the rest sliding (a window of 8), layer 1
without rope and the others of one base (llama.cpp reads one base), learned sinks, Granite's four multipliers; its
config.json as llama.cpp's converter reads it (the architecture named GraniteSWAForCausalLM, no_rope_layers: 1 where
a layer rotates); weights of std 0.15, gains in [0.5, 1.5].

mistral3 (Ministral3ForCausalLM): two layers, yarn (factor 16 over an original context of 64, mscale and
mscale_all_dim 1, Ministral 3's llama_4_scaling_beta 0.1: 1 within the original context), untied; weights of std 0.2,
queries' and keys' 0.4 (scores sharp enough that yarn shows: its cos and sin 10% larger move the logits 1%).

command-r (CohereForCausalLM, Command R v1): two layers, layer norms without bias (gains in [0.5, 1.5]) before the
parallel attention and MLP, interleaved rope, a logit scale of 0.3, tied; weights of std 0.2, queries' and keys' 0.4.

gemma4-q8_0: gemma4 with per-layer embeddings of 16 (the table's rows whole Q8_0 blocks), converted with --outtype
q8_0: the per-layer table in Q8_0 blocks, as a quantized file holds it (llama.cpp's quantizer gives it the token
embedding's type).

Each other one converted with --outtype f16.

lora (--only lora): a tiny random Llama (LlamaForCausalLM: two layers, 64 wide, weights of std 0.05) converted with
--outtype f16 (lora-base.gguf) and q8_0 (lora-base-q8_0.gguf), a PEFT LoRA adapter of it (rank 4, alpha 8, on q, k,
v, o, gate, up, down; B of std 0.05) saved as PEFT saves it (lora-peft/) and converted by llama.cpp's
convert_lora_to_gguf.py (lora-adapter.gguf, f32), and llama.cpp's logits on each base with the adapter (lora.json:
logits, logits_q8_0)."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures", "converted_gguf")
IDS = [1, 5, 17, 33, 100, 7, 250, 3, 64, 90, 11, 400, 12, 8, 77, 301, 2, 45, 9, 500]
TEXTS = ["Hello,world!", "a\n\nb", "<|im_start|>user"]
LLAMA = r'''
import json, sys
from llama_cpp import Llama
path, ids, texts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = Llama(model_path=path, logits_all=True, n_ctx=64, n_threads=2, verbose=False, type_k=0, type_v=0)
llm.eval(ids)
tokens = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]
print(json.dumps({"logits": [list(map(float, row)) for row in llm.scores[:len(ids)]], "tokens": tokens}))
'''


def make_gemma4(folder: str, per_layer: int = 8) -> None:
    import torch
    import transformers

    kinds = ["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"]
    config = transformers.Gemma4TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, sliding_window=6, max_position_embeddings=256, eos_token_id=2,
        num_hidden_layers=6, layer_types=kinds, hidden_size_per_layer_input=per_layer, vocab_size_per_layer_input=512,
        num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=0.05, attention_k_eq_v=True)
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.5 + 0.1 * i)
    model.save_pretrained(folder)
    shutil.copy(os.path.join(HERE, "fixtures", "llama", "tokenizer_config.json"), folder)
    with open(os.path.join(HERE, "fixtures", "llama", "tokenizer.json")) as f:
        tokenizer = json.load(f)
    tokenizer["model"]["byte_fallback"] = True
    tokenizer["decoder"] = {"type": "Sequence", "decoders": [tokenizer["decoder"]]}
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f, ensure_ascii=False)


def save_mamba2_hybrid(model, folder: str, config_as_the_hub_writes) -> None:
    """model's weights drawn (A_log, dt_bias and D in [-1, 1], the rest N(0, 0.05)) and saved with its config.json
    rewritten as the Hub's releases write it, and the fixture llama's tokenizer."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", ".D")):
                p.uniform_(-1, 1)
            else:
                p.normal_(0, 0.05)
    model.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        saved = config_as_the_hub_writes(json.load(f))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(saved, f)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(HERE, "fixtures", "llama", name), folder)


def make_granitehybrid(folder: str) -> None:
    import transformers

    kinds = ["mamba", "mamba", "attention", "mamba"]
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
        layer_types=kinds, num_local_experts=0, num_experts_per_tok=0, intermediate_size=96,
        shared_intermediate_size=96, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=16,
        mamba_expand=2, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
        logits_scaling=3.0, position_embedding_type="nope", max_position_embeddings=512, eos_token_id=2)
    # (transformers writes its own names of the layer kinds back)
    save_mamba2_hybrid(transformers.GraniteMoeHybridForCausalLM(config).eval(), folder,
                       lambda saved: {**saved, "layer_types": kinds})


def make_nemotron_h(folder: str) -> None:
    import transformers

    config = transformers.NemotronHConfig(
        vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layers_block_type=["mamba", "mlp", "attention", "mlp", "mamba", "mamba", "mlp"], intermediate_size=96,
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, max_position_embeddings=512,
        eos_token_id=2)

    def as_the_hub_writes(saved: dict) -> dict:  # a pattern string, no experts' keys
        saved = {k: v for k, v in saved.items() if k not in ("layers_block_type", "mtp_layers_block_type", "n_group")
                 and not any(w in k for w in ("expert", "moe", "routed", "topk"))}
        return {**saved, "hybrid_override_pattern": "M-*-MM-", "num_hidden_layers": 7}

    save_mamba2_hybrid(transformers.NemotronHForCausalLM(config).eval(), folder, as_the_hub_writes)


def make_falcon_h1(folder: str) -> None:
    import transformers

    config = transformers.FalconH1Config(
        vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=3, intermediate_size=96, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=16, max_position_embeddings=512, eos_token_id=2, embedding_multiplier=2.0,
        lm_head_multiplier=0.5, key_multiplier=0.7, attention_in_multiplier=1.3, attention_out_multiplier=0.8,
        ssm_in_multiplier=1.2, ssm_out_multiplier=0.9, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.6],
        mlp_multipliers=[1.1, 0.7], mamba_rms_norm=True, mamba_norm_before_gate=False)
    save_mamba2_hybrid(transformers.FalconH1ForCausalLM(config).eval(), folder, lambda saved: saved)


def make_granite_swa(folder: str) -> None:
    import torch
    import transformers

    thetas = [1e4, 0.0, 1e4, 1e4]
    config = transformers.AutoConfig.for_model(
        "granite_swa", vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
        layer_rope_theta=thetas, embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5,
        logits_scaling=4.0, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.15)
    model.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    saved.update(architectures=["GraniteSWAForCausalLM"], no_rope_layers=[int(t > 0) for t in thetas],
                 rope_theta=1e4)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(saved, f)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(HERE, "fixtures", "llama", name), folder)


def make_mistral3(folder: str) -> None:
    import torch
    import transformers

    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
    config = transformers.Ministral3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rope_parameters=rope, eos_token_id=2,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Ministral3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # (queries and keys large enough that the rotation shows)
            p.normal_(0, 0.4 if name.endswith(("q_proj.weight", "k_proj.weight")) else 0.2)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(HERE, "fixtures", "llama", name), folder)


def make_command_r(folder: str) -> None:
    import torch
    import transformers

    config = transformers.CohereConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, logit_scale=0.3, eos_token_id=2, pad_token_id=0,
        bos_token_id=1)
    torch.manual_seed(0)
    model = transformers.CohereForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.4 if name.endswith(("q_proj.weight",
                                                                                             "k_proj.weight")) else 0.2)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(HERE, "fixtures", "llama", name), folder)


CONVERT = r'''
import runpy, sys
source = sys.argv.pop(1)
sys.path[0:0] = [source, source + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # (the fixture's byte-level BPE: GPT-2's split)


class AsWritten:  # config.json as the folder has it, not transformers' defaults added
    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise ValueError("read config.json as written")


base.AutoConfig = AsWritten
sys.argv[0] = source + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
'''
CASES = {"gemma4": make_gemma4, "granitehybrid": make_granitehybrid, "nemotron_h": make_nemotron_h,
         "mistral3": make_mistral3, "command-r": make_command_r, "falcon-h1": make_falcon_h1,
         "granite_swa": make_granite_swa, "gemma4-q8_0": lambda folder: make_gemma4(folder, per_layer=16)}
OUTTYPES = {"gemma4-q8_0": "q8_0"}  # (else f16)


LLAMA_LORA = r'''
import json, sys
from llama_cpp import Llama
path, lora, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = Llama(model_path=path, lora_path=lora, logits_all=True, n_ctx=64, n_threads=2, verbose=False, type_k=0,
            type_v=0)
llm.eval(ids)
print(json.dumps({"logits": [list(map(float, row)) for row in llm.scores[:len(ids)]]}))
'''
CONVERT_LORA = CONVERT.replace("convert_hf_to_gguf.py", "convert_lora_to_gguf.py")


def make_lora(args) -> None:
    import peft
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.05)
    peft_folder = os.path.join(OUT, "lora-peft")
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(HERE, "fixtures", "llama", name), folder)
        bases = {"logits": os.path.join(OUT, "lora-base.gguf"), "logits_q8_0": os.path.join(OUT, "lora-base-q8_0.gguf")}
        adapter = os.path.join(OUT, "lora-adapter.gguf")
        for kind, base in bases.items():
            subprocess.run([sys.executable, "-c", CONVERT, args.llama_src, folder, "--outtype",
                            "q8_0" if kind.endswith("q8_0") else "f16", "--outfile", base], check=True,
                           capture_output=True)
        lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        lora.save_pretrained(peft_folder)
        os.remove(os.path.join(peft_folder, "README.md"))
        subprocess.run([sys.executable, "-c", CONVERT_LORA, args.llama_src, peft_folder, "--base", folder,
                        "--outtype", "f32", "--outfile", adapter], check=True, capture_output=True)
    logits = {}
    for kind, base in bases.items():
        result = subprocess.run([args.llama_python, "-c", LLAMA_LORA, base, adapter, json.dumps(IDS)],
                                capture_output=True, text=True, check=True)
        logits[kind] = json.loads(result.stdout)["logits"]
    with open(os.path.join(OUT, "lora.json"), "w") as f:
        json.dump({"ids": IDS, **logits}, f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-python", required=True, help="a python with llama-cpp-python installed")
    p.add_argument("--llama-src", required=True, help="llama.cpp's source (convert_hf_to_gguf.py, gguf-py/)")
    p.add_argument("--only", choices=[*CASES, "lora"], help="make this case's files alone")
    args = p.parse_args()
    os.makedirs(OUT, exist_ok=True)
    if args.only in (None, "lora"):
        make_lora(args)
    for name, make in CASES.items():
        if args.only not in (None, name):
            continue
        path = os.path.join(OUT, f"{name}.gguf")
        with tempfile.TemporaryDirectory() as folder:
            make(folder)
            subprocess.run([sys.executable, "-c", CONVERT, args.llama_src, folder, "--outtype",
                            OUTTYPES.get(name, "f16"), "--outfile", path], check=True, capture_output=True)
        result = subprocess.run([args.llama_python, "-c", LLAMA, path, json.dumps(IDS), json.dumps(TEXTS)],
                                capture_output=True, text=True, check=True)
        with open(os.path.join(OUT, f"{name}.json"), "w") as f:
            json.dump({"ids": IDS, "texts": TEXTS, **json.loads(result.stdout)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
