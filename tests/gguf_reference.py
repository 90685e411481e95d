"""The llama.cpp references tests/test_gguf.py compares with: for each tiny GGUF file of tests/gguf_cases.py (every
architecture and tokenizer kind gguf_import reads), llama.cpp's logits at every position of a fixed prompt and its
token ids for a set of texts. Made once; the files they come from are rewritten by the tests, bit for bit.

    python tests/gguf_reference.py --llama-python VENV/bin/python      # -> tests/fixtures/gguf/reference.*
    python tests/gguf_reference.py --llama-python VENV/bin/python --kquant-prefill   # -> .../kquant_prefill.*
    python tests/gguf_reference.py --llama-python VENV/bin/python --experts-kquant   # -> .../experts_kquant.*
    python tests/gguf_reference.py --llama-python VENV/bin/python --state   # -> .../state_reference.*
    python tests/gguf_reference.py --llama-python VENV/bin/python --add olmo2,olmo3   # those cases, added

--kquant-prefill: llama.cpp's logits of a 40-token prefill on tests/test_gguf_blocks.py's mixed K-quant file (its
quantized matmuls round x to 8 bits; the test holds this engine's to no farther from the float path).
--state: the same references for the hybrids whose other layers keep a state (gguf_cases.STATE_FILES: qwen35, lfm2
and quantized qwen35 files; llama-cpp-python 0.3.36 runs them), in files of their own: the others stay as they are.

llama-cpp-python runs in its own process and virtualenv (how to build it: bench/llamacpp.py), never in the project.
Its KV cache is kept in float32 (llama.cpp's default, float16, would round every key and value). Each file is also
checked against transformers' forward of the same weights in their Hugging Face layout, which shows that the files
are laid out as llama.cpp's converter lays them out (a wrong permutation or a missing Gemma +1 shows as a large
difference); the differences are recorded beside the references.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import gguf_cases

OUT = os.path.join(ROOT, "tests", "fixtures", "gguf")

WORKER = r"""
import json, sys
import numpy as np
import llama_cpp
path, ids, texts, out = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
llm = llama_cpp.Llama(model_path=path, n_ctx=128, n_batch=128, logits_all=True, type_k=0, type_v=0,
                      flash_attn=False, verbose=False, n_threads=2)
llm.eval(ids)
np.save(out, np.asarray(llm.scores[: len(ids)], dtype=np.float32))
tokens = {t: [llm.tokenize(t.encode(), add_bos=False, special=True),
              llm.tokenize(t.encode(), add_bos=True, special=True)] for t in texts}
