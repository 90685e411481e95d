"""Make tiny compressed-tensors (llm-compressor style) Llama checkpoints for tests.

Everything quantization-related is done by the compressed-tensors library itself:
its preset schemes, apply_quantization_config, calculate_qparams (from the
weights' min/max, like llm-compressor's min-max observer), ModelCompressor's
compress_model / update_config, and its compressors' decompress for the oracle.
"""

import json
import os
import shutil

import torch
from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import (
    calculate_qparams,
    maybe_pad_tensor_for_block_quant,
)
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "llama")

# Weight-only presets that compressed-tensors' PRESET_SCHEMES lacks (its own
# "W8A16" is int8 symmetric group 128 in 0.20; older releases made it per channel).
EXTRA_PRESETS = {
    "W8A16_CHANNEL": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
    "W4A16_G32": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
    "W4A16_CHANNEL": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"},
}


def _min_max(w: torch.Tensor, args: QuantizationArgs):
    """Min/max of a [out, in] weight over each tensor/channel/group/block."""
    if args.strategy == "tensor":
        return w.amin(), w.amax()
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    if args.strategy == "group":
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    if args.strategy == "block":
        bh, bw = args.block_structure  # partial blocks (k/v_proj: 64 rows) are zero-padded
        b = maybe_pad_tensor_for_block_quant(w, (bh, bw))
        b = b.unflatten(0, (-1, bh)).unflatten(-1, (-1, bw))
        return b.amin((1, 3)), b.amax((1, 3))
    raise ValueError(f"unsupported weight strategy {args.strategy}")


def make_compressed_tensors(folder: str, preset: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Save a tiny random Llama quantized with compressed-tensors preset `preset`
    (W4A16, W4A16_ASYM, W8A16, W8A16_CHANNEL, W4A16_G32, W4A16_CHANNEL, FP8,
    FP8_DYNAMIC, FP8_BLOCK) into `folder` as llm-compressor would, and return
    {linear name: float32 [out, in] weight} as the library decompresses it
    back from the saved files."""
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.05)

    if preset in EXTRA_PRESETS:
        weights = QuantizationArgs(**EXTRA_PRESETS[preset])
        scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    else:
        scheme = preset_name_to_scheme(preset, targets=["Linear"])
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head"}

    # Static input scales (FP8 preset): calibrate each Linear's input min/max on one prompt.
    in_args = scheme.input_activations
    seen = {}

    def observe(name):
        return lambda module, args: seen.__setitem__(name, args[0].aminmax())

    if in_args is not None and not in_args.dynamic:
        hooks = [m.register_forward_pre_hook(observe(n)) for n, m in linears.items()]
        with torch.no_grad():
            model(torch.arange(64)[None] * 7 % config.vocab_size)
        for h in hooks:
            h.remove()

    qconfig = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, qconfig)
    with torch.no_grad():
        for name, m in linears.items():
            args = m.quantization_scheme.weights
            scale, zp = calculate_qparams(*_min_max(m.weight, args), args)
            m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
            m.weight_zero_point.copy_(zp.reshape(m.weight_zero_point.shape))
            if name in seen:
                scale, zp = calculate_qparams(*seen[name], in_args)
                m.input_scale.copy_(scale.reshape(m.input_scale.shape))
                m.input_zero_point.copy_(zp.reshape(m.input_zero_point.shape))
            m.quantization_status = QuantizationStatus.FROZEN

    # llm-compressor's save path: compress in memory, save, then write quantization_config.
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(FIXTURES, f), folder)

    # Oracle: the library's own decompression of what was written to disk.
    with open(os.path.join(folder, "config.json")) as f:
        saved = QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    decompressor = BaseCompressor.get_value_from_registry(saved.format)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    out = {}
    for name in linears:
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        weight = decompressor.decompress(local, saved.config_groups["group_0"])["weight"]
        out[name] = weight.float()
    return out
