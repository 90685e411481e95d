"""families/: each supported checkpoint family's config and tensor names, mapped to dense.py's native ones.

The Llama-layout families differ in a few switches and defaults: one table (llama.py: FAMILIES, model type -> Family)
holds them and serves both their Hugging Face folders and their GGUF files. Every other family is one module holding
its Hugging Face reader (read_hf), its GGUF reader (GGUF: a gguf_import.Architecture) and its tensor names; what the
readers repeat is in common.py, what the hybrids share in hybrid.py. Every reader returns a checked DenseConfig and a
table {native name: thunk} whose thunks read, slice or merge the family's tensors on demand (checkpoint.py). This
package dispatches by what a file says it is: HF_FAMILIES by config.json's model_type, GGUF_FAMILIES by a GGUF's
architecture (gguf_import.read_gguf), read_torch_file by a state dict's config; convert.py dispatches to these by
what a path holds.

| family                       | module         | what is on disk                                               |
| ---------------------------- | -------------- | ------------------------------------------------------------- |
| ShellElastic                 | (convert.py)   | native: config.json + model.safetensors                       |
| Sprout                       | sprout         | ckpt.pt {"model", "config": {vocab_size, dim, n_layers, ...}}  |
| GermanGPT                    | germangpt      | checkpoint.pt {"config": {d_model, n_kv_heads, ...}, "model"}   |
| OpenELM                      | openelm        | Hugging Face folder, model_type "openelm"                      |
| GPT-NeoX                     | gpt_neox       | Hugging Face folder, model_type "gpt_neox"; GGUF gptneox;       |
|                              |                | the original release: global_step*/layer_NN-model_0R-          |
|                              |                | model_states.pt + configs/*.yml                                |
| Qwen3.5 / 3.6                | qwen3_5        | qwen3_5, qwen3_5_text; GGUF qwen35                             |
| Qwen3.5 MoE, Qwen3-Next      | qwen3_5        | qwen3_5_moe, qwen3_5_moe_text; qwen3_next                      |
| OLMo hybrid                  | olmo_hybrid    | olmo_hybrid                                                    |
| LFM2, LFM2-MoE, LFM3         | lfm2, lfm3     | lfm2 (GGUF lfm2), lfm2_moe, lfm3                               |
| Granite 4.0 H                | granite_hybrid | granitemoehybrid; GGUF granitehybrid                           |
| Nemotron-H                   | nemotron_h     | nemotron_h; GGUF nemotron_h                                    |
| Falcon-H1                    | falcon_h1      | falcon_h1; GGUF falcon-h1                                      |
| Gemma 4                      | gemma4         | gemma4, gemma4_text; GGUF gemma4                               |
| the FAMILIES table (21)      | llama          | Hugging Face folder, model_type llama, mistral, qwen2, qwen3,  |
|                              |                | gemma, gemma2, gemma3_text, phi3, smollm3, granite, olmo2,     |
|                              |                | olmo3, stablelm, seed_oss, glm4, cohere, cohere2, exaone4,     |
|                              |                | apertus, hunyuan_v1_dense, ministral3 (also inside mistral3,   |
|                              |                | the image-text wrapper), apertus1p5_text (also inside          |
|                              |                | apertus1p5); GGUF files of each row's `gguf` architecture      |
"""

from __future__ import annotations

from dense_engine.formats.checkpoint import Checkpoint, load_pickle, open_safetensors
from dense_engine.formats.families import (
    falcon_h1,
    gemma4,
    germangpt,
    gpt_neox,
    granite_hybrid,
    lfm2,
    lfm3,
    llama,
    nemotron_h,
    olmo_hybrid,
    openelm,
    qwen3_5,
    sprout,
)
from dense_engine.formats.families.common import hf_weights, refuse_moe
from dense_engine.formats.families.gpt_neox import neox_original
from dense_engine.formats.families.openelm import openelm_widths
from dense_engine.system.errors import CheckpointError

__all__ = ["GGUF_FAMILIES", "HF_FAMILIES", "hf_weights", "neox_original", "openelm_widths", "read_torch_file",
           "refuse_moe"]

# Hugging Face folders by config.json's model_type: (folder, raw config, config path) -> (DenseConfig, table)
HF_FAMILIES = {"openelm": openelm.read_hf, "gpt_neox": gpt_neox.read_hf, "qwen3_5": qwen3_5.read_hf,
               "qwen3_5_text": qwen3_5.read_hf, "lfm2": lfm2.read_hf, "mistral3": llama.image_text,
               "apertus1p5": llama.image_text, "olmo_hybrid": olmo_hybrid.read_hf, "lfm3": lfm3.read_hf,
               "gemma4": gemma4.read_hf, "gemma4_text": gemma4.read_hf, "granitemoehybrid": granite_hybrid.read_hf,
               "nemotron_h": nemotron_h.read_hf, "falcon_h1": falcon_h1.read_hf,
               "lfm2_moe": lfm2.read_hf,
               "qwen3_5_moe": qwen3_5.read_hf, "qwen3_5_moe_text": qwen3_5.read_hf, "qwen3_next": qwen3_5.read_hf,
               **{kind: llama.hf_decoder for kind in llama.FAMILIES}}
# GGUF files by general.architecture (gguf_import.read_gguf reads them by these)
GGUF_FAMILIES = {**llama.GGUF, "qwen35": qwen3_5.GGUF, "lfm2": lfm2.GGUF, "granitehybrid": granite_hybrid.GGUF,
                 "nemotron_h": nemotron_h.GGUF, "falcon-h1": falcon_h1.GGUF, "gptneox": gpt_neox.GGUF,
                 "gemma4": gemma4.GGUF}


def read_torch_file(path: str, raw: dict | None) -> Checkpoint:
    """Sprout's ckpt.pt, GermanGPT's checkpoint.pt, or a plain state dict (.pt/.safetensors) with its config."""
    if path.endswith(".safetensors"):
        stored = {n: f() for n, f in open_safetensors(path).items()}
    else:
        stored = load_pickle(path)
    if raw is None:
        if not isinstance(stored, dict) or not isinstance(stored.get("config"), dict) or "model" not in stored:
            raise CheckpointError(f"{path}: expected a dict with 'model' (state dict) and 'config'")
        raw, stored = stored["config"], stored["model"]
    elif isinstance(stored, dict) and isinstance(stored.get("model"), dict):
        stored = stored["model"]
    if "d_model" in raw:
        config, table = germangpt.read_weights(raw, stored, path)
    elif "dim" in raw:
        config, table = sprout.read_weights(raw, stored, path)
    else:
        raise CheckpointError(f"{path}: config has neither 'dim' (Sprout) nor 'd_model' (GermanGPT)")
    return Checkpoint(path, config, table)