print(json.dumps(tokens))
"""


def llama_cpp(python: str, path: str, ids: list[int], texts: list[str]):
    import numpy as np

    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "logits.npy")
        result = subprocess.run([python, "-c", WORKER, path, json.dumps(ids), json.dumps(texts), out],
                                capture_output=True, text=True, check=False)
        if result.returncode:
            sys.exit(f"llama.cpp failed on {path}:\n{result.stderr[-3000:]}")
        return np.load(out), json.loads(result.stdout.splitlines()[-1])


def transformers_logits(case: str, ids: list[int]):
    """transformers' forward of the case's weights in their Hugging Face layout (the model llama.cpp's converter
    would have read)."""
    import transformers

    s = gguf_cases.spec(case)
    arch, V = s["arch"], gguf_cases.vocab_size(case)
    if arch in gguf_cases.STATE_ARCHITECTURES:
        return state_transformers_logits(case, ids)
    values = {"vocab_size": V, "hidden_size": s["hidden"], "intermediate_size": s["ffn"],
              "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
              "head_dim": s["head_dim"], "max_position_embeddings": s["context"], "rms_norm_eps": s["eps"],
              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    rope = {"rope_type": "default", "rope_theta": s["theta"]}
    model_type = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2",
                  "gemma3": "gemma3_text", "phi3": "phi3", "smollm3": "smollm3", "granite": "granite",
                  "olmo2": "olmo3" if s.get("window") else "olmo2", "exaone4": "exaone4", "seed_oss": "seed_oss",
                  "glm4": "glm4", "cohere2": "cohere2", "apertus": "apertus", "hunyuan-dense": "hunyuan_v1_dense",
                  "stablelm": "stablelm", "gptneox": "gpt_neox"}[arch]
    if s.get("llama3"):
        rope = {"rope_type": "llama3", "rope_theta": s["theta"], "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    if arch == "gemma2":
        values.update(sliding_window=s["window"], query_pre_attn_scalar=s["head_dim"],
                      attn_logit_softcapping=s["attn_softcap"], final_logit_softcapping=s["final_softcap"])
    if arch == "gemma3":
        values.update(sliding_window=s["window"], query_pre_attn_scalar=s["head_dim"], sliding_window_pattern=6)
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": s["theta"], "factor": s["linear_factor"]}}
    if arch == "phi3":
        short, long = gguf_cases.longrope_factors(s)
        values.update(original_max_position_embeddings=s["original_context"],
                      partial_rotary_factor=s["rotary"] / s["head_dim"])
        rope = {"rope_type": "longrope", "rope_theta": s["theta"], "partial_rotary_factor": s["rotary"] / s["head_dim"],
                "short_factor": short.tolist(), "long_factor": long.tolist()}
    if arch == "smollm3":  # (llama.cpp: every 4th layer without rope, no window)
        values.update(no_rope_layer_interval=4, use_sliding_window=False, tie_word_embeddings=True)
    if arch == "granite":
        m = s["multipliers"]
        values.update(attention_multiplier=m["attention"], embedding_multiplier=m["embedding"],
                      residual_multiplier=m["residual"], logits_scaling=m["logits"], tie_word_embeddings=True)
    if arch == "olmo2" and s.get("window"):  # OLMo 3: the local layers rotate with the same base, unscaled
        values.update(sliding_window=s["window"], layer_types=["full_attention" if (i + 1) % 4 == 0 else
                                                               "sliding_attention" for i in range(s["layers"])])
        rope = {kind: {"rope_type": "default", "rope_theta": s["theta"]} for kind in ("sliding_attention",
                                                                                       "full_attention")}
    if arch == "exaone4":  # (no window: every layer rotates, as llama.cpp runs any but the 32B)
        values.update(sliding_window=None, layer_types=["full_attention"] * s["layers"])
    if arch == "seed_oss":
        values.update(attention_bias=True, attention_out_bias=False)
    if arch == "cohere2":  # every 4th layer full, without rope
        values.update(sliding_window=s["window"], logit_scale=s["logit_scale"], layer_norm_eps=s["eps"],
                      layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                                   for i in range(s["layers"])], tie_word_embeddings=True)
    if arch == "glm4":
        values.update(attention_bias=True, partial_rotary_factor=s["rotary"] / s["head_dim"])
        rope["partial_rotary_factor"] = s["rotary"] / s["head_dim"]
    if arch == "apertus":
        values["hidden_act"] = "xielu"
    if arch == "gptneox":  # (q, k and v interleaved by head; biases; parallel branches)
        values.update(layer_norm_eps=s["eps"], use_parallel_residual=True, tie_word_embeddings=False)
        rope["partial_rotary_factor"] = s["rotary"] / s["head_dim"]
    if arch == "stablelm":  # (no rms_norm_eps: layer norms)
        values.update(use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=False, layer_norm_eps=s["eps"],
                      partial_rotary_factor=s["rotary"] / s["head_dim"])
        rope["partial_rotary_factor"] = s["rotary"] / s["head_dim"]
    if arch in ("llama", "qwen2", "qwen3", "phi3", "olmo2", "exaone4", "seed_oss", "glm4", "apertus", "hunyuan-dense",
                "stablelm"):
        values["tie_word_embeddings"] = False
    config = transformers.AutoConfig.for_model(model_type, rope_parameters=rope, **values)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return forward(model, case, ids)


def state_transformers_logits(case: str, ids: list[int]):
    """Qwen3_5ForCausalLM's or Lfm2ForCausalLM's forward of the case's weights."""
    import transformers

    config = gguf_cases.state_hf_config(case)
    config._attn_implementation = "eager"
    kind = transformers.Lfm2ForCausalLM if gguf_cases.spec(case)["arch"] == "lfm2" else transformers.Qwen3_5ForCausalLM
    return forward(kind(config), case, ids)


