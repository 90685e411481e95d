"""The rope scalings of the families, as transformers computes them (dense.py computes plain, dynamic and linear):
each (config, rope_scaling, powers [R/2] = base^(2i/R), the original context, seq_len) -> (frequencies [R/2], the
attention factor that scales cos and sin). Importing this module adds them to dense.ROPE_SCALINGS (checkpoint.py
does, so every loader has them); checkpoint.ROPE_SCALINGS lists the keys each reads."""

import math

import torch

import dense


def factors_rope(config, scaling, powers, original, seq_len):  # a divisor per frequency (a GGUF's rope_freqs)
    return 1.0 / powers / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0


def llama3_rope(config, scaling, powers, original, seq_len):
    """Long wavelengths divided by factor, short ones kept, a smooth blend between."""
    inv_freq = 1.0 / powers
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, blended, scaled), 1.0


def longrope(config, scaling, powers, original, seq_len):
    """Phi-3: its long factors when seq_len exceeds the original context (a cache longer than that: every position,
    as llama.cpp chooses by its context size), its short ones otherwise."""
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = scaling["long_factor"] if seq_len > original else scaling["short_factor"]
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * powers), attention


def yarn_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_rope(config, scaling, powers, original, seq_len):
    """Frequencies blended between interpolated (slow ones) and extrapolated (fast ones) by a linear ramp."""
    dim, base = config.rope_dim(), config.rope_theta
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * powers)) * (1 - extrapolate) + (1.0 / powers) * extrapolate
    return inv_freq, float(attention)


def proportional_rope(config, scaling, powers, original, seq_len):
    """Gemma 4's full layers: the first partial_rotary_factor of the pairs turn as plain rope over the whole head,
    the rest not at all (frequency 0), the head rotated whole."""
    turned = int(scaling["partial_rotary_factor"] * len(powers))
    inv_freq = 1.0 / powers / scaling.get("factor", 1.0)
    return torch.where(torch.arange(len(powers)) < turned, inv_freq, torch.zeros(())), 1.0


dense.ROPE_SCALINGS.update({"factors": factors_rope, "llama3": llama3_rope, "longrope": longrope, "yarn": yarn_rope,
                            "proportional": proportional_rope})
