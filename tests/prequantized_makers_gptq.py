"""Test-side writers of GPTQ and AWQ checkpoint tensors, laid out exactly as the quantizing libraries save them.

The libraries can't be installed here, so their packing code is the spec (our own code, not theirs):

* GPTQ: ModelCloud/GPTQModel gptqmodel/nn_modules/qlinear/__init__.py (PackableQuantLinear.pack_block,
  pack_original), gptqmodel/quantization/quantizer.py (Quantizer.find_params: the min/max grid),
  gptqmodel/quantization/gptq.py (act-order g_idx), gptqmodel/utils/model.py (convert_gptq_v2_to_v1_format: v1 =
  qzeros word minus 0x11111111 / 0x01010101); AutoGPTQ/AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py
  (the same layout, `zeros -= 1` before packing).
* AWQ: casper-hansen/AutoAWQ awq/modules/linear/gemm.py (WQLinear_GEMM.from_linear), awq/quantize/quantizer.py
  (pseudo_quantize_tensor), awq/utils/packing_utils.py (AWQ_ORDER).
* Configs: GPTQModel gptqmodel/quantization/config.py + gptqmodel/models/writer.py (v4.2.5), AutoGPTQ
  auto_gptq/quantization/config.py + auto_gptq/modeling/_base.py (save_quantized), AutoAWQ awq/models/_config.py
  (AwqConfig.to_transformers_dict).

Neither library saves a `bias` tensor for a linear without bias (the buffer is registered only when the float
linear had one; when it did, it is saved as float16 `bias` [out]).

The rounding here is plain round-to-nearest (not the GPTQ Hessian update, not AWQ's scale search): only the storage
format matters. Each writer also returns the float32 weight [out, in] the tensors mean, by a separate direct formula.
"""

from __future__ import annotations

import warnings

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ word holds column 8 * word + AWQ_ORDER[i]