def forward(model, case: str, ids: list[int]):
    """model's float32 logits for ids, its weights the case's in their Hugging Face layout (but Qwen3.5's mtp.* layer,
    which transformers does not build)."""
    import torch

    model = model.float().eval()
    state = {k: torch.from_numpy(v) for k, v in gguf_cases.hf_weights(case).items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        sys.exit(f"{case}: the Hugging Face layout does not fit transformers' model: {missing} {unexpected}")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def kquant_prefill(python: str, stem: str = "kquant_prefill") -> int:
    """llama.cpp's logits of a 40-token prompt on one seeded file: test_gguf_blocks.py's mixed K-quant llama
    (kquant_prefill), or test_experts_gguf.py's mixture with K-quant experts (experts_kquant)."""
    import hashlib

    import numpy as np
    from safetensors.numpy import save_file

    ids = np.random.default_rng(3).integers(0, 400, 40).tolist()
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, f"{stem}.gguf")
        if stem == "kquant_prefill":
            import test_gguf_blocks

            test_gguf_blocks.write_mixed(path, tied=False)
        else:
            import test_experts_gguf

            test_experts_gguf.write_kquant_mixture(path)
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        logits, _ = llama_cpp(python, path, ids, [])
    save_file({"logits": logits}, os.path.join(OUT, f"{stem}.safetensors"))
    with open(os.path.join(OUT, f"{stem}.json"), "w") as f:
        json.dump({"digest": digest, "ids": ids}, f)
    print(f"wrote {OUT}/{stem}.json and {stem}.safetensors")
    return 0


def references(python: str, cases: dict, texts: list[str]) -> tuple[dict, dict]:
    """(record, {name: llama.cpp's logits}) for files {name: (case, type of its quantized tensors)}: each written,
    run by llama.cpp (logits, and token ids of texts), and checked against transformers' forward of the same weights
    (not a file of random K-quant blocks: no weights of their own)."""
    import numpy as np

    record, arrays = {"cases": {}, "texts": texts}, {}
    with tempfile.TemporaryDirectory() as work:
        for name, (case, qtype) in cases.items():
            path = os.path.join(work, f"{name}.gguf")
            digest = gguf_cases.write(case, path, qtype)
            ids = gguf_cases.input_ids(case)
            logits, tokens = llama_cpp(python, path, ids, texts)
            arrays[name] = logits
            record["cases"][name] = {"digest": digest, "ids": ids, "tokens": tokens}
            if qtype == gguf_cases.Q.Q4_K:
                print(f"{name:12s} digest {digest}  (random K-quant blocks: no transformers model)")
                continue
            hf = transformers_logits(case, ids)
            versus_hf = float(np.abs(logits - hf).max() / np.abs(hf).max())
            argmax = float((logits.argmax(-1) == hf.argmax(-1)).mean())
            print(f"{name:12s} digest {digest}  llama.cpp vs transformers: rel err {versus_hf:.2e}, same argmax "
                  f"{argmax:.0%}")
            if qtype is None and versus_hf > 1e-2:
                sys.exit(f"{name}: llama.cpp and transformers disagree: the file is not laid out as llama.cpp's "
                         "converter would")
            record["cases"][name]["llama_cpp_vs_transformers"] = round(versus_hf, 6)
    return record, arrays


def save(record: dict, arrays: dict, stem: str) -> None:
    from safetensors.numpy import save_file

    save_file(arrays, os.path.join(OUT, f"{stem}.safetensors"))
    with open(os.path.join(OUT, f"{stem}.json"), "w") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
    print(f"wrote {OUT}/{stem}.json and {stem}.safetensors")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-python", required=True, help="python of a virtualenv with llama-cpp-python")
    p.add_argument("--kquant-prefill", action="store_true", help="only the mixed K-quant file's 40-token prefill")
    p.add_argument("--experts-kquant", action="store_true", help="only the mixture with K-quant experts' 40 tokens")
    p.add_argument("--state", action="store_true", help="only the hybrids' files (qwen35, lfm2): state_reference.*")
    p.add_argument("--add", help="only these cases (a,b,...), added to reference.* beside the others as they are")
    args = p.parse_args()
    os.makedirs(OUT, exist_ok=True)
    if args.kquant_prefill:
        return kquant_prefill(args.llama_python)
    if args.experts_kquant:
        return kquant_prefill(args.llama_python, "experts_kquant")
    if args.state:
        save(*references(args.llama_python, gguf_cases.STATE_FILES, gguf_cases.STATE_TEXTS), "state_reference")
        return 0
    cases = {case: (case, None) for case in gguf_cases.CASES} | gguf_cases.QUANTIZED
    if args.add:  # these cases' references beside the others' as they are (llama.cpp's own threads vary in ~1e-6)
        record, arrays = references(args.llama_python, {c: cases[c] for c in args.add.split(",")}, gguf_cases.TEXTS)
        from safetensors.numpy import load_file

        with open(os.path.join(OUT, "reference.json")) as f:
            kept = json.load(f)
        kept["cases"].update(record["cases"])
        save(kept, load_file(os.path.join(OUT, "reference.safetensors")) | arrays, "reference")
        return 0
    save(*references(args.llama_python, cases, gguf_cases.TEXTS), "reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