def _words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes [..., n] (0 <= code < 2**bits) along the last dim, 32 // bits a word, code j at bits j*bits (low
    first), into the int64 value of each unsigned 32-bit word [..., n * bits // 32]."""
    per = 32 // bits
    assert codes.shape[-1] % per == 0, f"{codes.shape[-1]} codes do not fill {bits}-bit words"
    shifts = torch.arange(per, dtype=torch.int64) * bits
    return (codes.to(torch.int64).unflatten(-1, (-1, per)) << shifts).sum(-1)


def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit word values (int64) as the int32 with the same bits, as the checkpoints hold them."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def pack_gptq(weight: torch.Tensor, bits: int, group_size: int, sym: bool, desc_act: bool, version: int = 1,
              seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ tensors of weight [out, in] as GPTQModel / AutoGPTQ save them, and the float32 weight they mean.

    qweight int32 [in * bits / 32, out]: word r of column o holds input channels 32/bits*r + j at bits j*bits.
    qzeros int32 [groups, out * bits / 32]: word c of row g holds the zero points of columns 32/bits*c + j likewise;
      checkpoint_format "gptq" (version=1) stores each zero point minus one (the whole word minus 0x11111111 for
      4 bits, 0x01010101 for 8, as GPTQModel's v2 -> v1 conversion does), "gptq_v2" (version=2) stores it as is.
    scales float16 [groups, out]; g_idx int32 [in]: the group of each input channel. W[o, i] = scales[g, o] *
      (q[i, o] - zero[g, o]) with g = g_idx[i].
    Grid per (group, output row), as GPTQModel's Quantizer.find_params: the range [min(x, 0), max(x, 0)], sym:
      symmetric about 0 and zero = 2**(bits-1); else zero = round(-xmin / scale); q = clamp(round(x/scale) + zero).
    desc_act: a random permutation (seed) of the input channels is the quantization order, group g = the channels
      at positions [g * group_size, (g+1) * group_size) of it, so g_idx is not monotone (act-order's g_idx[invperm]).
    group_size -1: one group over all input channels (g_idx all 0, one row of scales and qzeros).
    A v1 asymmetric zero point of 0 (a group with no negative weight, e.g. torch.rand weights) underflows: GPTQModel
      borrows from the next code of the word (its loader's word-wise + 0x11111111 undoes it), AutoGPTQ sets all
      higher bits. Kept as GPTQModel writes it, and warned of; the returned weight means zero 0.
    """
    assert bits in (4, 8) and version in (1, 2)
    out, n_in = weight.shape
    maxq = 2**bits - 1
    size = n_in if group_size == -1 else group_size
    order = torch.randperm(n_in, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(n_in)
    position = torch.empty(n_in, dtype=torch.long)
    position[order] = torch.arange(n_in)
    g_idx = position // size  # channel -> group
    groups = -(-n_in // size)

    w = weight.detach().float()
    scale = torch.empty(groups, out)
    zero = torch.empty(groups, out)
    for g in range(groups):
        x = w[:, g_idx == g]
        xmin, xmax = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = torch.where(xmin < 0, -xmax, xmin)
        both = (xmin == 0) & (xmax == 0)
        xmin, xmax = torch.where(both, -1.0, xmin), torch.where(both, 1.0, xmax)
        scale[g] = (xmax - xmin) / maxq
        zero[g] = torch.full_like(xmin, 2 ** (bits - 1)) if sym else torch.round(-xmin / scale[g])
    q = torch.clamp(torch.round(w / scale[g_idx].t()) + zero[g_idx].t(), 0, maxq).to(torch.int64)  # [out, in]
    zero = zero.to(torch.int64)

    qzeros = _words(zero, bits)
    if version == 1:
        if (zero == 0).any():
            warnings.warn("GPTQ v1 with a zero point of 0: the stored zero point underflows (as the libraries do)")
        qzeros = qzeros - sum(1 << s for s in range(0, 32, bits))  # 0x11111111 / 0x01010101
    scales = scale.to(torch.float16)
    tensors = {"qweight": _int32(_words(q, bits).t()),  # packed along in: [out, in/per] -> [in/per, out]
               "qzeros": _int32(qzeros),
               "scales": scales,
               "g_idx": g_idx.to(torch.int32)}
    meant = scales.float()[g_idx].t() * (q - zero[g_idx].t()).float()
    return tensors, meant


def pack_awq(weight: torch.Tensor, group_size: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AWQ GEMM 4-bit tensors of weight [out, in] as AutoAWQ's WQLinear_GEMM.from_linear saves them, and the
    float32 weight they mean. (seed is unused: AWQ's groups are contiguous; kept for a uniform signature.)

    qweight int32 [in, out / 8]: row i, word c holds columns 8c + AWQ_ORDER[k] (AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7)
      at bits 4k, i.e. the word's nibbles are the columns 8c+0, 8c+2, 8c+4, 8c+6, 8c+1, 8c+3, 8c+5, 8c+7.
    qzeros int32 [in / group, out / 8]: the zero points, packed the same way (stored as is, never minus one).
    scales float16 [in / group, out]. W[o, i] = scales[i // group, o] * (q[i, o] - zero[i // group, o]).
    Grid as AutoAWQ's pseudo_quantize_tensor (zero_point=True): per (output row, contiguous group of group_size
      input channels), scale = max(max - min, 1e-5) / 15, zero = clamp(-round(min / scale), 0, 15),
      q = clamp(round(w / scale) + zero, 0, 15). group_size -1: one group over all input channels.
    """
    out, n_in = weight.shape
    size = n_in if group_size == -1 else group_size
    assert n_in % size == 0 and out % 8 == 0
    w = weight.detach().float().reshape(out, n_in // size, size)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-5) / 15
    zero = (-torch.round(lo / scale)).clamp(0, 15)
    q = torch.clamp(torch.round(w / scale) + zero, 0, 15).to(torch.int64).reshape(out, n_in)
    scale, zero = scale[..., 0].t(), zero[..., 0].t().to(torch.int64)  # [groups, out]

    def pack(codes: torch.Tensor) -> torch.Tensor:  # [rows, out] -> [rows, out / 8], columns in AWQ_ORDER
        columns = (torch.arange(out) // 8 * 8) + torch.tensor(AWQ_ORDER).repeat(out // 8)
        return _int32(_words(codes[:, columns], 4))

    scales = scale.to(torch.float16)
    tensors = {"qweight": pack(q.t()), "qzeros": pack(zero), "scales": scales}
    group = torch.arange(n_in) // size
    meant = scales.float()[group].t() * (q - zero[group].t()).float()
    return tensors, meant


def gptq_config(bits: int, group_size: int, sym: bool, desc_act: bool, version: int = 1,
                writer: str = "gptqmodel") -> dict:
    """config.json's "quantization_config" of a GPTQ checkpoint. writer "gptqmodel": GPTQModel 2.x-4.x
    (QuantizeConfig.to_dict after save_quantized's meta_set calls; None values dropped; figures from v4.2.5);
    "autogptq": AutoGPTQ 0.7 (BaseQuantizeConfig.to_dict: everything top level, no lm_head/pack_dtype/meta, v1 only).
    """
    form = {1: "gptq", 2: "gptq_v2"}[version]
    if writer == "autogptq":
        assert version == 1, "AutoGPTQ writes only checkpoint_format gptq"
        return {"bits": bits, "group_size": group_size, "damp_percent": 0.01, "desc_act": desc_act,
                "static_groups": False, "sym": sym, "true_sequential": True, "model_name_or_path": None,
                "model_file_base_name": None, "quant_method": "gptq", "checkpoint_format": form}
    assert writer == "gptqmodel"
    return {"bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym, "lm_head": False,
            "quant_method": "gptq", "checkpoint_format": form, "pack_dtype": "int32",
            "meta": {"quantizer": ["gptqmodel:4.2.5"], "uri": "https://github.com/modelcloud/gptqmodel",
                     "damp_percent": 0.05, "damp_auto_increment": 0.01, "static_groups": False,
                     "true_sequential": True, "mse": 0.0, "v2": False, "v2_alpha": 0.25, "act_group_aware": False}}


def awq_config(group_size: int) -> dict:
    """config.json's "quantization_config" of an AutoAWQ GEMM checkpoint (AwqConfig.to_transformers_dict)."""
    return {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4, "version": "gemm",
            "modules_to_not_convert": None}
